"""`gpupack simulate` end to end: real subprocesses, real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpupack.simulate.cli import main

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"n{i},{32000 if i % 2 else 96000},262144,{2 if i % 3 else 8},{'T4' if i % 3 else 'G2'}\n"
    for i in range(12)
)


def pods_csv(n: int = 60) -> str:
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli"]
    shapes = [(4000, 1, 500), (8000, 1, 1000), (2000, 0, 0), (6000, 1, 250), (16000, 2, 1000), (4000, 1, 810)]
    for i in range(n):
        c, g, m = shapes[i % len(shapes)]
        rows.append(f"p{i},{c},8192,{g},{m}")
    return "\n".join(rows) + "\n"


@pytest.fixture
def files(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(NODES)
    pods = tmp_path / "pods.csv"
    pods.write_text(pods_csv())
    return nodes, pods


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpupack", "simulate", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.slow
def test_trace_json_has_per_policy_mean_seeds_and_curves(files, tmp_path):
    nodes, pods = files
    out = tmp_path / "out"
    p = run(
        "--trace",
        str(pods),
        "--nodes",
        str(nodes),
        "--policy",
        "fgd",
        "--policy",
        "gpupack",
        "--seeds",
        "1-3",
        "--out",
        str(out),
        "--json",
        "--progress",
        "always",
        "--jobs",
        "2",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert set(doc["policies"]) == {"fgd", "gpupack"}
    for d in doc["policies"].values():
        assert set(d["per_seed"]) == {"1", "2", "3"}
        assert d["unallocated_pct_at_100"] == pytest.approx(sum(d["per_seed"].values()) / 3, abs=1e-3)
        for curve in d["curves"].values():
            assert len(curve) == 131
            assert curve[0] is not None and curve[0] > 95  # nearly nothing allocated yet
    assert (out / "replay.png").stat().st_size > 10_000
    assert "%" in p.stderr and "replaying 6 run(s)" in p.stderr  # the progress bar


def test_trace_table_default_policies(files, tmp_path):
    nodes, pods = files
    p = run(
        "--trace",
        str(pods),
        "--nodes",
        str(nodes),
        "--seeds",
        "5",
        "--out",
        str(tmp_path),
        "--no-chart",
        "--jobs",
        "1",
    )
    assert p.returncode == 0, p.stderr
    for name in ("random", "bestfit", "fgd", "gpupack"):
        assert any(line.startswith(name) for line in p.stdout.splitlines()), p.stdout
    assert not (tmp_path / "replay.png").exists()


@pytest.mark.slow
def test_fleet_scenario_table_json_and_chart(tmp_path):
    p = run("--out", str(tmp_path / "o"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    whole, ours = doc["modes"]["whole-card"], doc["modes"]["gpupack"]
    assert ours["pods_placed"] == ours["pods"] > whole["pods_placed"]
    assert ours["gpus_needed"] < whole["gpus_needed"]
    assert ours["mem_util_pct"] > 2 * whole["mem_util_pct"]
    assert (tmp_path / "o" / "fleet.png").stat().st_size > 10_000
    table = run("--out", str(tmp_path / "o2"))
    assert "GPUs needed for every replica" in table.stdout and table.returncode == 0


def test_without_matplotlib_the_figures_print_and_the_chart_is_skipped(tmp_path, capsys, monkeypatch):
    # the runtime image has no `simulate` extra: the results must still come, with one line why no chart
    from gpupack.simulate import chart

    def missing():
        raise chart.ChartUnavailable("charts need matplotlib, in gpupack's `simulate` extra")

    monkeypatch.setattr(chart, "pyplot", missing)
    assert main(["--out", str(tmp_path / "o"), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert "chart" not in doc and doc["modes"]["gpupack"]["pods_placed"] > 0
    assert out.err.strip().splitlines() == [
        "gpupack simulate: no chart: charts need matplotlib, in gpupack's `simulate` extra"
    ]
    assert not (tmp_path / "o" / "fleet.png").exists()


BAD = [
    ("name,cpu_milli,memory_mib,num_gpu\np1,1,1,1\n", "pods.csv:1: missing column 'gpu_milli'"),
    (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1,1,500\np2,-5,1,1,500\n",
        "pods.csv:3: field cpu_milli: -5 is below 0",
    ),
    (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,lots,1,500\n",
        "pods.csv:2: field memory_mib: 'lots' is not a number",
    ),
    (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1,1\n",
        "pods.csv:2: malformed row: 4 fields, header has 5",
    ),
    (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1,2,500\n",
        "pods.csv:2: field gpu_milli: 500 < 1000 with num_gpu 2",
    ),
    (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1,1,0.5\n",
        "pods.csv:2: field gpu_milli: '0.5' is not a whole number",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_pod_rows_give_one_line_with_file_line_field(files, tmp_path, capsys, text, message):
    nodes, _ = files
    bad = tmp_path / "pods.csv"
    bad.write_text(text)
    rc = main(["--trace", str(bad), "--nodes", str(nodes), "--seeds", "1", "--no-chart", "--jobs", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_bad_node_file_and_unknown_policy_in_a_real_process(files, tmp_path):
    nodes, pods = files
    bad = tmp_path / "badnodes.csv"
    bad.write_text("sn,cpu_milli,memory_mib,gpu\nn1,1,1,1\n")
    p = run("--trace", str(pods), "--nodes", str(bad))
    assert p.returncode == 2 and p.stderr.strip().endswith(
        "badnodes.csv:1: missing column 'model' (header has sn,cpu_milli,memory_mib,gpu)"
    )
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    p = run("--trace", str(pods), "--nodes", str(nodes), "--policy", "tetris")
    assert p.returncode == 2 and "--policy: unknown policy 'tetris'; choose one of" in p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    p = run("--trace", str(pods), "--nodes", str(nodes), "--seeds", "x-y")
    assert p.returncode == 2 and "--seeds" in p.stderr and p.stderr.count("\n") == 1
    p = run("--trace", str(pods))
    assert p.returncode == 2 and "--trace and --nodes go together" in p.stderr
    p = run("--trace", str(tmp_path / "missing.csv"), "--nodes", str(nodes))
    assert p.returncode == 2 and "missing.csv: cannot read" in p.stderr


def test_five_column_trace_parses(openb):
    from gpupack.simulate.openb import read_pods

    pods = read_pods(openb / "openb_pod_list_multigpu20.csv")
    assert len(pods) == 8324 and all(s is None for s in pods.spec)
    spec = read_pods(openb / "openb_pod_list_gpuspec10.csv")
    assert frozenset({"V100M16", "V100M32"}) in spec.spec


def test_bound_beside_the_policies_with_gaps_in_json_table_and_chart(files, tmp_path, capsys):
    nodes, pods = files
    base = ["--trace", str(pods), "--nodes", str(nodes), "--policy", "fgd", "--policy", "gpupack"]
    base += ["--seeds", "1-2", "--jobs", "1", "--progress", "never", "--bound"]
    assert main([*base, "--json", "--out", str(tmp_path / "o")]) == 0
    out = json.loads(capsys.readouterr().out)
    bound = out["bound"]
    assert set(bound["per_seed"]) == {"1", "2"}
    assert bound["unallocated_pct_at_100"] == pytest.approx(sum(bound["per_seed"].values()) / 2, abs=1e-3)
    assert "integrality" in bound["relaxes"]
    for name in ("fgd", "gpupack"):
        d = out["policies"][name]
        for s, v in d["per_seed"].items():
            assert bound["per_seed"][s] <= v + 1e-6  # a lower bound
            assert d["gap_to_bound"]["per_seed"][s] == pytest.approx(v - bound["per_seed"][s], abs=1e-3)
    assert Path(out["chart"]).is_file()
    assert main([*base, "--no-chart"]) == 0
    text = capsys.readouterr().out
    assert "gap to bound" in text
    assert any(line.startswith("bound ") for line in text.splitlines())


def test_without_bound_the_output_has_none(files, capsys):
    nodes, pods = files
    args = ["--trace", str(pods), "--nodes", str(nodes), "--policy", "fgd", "--seeds", "1", "--jobs", "1"]
    assert main([*args, "--json", "--no-chart", "--progress", "never"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "bound" not in out and "gap_to_bound" not in out["policies"]["fgd"]
