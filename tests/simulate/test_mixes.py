import numpy as np
import pytest

from gpupack.core.model import FULL
from gpupack.simulate.mixes import classes, proportions, resample, reshape_shares
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


def test_reshape_shares_draws_new_sizes_and_keeps_the_rest(openb):
    base = read_pods(openb / "openb_pod_list_default.csv")
    out = reshape_shares(base, seed=3)
    share = (base.num_gpu == 1) & (base.gpu_milli < FULL)
    assert (out.gpu_milli[~share] == base.gpu_milli[~share]).all()
    assert (out.cpu == base.cpu).all() and (out.num_gpu == base.num_gpu).all()
    new = out.gpu_milli[share]
    assert new.min() >= 50 and new.max() <= 950 and (new % 10 == 0).all()
    # one new size per old size: the sizes' popularity is kept
    pairs = set(zip(base.gpu_milli[share].tolist(), new.tolist(), strict=True))
    assert len(pairs) == len(np.unique(base.gpu_milli[share]))
    assert set(new.tolist()) != set(base.gpu_milli[share].tolist())
    assert (reshape_shares(base, seed=3).gpu_milli == out.gpu_milli).all()
    assert (read_pods(openb / "openb_pod_list_default.csv").gpu_milli == base.gpu_milli).all()  # input kept


@pytest.mark.parametrize("step", [0, -10, 51])
def test_reshape_shares_rejects_a_step_that_cannot_make_shares(openb, step):
    base = read_pods(openb / "openb_pod_list_default.csv")
    with pytest.raises(ValueError, match="step is milli between 1 and 50"):
        reshape_shares(base, seed=1, step=step)
