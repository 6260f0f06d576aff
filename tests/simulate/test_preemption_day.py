"""The tidal day with GPU-aware preemption (gpupack simulate --tidal --preemption): offline jobs
fill the night, online demand returns in the morning; with and without preemption, on the same
arrivals. A reduced day keeps most tests to a second or two; the default day's are `slow`."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupack.core.model import ContainerRequest, PodRequest, invariant_violations
from gpupack.simulate.cli import main
from gpupack.simulate.preemption import (
    MODES,
    InvariantBroken,
    JobShape,
    Scenario,
    Settings,
    _Sim,
    embedded_scenario,
    job_weight,
    offline_arrivals,
    percentile,
    simulate,
)
from gpupack.simulate.tidal import NodeType, Service

H100 = NodeType("h100", 4, "H100", 81920)
T4 = NodeType("t4", 4, "T4", 15360)


def share(mem: int, sm_pct: int, gpus: int = 1) -> ContainerRequest:
    return ContainerRequest("main", gpus, mem, sm_pct * 10)


def online(name: str, c: ContainerRequest, peak: int, hour: float, models: set[str] | None = None) -> Service:
    pod = PodRequest("", "online", (c,), gpu_models=frozenset(models) if models else None)
    return Service(name, pod, peak, hour)


def job(name: str, c: ContainerRequest, weight: float) -> JobShape:
    return JobShape(name, PodRequest("", "offline", (c,)), weight)


SMALL = Scenario(
    "reduced day",
    ((H100, 3), (T4, 2)),
    (
        online("llm", share(20480, 50), 10, 15.0, {"H100"}),
        online("embed", share(2048, 10), 12, 14.0),
        online("whole", ContainerRequest("main", 1), 2, 16.0, {"H100"}),
    ),
    (
        job("summarise", share(10240, 50), 2.0),
        job("render", ContainerRequest("main", 1), 1.0),
        job("embed", share(2048, 30), 2.0),
    ),
)
# One day (the cluster starts empty at midnight, the night's jobs arrive until 04:00), replicas
# re-evaluated every 5 minutes.
QUICK = Settings(days=1, hpa_interval_s=300, seed=3)


def run(sc: Scenario, s: Settings, mode: str) -> tuple[_Sim, dict]:
    sim = _Sim(sc, mode, s)
    return sim, asdict(sim.run(offline_arrivals(sc, s)))


def accounted(sim: _Sim) -> None:
    """Every job is exactly one of: done, running, waiting in the queue; an evicted one too."""
    for key, j in sim.jobs.items():
        states = [j.finished is not None, key in sim.state.pods, key in sim.queue]
        assert sum(states) == 1, (key, states, j)
        if j.finished is None and key not in sim.state.pods:
            assert j.started is None
    assert not any(j.terminating for j in sim.jobs.values() if j.key not in sim.state.pods)


@pytest.fixture(scope="module")
def small() -> dict[str, tuple[_Sim, dict]]:
    return {m: run(SMALL, QUICK, m) for m in MODES}


def test_both_modes_see_the_same_arrivals_and_keep_the_invariants(small):
    sims = {m: sim for m, (sim, _) in small.items()}
    assert set(sims["none"].jobs) == set(sims["preempt"].jobs) and sims["none"].jobs
    assert sims["none"].created == sims["preempt"].created
    for sim in sims.values():
        assert invariant_violations(sim.state) == []
        assert not sim.holds and all(g.healthy for n in sim.state.nodes.values() for g in n.gpus)
        accounted(sim)
    for _, r in small.values():
        assert r["handovers_failed"] == 0
        assert r["online_placed"] + r["online_withdrawn"] + r["online_pending_at_end"] == r["online_created"]


def test_without_preemption_nothing_is_evicted_or_lost(small):
    sim, r = small["none"]
    assert r["jobs_evicted"] == 0 and r["offline_gpu_hours_lost"] == 0 and r["preemptions"] == 0
    assert not sim.log and all(j.evictions == 0 for j in sim.jobs.values())
    assert r["online_waited"] > 0, "the reduced day must make online pods wait behind offline jobs"


def test_preemption_places_online_pods_sooner_and_costs_offline_work(small):
    (_, none), (sim, pre) = small["none"], small["preempt"]
    assert pre["wait_p99_s"] < none["wait_p99_s"] and pre["wait_max_s"] < none["wait_max_s"]
    assert pre["wait_max_s"] <= QUICK.grace_s  # a preemptor waits for its victims' grace period
    assert pre["jobs_evicted"] > 0 and pre["offline_gpu_hours_lost"] > 0
    assert pre["evictions_per_online_placed"] == pytest.approx(
        pre["jobs_evicted"] / pre["online_placed"], abs=1e-4
    )
    assert sum(j.evictions for j in sim.jobs.values()) == pre["jobs_evicted"]  # one day: all measured
    # the evicted jobs ran again: each is done, running or waiting for room
    evicted = [j for j in sim.jobs.values() if j.evictions]
    assert evicted and all(
        j.finished is not None or j.key in sim.state.pods or j.key in sim.queue for j in evicted
    )


def test_only_online_pods_preempt_and_only_strictly_lower_priority_pods(small):
    sim, _ = small["preempt"]
    assert sim.log
    for e in sim.log:
        assert e["class"] == "online" and e["priority"] == QUICK.online_priority
        assert e["victims"] and all(p < e["priority"] and cls == "offline" for _, p, cls in e["victims"])


def test_an_offline_pod_never_preempts():
    sim = _Sim(SMALL, "preempt", QUICK)
    sim._arrive(0, 3600.0, 0.0)
    (key,) = sim.queue
    pre = sim.preemptor(sim.requests[key])
    assert pre.priority == QUICK.offline_priority and not pre.may_preempt  # preemptionPolicy: Never
    assert sim._preempt(key, 0.0) is False and not sim.log


ONE_GPU = Scenario(
    "one GPU",
    ((NodeType("h", 1, "H100", 81920), 1),),
    (online("web", ContainerRequest("main", 1), 1, 15.0),),
    (job("embed", share(10240, 30), 1.0),),
)


def one_gpu_taken() -> tuple[_Sim, str, str]:
    """A one-GPU pool where an offline job holds a share, and a whole-GPU online pod preempted it."""
    sim = _Sim(ONE_GPU, "preempt", QUICK)
    sim._arrive(0, 4 * 3600.0, 0.0)
    (job_key,) = sim.queue
    sim._pass(0.0, False, True)
    assert job_key in sim.state.pods
    sim._scale(ONE_GPU.online[0], 1, 3600.0)
    (pod_key,) = sim.pending_online
    sim._pass(3600.0, True, False)
    assert pod_key in sim.holds and sim.jobs[job_key].terminating
    g = sim.state.nodes["h-0"].gpus[0]
    assert not g.healthy and job_key in g.holders  # held for the preemptor; the victim still stops
    return sim, pod_key, job_key


def test_the_preemptor_takes_the_room_after_the_grace_period():
    sim, pod_key, job_key = one_gpu_taken()
    sim._arrive(0, 3600.0, 3610.0)  # another job arriving meanwhile would fit beside the victim,
    # but the GPU is held for the preemptor
    sim._pass(3610.0, False, True)
    assert len(sim.queue) == 1
    sim._handover(pod_key, 3600.0 + QUICK.grace_s)
    assert pod_key in sim.state.pods and job_key not in sim.state.pods and job_key in sim.queue
    assert sim.waits == [QUICK.grace_s] and sim.preemptions == 1 and sim.evicted == 1
    assert sim.lost_gh == pytest.approx(0.3 * (1.0 + QUICK.grace_s / 3600))  # 30 % SM, 00:00-01:00:30
    j = sim.jobs[job_key]
    assert j.evictions == 1 and j.done_s == 0 and j.started is None and not j.terminating
    assert sim.state.nodes["h-0"].gpus[0].healthy and invariant_violations(sim.state) == []


def test_checkpointed_progress_survives_the_eviction():
    sim = _Sim(ONE_GPU, "preempt", replace(QUICK, checkpoint_min=25))
    sim._arrive(0, 4 * 3600.0, 0.0)
    sim._pass(0.0, False, True)
    sim._scale(ONE_GPU.online[0], 1, 3600.0)
    sim._pass(3600.0, True, False)
    (pod_key,) = sim.holds
    sim._handover(pod_key, 3630.0)
    (j,) = sim.jobs.values()
    assert j.done_s == 50 * 60  # two 25-minute checkpoints of 60.5 minutes
    assert sim.lost_gh == pytest.approx(0.3 * (3630.0 - 3000.0) / 3600)


def test_a_preemptor_scaled_away_still_costs_its_victims_and_frees_the_room():
    sim, pod_key, job_key = one_gpu_taken()
    sim._scale(ONE_GPU.online[0], 0, 3610.0)
    assert sim.withdrawn == 1 and sim._waiting() == 0
    sim._handover(pod_key, 3600.0 + QUICK.grace_s)
    assert not sim.holds and pod_key not in sim.state.pods and job_key in sim.queue
    sim._pass(3630.0, False, False)
    assert job_key in sim.state.pods  # the victim, queued again, has its GPU back
    assert sim.state.nodes["h-0"].gpus[0].healthy and invariant_violations(sim.state) == []
    accounted(sim)


def test_equal_priorities_mean_no_preemption():
    s = replace(QUICK, offline_priority=QUICK.online_priority)
    sim, r = run(SMALL, s, "preempt")
    assert r["jobs_evicted"] == 0 and not sim.log
    _, none = run(SMALL, s, "none")
    assert r["wait_p99_s"] == none["wait_p99_s"]  # the same day as without preemption


def test_checkpoints_bound_the_work_an_eviction_loses():
    s = replace(QUICK, checkpoint_min=20)
    _, r = run(SMALL, s, "preempt")
    most = max(job_weight(j.template) for j in SMALL.offline)
    assert r["jobs_evicted"] > 0
    assert r["offline_gpu_hours_lost"] <= r["jobs_evicted"] * most * 20 / 60 + 0.01
    _, none_ck = run(SMALL, s, "none")
    assert none_ck["offline_gpu_hours_lost"] == 0


def test_the_check_catches_a_broken_invariant(small):
    sim, _ = small["preempt"]
    sim2 = _Sim(SMALL, "none", QUICK)
    sim2.state = sim.state.clone()
    g = next(g for n in sim2.state.nodes.values() for g in n.gpus if g.holders and not g.exclusive)
    g.mem_used = g.mem_mib + 1  # an over-commit the simulation itself never writes
    with pytest.raises(InvariantBroken, match="over-committed"):
        sim2._check(0.0, full=True)


def test_offline_arrivals_are_seeded_and_arrive_at_night():
    a = offline_arrivals(SMALL, QUICK)
    assert a == offline_arrivals(SMALL, QUICK) and a != offline_arrivals(SMALL, replace(QUICK, seed=4))
    lo, hi = QUICK.run_h
    for t, shape, run_s in a:
        hour = (t % 86400) / 3600
        assert hour >= QUICK.night[0] or hour < QUICK.night[1]
        assert 0 <= shape < len(SMALL.offline) and lo * 3600 <= run_s <= hi * 3600
    assert offline_arrivals(SMALL, replace(QUICK, offline_load=0)) == []
    full = replace(SMALL, online=(online("big", ContainerRequest("main", 1), 80, 15.0),))
    assert offline_arrivals(full, QUICK) == []  # online's trough already asks for every GPU
    # twice the load, about twice the jobs
    assert 1.5 < len(offline_arrivals(SMALL, replace(QUICK, offline_load=3.0))) / len(a) < 2.7


def test_percentile_is_nearest_rank():
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 50) == 5.0
    v = [float(i) for i in range(1, 101)]
    assert (percentile(v, 50), percentile(v, 95), percentile(v, 99), percentile(v, 100)) == (50, 95, 99, 100)


@pytest.mark.parametrize(
    "bad",
    [dict(swing=1.0), dict(days=0), dict(run_h=(3.0, 1.0)), dict(night=(4.0, 4.0)), dict(grace_s=-1.0)],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        simulate(SMALL, replace(QUICK, **bad))


@st.composite
def days(draw):
    peaks = draw(st.lists(st.integers(1, 10), min_size=1, max_size=3))
    hours = draw(st.lists(st.floats(8.0, 20.0), min_size=len(peaks), max_size=len(peaks)))
    services = tuple(
        online(
            f"s{i}",
            draw(st.sampled_from([share(4096, 20), share(20480, 60), ContainerRequest("main", 1)])),
            p,
            h,
        )
        for i, (p, h) in enumerate(zip(peaks, hours, strict=True))
    )
    sc = replace(
        SMALL, pool=((H100, draw(st.integers(1, 3))), (T4, draw(st.integers(0, 2)))), online=services
    )
    s = replace(
        QUICK,
        hpa_interval_s=600,
        seed=draw(st.integers(0, 1000)),
        offline_load=draw(st.floats(0.5, 2.5)),
        checkpoint_min=draw(st.sampled_from([0.0, 15.0, 60.0])),
        grace_s=draw(st.sampled_from([0.0, 30.0, 120.0])),
        run_h=(1.0, draw(st.floats(1.0, 6.0))),
    )
    return sc, s


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(days())
def test_any_day_keeps_the_rules(day):
    """On generated days (the invariants are checked during the run: a break raises), both modes
    account for every job, only preemption loses work, and victims are strictly lower priority."""
    sc, s = day
    for mode in MODES:
        sim, r = run(sc, s, mode)
        accounted(sim)
        assert r["handovers_failed"] == 0 and invariant_violations(sim.state) == []
        assert r["online_placed"] + r["online_withdrawn"] + r["online_pending_at_end"] == r["online_created"]
        if mode == "none":
            assert r["jobs_evicted"] == 0 and r["offline_gpu_hours_lost"] == 0
        for e in sim.log:
            assert all(p < e["priority"] for _, p, _ in e["victims"])


@pytest.fixture(scope="module")
def default_day() -> dict:
    return simulate(embedded_scenario(), Settings())


@pytest.mark.slow
def test_the_default_day_preemption_lowers_online_p99(default_day):
    none, pre = default_day["results"]
    assert (none["mode"], pre["mode"]) == ("none", "preempt")
    assert pre["wait_p99_s"] < none["wait_p99_s"] and none["wait_p99_s"] > 600
    assert none["offline_gpu_hours_lost"] == 0 and none["jobs_evicted"] == 0
    assert pre["jobs_evicted"] > 0 and pre["offline_gpu_hours_lost"] > 0
    assert pre["handovers_failed"] == none["handovers_failed"] == 0
    assert default_day["nodes"] == 19 and default_day["gpus"] == 104


@pytest.mark.slow
def test_cli_preemption_json_and_chart(capsys, tmp_path):
    argv = [
        "--json",
        "--out",
        str(tmp_path),
        "--checkpoint-min",
        "30",
        "--pool-share",
        "0.25",
        "--offline-load",
        "0.5",
    ]
    rc = main(["--tidal", "--preemption", *argv])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (day,) = doc["days"]
    assert day["settings"]["checkpoint_min"] == 30 and [r["mode"] for r in day["results"]] == list(MODES)
    assert all("series" not in r and "preemption_log" not in r for r in day["results"])
    assert (tmp_path / "preemption.png").stat().st_size > 10_000


def test_cli_preemption_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--tidal", "--preemption", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--checkpoint-min", "--grace-s", "--offline-load", "--run-hours", "--pool-share", "--json"):
        assert opt in out
    with pytest.raises(SystemExit):
        main(["--tidal", "--help"])
    assert "--preemption" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--run-hours", "5-2"],
        ["--run-hours", "x"],
        ["--pool-share", "0"],
        ["--trace", "x.csv"],
        ["--checkpoint-min", "-5"],
        ["--bogus"],
    ],
)
def test_cli_preemption_bad_arguments_are_one_line(capsys, argv):
    try:
        rc = main(["--tidal", "--preemption", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpupack simulate --tidal --preemption:")
