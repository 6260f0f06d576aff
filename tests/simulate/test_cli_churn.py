import json

import pytest

from gpupack.simulate import churn
from gpupack.simulate.cli import main


@pytest.mark.slow
def test_churn_flag_runs_the_departures_replay(capsys):
    if churn._default_data() is None:
        pytest.skip("../shared/data/openb not present (set GPUPACK_SHARED)")
    rc = main(["--churn", "--ticks", "400", "--warmup", "100", "--sample-nodes", "20", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    assert "allocation_ratio_pct" in text and "evictions" in text


def test_churn_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["--churn", "--ticks", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpupack simulate --churn:")
