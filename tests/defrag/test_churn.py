"""`gpupack simulate --churn`: replay with departures, with and without periodic defrag."""

from __future__ import annotations

import json
import random

import pytest

from gpupack.simulate.churn import main


def write_trace(tmp_path, seed: int = 3):
    rng = random.Random(seed)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(
            f"node{i},96000,786432,{rng.choice([2, 4, 8])},{rng.choice(['T4', 'V100M32'])}\n"
            for i in range(16)
        )
    )
    pods = tmp_path / "pods.csv"
    rows = []
    for i in range(300):
        r = rng.random()
        num, milli = (
            (1, rng.choice([1000]))
            if r < 0.3
            else ((2, 1000) if r < 0.4 else (1, rng.choice([100, 250, 500, 700])))
        )
        rows.append(f"p{i},{rng.choice([1000, 4000, 8000])},{rng.choice([1024, 8192])},{num},{milli}\n")
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(rows))
    return nodes, pods


@pytest.mark.slow
def test_churn_compares_with_and_without_defrag(tmp_path, capsys):
    nodes, pods = write_trace(tmp_path)
    argv = [
        "--trace",
        str(pods),
        "--nodes",
        str(nodes),
        "--sample-nodes",
        "0",
        "--ticks",
        "600",
        "--warmup",
        "200",
        "--defrag-every",
        "25",
        "--max-evictions",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    without, with_ = doc["without_defrag"], doc["with_defrag"]
    assert without["evictions"] == 0 and without["defrag_runs"] == 0
    assert with_["defrag_runs"] == 600 // 25
    assert 0 < with_["evictions"] <= 4 * with_["defrag_runs"]
    assert with_["gpus_freed"] >= 1
    assert without["arrivals"] == with_["arrivals"] == 400
    for r in (without, with_):
        assert 0 < r["allocation_ratio_pct"] <= 100
        assert r["failed"] >= r["failed_whole_gpu"]
    # Same seed, same numbers.
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    for d in (doc, again):
        for r in (d["without_defrag"], d["with_defrag"]):
            r.pop("plan_seconds")
    assert again == doc
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "without defrag" in out and "evictions" in out


def test_churn_bad_input_is_one_line(tmp_path, capsys):
    nodes, _ = write_trace(tmp_path)
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli\nx,1\n")
    assert main(["--trace", str(bad), "--nodes", str(nodes)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpupack simulate --churn:") and err.count("\n") == 1
    assert main(["--ticks", "10", "--warmup", "20"]) == 2
