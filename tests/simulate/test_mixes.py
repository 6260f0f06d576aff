import pytest

from gpupack.simulate.mixes import classes, proportions, resample
from gpupack.simulate.openb import read_pods


def test_resample_hits_the_requested_split_and_keeps_cpu_pods(openb):
    base = read_pods(openb / "openb_pod_list_default.csv")
    mix = resample(base, 0.5, 0.1, seed=1)
    prop = proportions(mix)
    assert prop["share"] == pytest.approx(0.5, abs=0.01)
    assert prop["multi"] == pytest.approx(0.1, abs=0.01)
    assert len(classes(mix)["cpu"]) == len(classes(base)["cpu"])
    assert mix.gpu_request.sum() == pytest.approx(base.gpu_request.sum(), rel=0.01)
    again = resample(base, 0.5, 0.1, seed=1)
    assert (again.gpu_milli == mix.gpu_milli).all()


def test_resample_rejects_impossible_split(openb):
    base = read_pods(openb / "openb_pod_list_default.csv")
    with pytest.raises(ValueError, match="share \\+ multi <= 1"):
        resample(base, 0.8, 0.4, seed=1)
