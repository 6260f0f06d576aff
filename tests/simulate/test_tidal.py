"""The tidal-day simulation (gpupack simulate --tidal): demand curve, HPA-like replicas, an
autoscaled pool, night consolidation against none and the emptiest-first baseline."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpupack.core.model import ContainerRequest, PodRequest
from gpupack.simulate.cli import main
from gpupack.simulate.tidal import (
    Day,
    NodeType,
    Service,
    Settings,
    _Sim,
    demand_factor,
    embedded_day,
    hpa_floor,
    openb_day,
    replicas_at,
    simulate,
)


@pytest.mark.parametrize("swing", [3.0, 4.0, 5.0])
def test_demand_swings_between_peak_and_trough(swing):
    f = [demand_factor(h / 4, 15.0, swing) for h in range(96)]
    assert max(f) == pytest.approx(1.0) and min(f) == pytest.approx(1 / swing)
    assert demand_factor(15.0, 15.0, swing) == pytest.approx(1.0)
    assert demand_factor(3.0, 15.0, swing) == pytest.approx(1 / swing)
    svc = Service("s", PodRequest(""), 20, 15.0)
    assert replicas_at(svc, 15.0, swing) == 20 and replicas_at(svc, 3.0, swing) == hpa_floor(svc, swing)


def test_hpa_scales_down_only_after_the_stabilisation_window():
    day = Day("t", (Service("s", PodRequest("", "online", (ContainerRequest("c", 1, 1000, 100),)), 12, 0.0),),
              (NodeType("n", 4, "M", 16000, max_nodes=4),))  # fmt: skip
    sim = _Sim(day, "none", Settings(step_min=5, hpa_down_window_min=15))
    svc = day.services[0]
    assert sim.desired(svc, 12.0) == replicas_at(svc, 12.0, 4.0)  # the trough: first sample
    high = sim.desired(svc, 0.0)  # demand jumps up: at once
    assert high == 12
    # Demand falls again: the last 15 min (4 samples) still hold the high one.
    assert [sim.desired(svc, 12.0) for _ in range(4)] == [12, 12, 12, replicas_at(svc, 12.0, 4.0)]


@pytest.fixture(scope="module")
def embedded():
    return simulate(embedded_day(4.0), Settings(step_min=10))


@pytest.mark.slow
def test_night_consolidation_saves_node_hours_against_no_consolidation(embedded):
    rs = {(r["mode"], r["prescale"]): r for r in embedded["results"]}
    assert set(rs) == {(m, p) for m in ("none", "emptiest", "gpupack") for p in (True, False)}
    for p in (True, False):
        none, base, ours = rs[("none", p)], rs[("emptiest", p)], rs[("gpupack", p)]
        assert none["evictions"] == 0 and none["node_hours_saved"] == 0
        for r in (base, ours):
            assert r["evictions"] > 0 and r["nodes_emptied"] > 0 and r["consolidation_runs"] == 4
            assert r["node_hours"] < none["node_hours"] and r["node_hours_saved_pct"] > 3
            assert r["min_nodes"] < none["min_nodes"], "nodes were removed at night"
    # The pre-scale has the nodes up before the morning demand: no replica it asks for is missing.
    assert rs[("gpupack", True)]["morning_pending_max"] < rs[("gpupack", False)]["morning_pending_max"]


def test_every_pod_is_placed_or_pending_and_never_over_committed():
    sim = _Sim(embedded_day(3.0), "gpupack", Settings(step_min=15, days=1, swing=3.0))
    sim.run()
    from gpupack.core.model import invariant_violations

    assert invariant_violations(sim.state) == []
    for svc in sim.day.services:
        keys = [k for _, k in sim.pods[svc.name]]
        assert all((k in sim.state.pods) != (k in sim.pending) for k in keys)
    assert not set(sim.booting) & set(sim.state.nodes)


def test_openb_day_is_built_from_the_trace(tmp_path):
    pods = tmp_path / "pods.csv"
    rows = [
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
    ]
    # shape A: half a GPU, created around 02:00 of the trace's clock (30 pods); shape B: whole
    # GPUs around 08:00 (10 pods); CPU-only pods are not services.
    rows += [f"a{i},4000,8000,1,500,,LS,Running,{2 * 3600 + i * 60},0,0" for i in range(30)]
    rows += [f"b{i},8000,16000,1,1000,,LS,Running,{8 * 3600 + 86400 * i},0,0" for i in range(10)]
    rows += [f"c{i},8000,16000,0,0,,LS,Running,0,0,0" for i in range(50)]
    pods.write_text("\n".join(rows) + "\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},64000,262144,4,V100M32\n" for i in range(6))
    )
    day = openb_day(pods, nodes, nodes=6, services=5, fill=0.5, seed=1)
    assert [s.name for s in day.services] == ["openb-00", "openb-01"]
    a, b = day.services
    assert a.template.containers[0].milli == 500 and b.template.containers[0].milli is None
    # Peak replicas in proportion to GPU demand (A: 30 x 0.5, B: 10 x 1 GPU), filling half of the
    # 24 drawn GPUs: 12 GPUs = 14 x 0.5 + 5 x 1.
    assert a.peak == 14 and b.peak == 5
    # The trace's clock is turned so the busiest hour is 15:00; the hours between shapes stay.
    assert (b.peak_hour - a.peak_hour) % 24 == pytest.approx(8 - (2 + 14.5 / 60), abs=0.02)
    assert 12.0 < a.peak_hour < 15.0 < b.peak_hour < 20.0
    out = simulate(day, replace(Settings(step_min=15), prescale=False))
    assert [r["mode"] for r in out["results"]] == ["none", "emptiest", "gpupack"]


@pytest.mark.slow
def test_cli_tidal_json(capsys, tmp_path):
    rc = main(["--tidal", "--json", "--no-chart", "--swing", "3"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (day,) = doc["days"]
    assert day["settings"]["swing"] == 3.0 and len(day["results"]) == 6
    assert all("series" not in r and "node_hours_saved" in r for r in day["results"])


def test_cli_tidal_bad_arguments_are_one_line(capsys):
    assert main(["--tidal", "--swing", "1"]) == 2
    assert main(["--tidal", "--trace", "x.csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("gpupack simulate --tidal:") for e in err)
