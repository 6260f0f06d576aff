"""The preemption controller against hostile pods, without a cluster: the numbers a pod's spec
sets are clamped, one preemptor's failure stays its own, kube-scheduler's reasons that no
eviction fixes stop the controller from evicting, a hold that ran out backs its preemptor off,
and what the controller keeps per pod is bounded by the pods still waiting. (The same against
the real kube-scheduler: test_preemption_scheduler.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from ext_helpers import assigned, container, node_obj, pod_obj
from kubernetes import client

from extender.controllers.preempt_backoff import (
    ANN_BACKOFF,
    CAP_S,
    Backoff,
    backoff_of,
    delay_s,
    next_backoff,
)
from extender.controllers.preempt_feasibility import reasons, resources_short, scheduler_refuses
from extender.controllers.preemption import Preempter
from extender.state import preempt_inputs as pin
from extender.state.hostuse import HostUse
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.contract import GPUShare
from gpupack.core.policies import get_policy
from gpupack.kubeclient import KubeClient

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def condition(message: str) -> dict[str, Any]:
    return {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}


def waiting(
    name: str, prio: int = 1000, message: str = "0/2 nodes are available: 2 Insufficient gpu.", **spec: Any
) -> dict[str, Any]:
    p = pod_obj(name, [container("main", gpu=1)], namespace="ns", uid=f"uid-{name}")
    p["spec"].update(priority=prio, schedulerName="gpupack-scheduler", **spec)
    p["status"] = {"phase": "Pending", "conditions": [condition(message)]}
    return p


# --- numbers from the spec ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "meta", "want"),
    [
        ({}, {}, 30),
        ({"terminationGracePeriodSeconds": 5}, {}, 5),
        ({"terminationGracePeriodSeconds": 10**12}, {}, pin.MAX_GRACE_S),
        ({"terminationGracePeriodSeconds": 2**63 - 1}, {}, pin.MAX_GRACE_S),
        ({"terminationGracePeriodSeconds": -5}, {}, 0),
        ({"terminationGracePeriodSeconds": "soon"}, {}, pin.MAX_GRACE_S),
        ({"terminationGracePeriodSeconds": 10**12}, {"deletionGracePeriodSeconds": 3}, 3),
    ],
)
def test_grace_is_clamped(spec: dict[str, Any], meta: dict[str, Any], want: int) -> None:
    assert pin.grace_s({"metadata": meta, "spec": spec}) == want


@pytest.mark.parametrize(
    ("v", "want"), [(None, 0), (7, 7), (10**30, 2**31 - 1), (-(10**30), -(2**31)), ("x", 0)]
)
def test_priority_is_clamped(v: Any, want: int) -> None:
    assert pin.priority_of({"spec": {"priority": v}}) == want


# --- one pass with a hostile victim and a failing preemptor ------------------------------------


class StubKube:
    """What a pass reads and writes through the extender's Kube, in memory."""

    def __init__(self, unbound: list[dict[str, Any]], running: list[dict[str, Any]]) -> None:
        self.unbound, self.running = unbound, running
        self.patched: list[tuple[str, dict[str, str]]] = []

    def unscheduled_pods(self, scheduler: str, cached: bool = False) -> list[dict[str, Any]]:
        return self.unbound

    def list_pods(self) -> dict[str, Any]:
        return {"items": self.running}

    def namespace_labels(self, ns: str) -> dict[str, str]:
        return {}

    def patch_pod_metadata(
        self, ns: str, name: str, ann: dict[str, str], labels: dict[str, str], rv: Any
    ) -> None:
        self.patched.append((f"{ns}/{name}", ann))


class StubKC(KubeClient):
    def __init__(self) -> None:
        super().__init__(client.ApiClient())

    def list_all(self, list_fn: Any, *a: Any, **kw: Any) -> list[dict[str, Any]]:
        return []  # no PodDisruptionBudget


def victim(name: str, node: str, prio: int, grace: int | None = None) -> dict[str, Any]:
    p = pod_obj(name, [container("main", gpu=1)], cls="offline", namespace="ns")
    p["spec"]["priority"] = prio
    if grace is not None:
        p["spec"]["terminationGracePeriodSeconds"] = grace
    p["status"] = {"phase": "Running"}
    share = GPUShare(f"GPU-{node}-0", 0, 81559, 100, True)
    return assigned(p, node, {"main": (share,)})


def controller(
    unbound: list[dict[str, Any]], running: list[dict[str, Any]], nodes: int = 3
) -> tuple[Preempter, StubKube, list[Any]]:
    view = ClusterView()
    view.replace_nodes([node_obj(f"n{i}", n=1) for i in range(nodes)])
    view.replace_pods(running)
    view.synced.set()
    kube = StubKube(unbound, running)
    ext = Extender(view, get_policy("gpupack"), kube)  # type: ignore[arg-type]
    ext.clock = lambda: NOW  # type: ignore[method-assign]
    pre = Preempter(ext, StubKC(), None, None)
    planned: list[Any] = []

    def carry_out(plans: list[Any], by_key: Any, now: datetime) -> int:
        planned.extend(plans)
        return sum(len(p.choice.victims) for p in plans)

    pre.act.carry_out = carry_out  # type: ignore[method-assign]
    return pre, kube, planned


def test_a_victim_with_an_endless_grace_stops_no_preemption() -> None:
    """The lowest-priority victim asks for 10^12 s of grace: both preemptors are planned, its hold
    ends within a day (it raised OverflowError and aborted every pass)."""
    running = [victim("hostile", "n0", 1, grace=10**12), victim("v1", "n1", 10), victim("v2", "n2", 10)]
    pre, _, planned = controller([waiting("a"), waiting("b")], running)
    done = pre.run_once()
    assert done["evicted"] == 2 and done["error"] == 0, done
    assert sorted(p.pre.pod.key for p in planned) == ["ns/a", "ns/b"]
    hostile = next(p for p in planned if "ns/hostile" in p.choice.victims)
    expires = datetime.fromisoformat(hostile.hold.expires.replace("Z", "+00:00"))
    assert expires <= NOW + timedelta(seconds=pin.MAX_GRACE_S + pre.hold_s)


def test_one_preemptors_failure_is_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Planning for one preemptor raises: the other is planned in the same pass, the failure is
    counted each pass but logged once."""
    running = [victim("v0", "n0", 1), victim("v1", "n1", 10)]
    pre, _, planned = controller([waiting("bad", prio=2000), waiting("good")], running, nodes=2)
    real = pin.grace_s

    def grace(p: dict[str, Any]) -> int:
        if p["metadata"]["name"] == "v0":
            raise RuntimeError("a victim no one foresaw")
        return real(p)

    monkeypatch.setattr(pin, "grace_s", grace)
    for _ in range(3):
        planned.clear()
        done = pre.run_once()
        assert done["error"] == 1, done
        assert [p.pre.pod.key for p in planned] == ["ns/good"]
    logged = [r for r in caplog.records if "a victim no one foresaw" in r.getMessage()]
    assert len(logged) == 1
    assert pre.metrics.preemptions.labels("error")._value.get() == 3


# --- kube-scheduler's reasons -----------------------------------------------------------------


def test_reasons_are_parsed() -> None:
    msg = (
        "0/5 nodes are available: 2 node(s) didn't match pod affinity rules, 3 Insufficient gpupack.io/gpu. "
        "preemption: 0/5 nodes are available: 5 Preemption is not helpful for scheduling."
    )
    assert reasons(msg) == (
        [(2, "node(s) didn't match pod affinity rules"), (3, "Insufficient gpupack.io/gpu")],
        "",
    )
    assert reasons('0/3 nodes are available: persistentvolumeclaim "data" not found.') == (
        [],
        'persistentvolumeclaim "data" not found',
    )


CLAIM = {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]}


@pytest.mark.parametrize(
    ("message", "spec", "refused"),
    [
        ("0/3 nodes are available: 3 node(s) didn't match pod affinity rules.", {}, True),
        (
            "0/3 nodes are available: 1 node(s) had untolerated taint {a: b}, 2 node(s) didn't match Pod's node affinity/selector.",
            {},
            True,
        ),
        # a reason an eviction may fix: the controller's own checks decide
        (
            "0/3 nodes are available: 1 node(s) didn't match pod affinity rules, 2 Insufficient gpupack.io/gpu.",
            {},
            False,
        ),
        ("0/3 nodes are available: 3 node(s) didn't match pod anti-affinity rules.", {}, False),
        ("0/3 nodes are available: 3 node(s) didn't have free ports for the requested pod ports.", {}, False),
        ("0/3 nodes are available: 3 node(s) didn't match pod topology spread constraints.", {}, False),
        (
            "0/3 nodes are available: 3 node(s) didn't match pod topology spread constraints (missing required label).",
            {},
            True,
        ),
        # volumes: the controller reads none; kube-scheduler's words decide
        (
            "0/3 nodes are available: 1 node(s) had volume node affinity conflict, 2 Insufficient gpupack.io/gpu.",
            CLAIM,
            True,
        ),
        ('0/3 nodes are available: persistentvolumeclaim "data" not found.', CLAIM, True),
        ("0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.", CLAIM, True),
        ("0/3 nodes are available: 3 Insufficient gpupack.io/gpu.", CLAIM, False),
        (
            "0/3 nodes are available: 1 node(s) didn't have free ports for the requested pod ports, 2 Insufficient gpupack.io/gpu.",
            CLAIM,
            True,
        ),
        ("", CLAIM, True),
        ("0/3 nodes are available: 3 Insufficient gpupack.io/gpu.", {}, False),
    ],
)
def test_scheduler_reasons_no_eviction_fixes(message: str, spec: dict[str, Any], refused: bool) -> None:
    p = waiting("p", message=message, **spec)
    if not message:
        p["status"]["conditions"] = []
    assert (scheduler_refuses(p) is not None) is refused


def test_a_required_affinity_no_pod_meets_evicts_no_one() -> None:
    """kube-scheduler's message is not needed: the controller's own check refuses every node."""
    aff = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "nobody"}}}]}}  # fmt: skip
    running = [victim("v0", "n0", 1), victim("v1", "n1", 1)]
    lonely = waiting(
        "lonely", message="0/2 nodes are available: 2 Insufficient gpupack.io/gpu.", affinity=aff
    )
    pre, _, planned = controller([lonely], running, nodes=2)
    for _ in range(3):
        done = pre.run_once()
        assert done["infeasible"] == 1 and not planned, done
    assert pre.metrics.preemptions.labels("infeasible")._value.get() == 3


def test_resources_the_chooser_does_not_weigh() -> None:
    gi = 2**30
    alloc = HostUse(eph_bytes=100 * gi, other=(("example.com/nic", 2),))
    used = HostUse(eph_bytes=90 * gi, other=(("example.com/nic", 2),))
    victim_use = HostUse(eph_bytes=20 * gi, other=(("example.com/nic", 1),))
    assert resources_short(HostUse(eph_bytes=20 * gi), alloc, used, []) == "Insufficient ephemeral-storage"
    assert resources_short(HostUse(eph_bytes=20 * gi), alloc, used, [victim_use]) is None
    nic = HostUse(other=(("example.com/nic", 1),))
    assert resources_short(nic, alloc, used, []) == "Insufficient example.com/nic"
    assert resources_short(nic, alloc, used, [victim_use]) is None
    assert resources_short(HostUse(cpu_milli=10**9), alloc, used, []) is None  # the chooser's


# --- back-off -------------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_counts_each_hold_once() -> None:
    b = None
    delays = []
    for i in range(8):
        nb = next_backoff(b, f"hold-{i}", NOW)
        assert nb is not None and next_backoff(nb, f"hold-{i}", NOW) is None  # counted once
        b = nb
        delays.append(delay_s(b.failures))
    assert delays == [60, 120, 240, 480, 960, 1800, 1800, 1800]


@pytest.mark.parametrize(
    "raw",
    [
        '{"failures": 99999999999999999999, "since": "2026-12-07T12:00:00Z", "hold": "h"}',
        '{"failures": 1, "since": "9999-12-31T23:59:59Z", "hold": "h"}',
        '{"failures": 1, "since": "never", "hold": "h"}',
    ],
)
def test_a_forged_backoff_delays_the_pod_by_the_cap_at_most(raw: str) -> None:
    b = backoff_of({"metadata": {"annotations": {ANN_BACKOFF: raw}}})
    assert b is not None and b.until(NOW) <= NOW + timedelta(seconds=CAP_S)
    assert backoff_of({"metadata": {"annotations": {ANN_BACKOFF: "{not json"}}}) is None


def test_a_hold_that_ran_out_backs_its_preemptor_off_and_it_evicts_no_one_meanwhile() -> None:
    """The preemptor carries a record whose hold is gone, hold_s after the evictions, and is still
    unbound: it is backed off (annotation, metric) and, while backed off, planned no more."""
    running = [victim("replacement", "n0", 1)]
    p = waiting("stuck")
    at = NOW - timedelta(seconds=300)
    rec = pin.Record("n0", "preempt-gone", ("ns/old:uid-old",), at.isoformat().replace("+00:00", "Z"))
    p["metadata"]["annotations"] = {pin.ANN_PREEMPTION: rec.encode()}
    pre, kube, planned = controller([p], running, nodes=1)
    done = pre.run_once()
    assert done["backoff"] == 1 and not planned, done
    assert [k for k, ann in kube.patched if ANN_BACKOFF in ann] == ["ns/stuck"]
    assert pre.metrics.preemptions.labels("backoff")._value.get() == 1
    for _ in range(3):  # the in-memory back-off holds while the list shows no annotation yet
        assert pre.run_once()["backoff"] == 0 and not planned
    # a restarted controller reads it from the pod
    p["metadata"]["annotations"][ANN_BACKOFF] = kube.patched[-1][1][ANN_BACKOFF]
    again, _, planned2 = controller([p], running, nodes=1)
    again.run_once()
    assert not planned2
    # once it is over, the pod may preempt again
    later, _, planned3 = controller([p], running, nodes=1)
    later.ext.clock = lambda: NOW + timedelta(seconds=61)  # type: ignore[method-assign]
    later.run_once()
    assert [x.pre.pod.key for x in planned3] == ["ns/stuck"]


# --- memory bounded by the pods still waiting ---------------------------------------------------


def test_what_is_kept_per_preemption_goes_with_the_pods() -> None:
    """1,000 preemptions through the actions' state (each asked to retry once its victims are
    gone, a report, a back-off), then the pods are gone: every tracked set is back to empty."""
    pods = [waiting(f"p{i}") for i in range(1000)]
    pre, kube, _ = controller(pods, [], nodes=1)
    sizes = lambda: (len(pre.act.touched), len(pre.act.reports), len(pre.backoffs))  # noqa: E731
    start = sizes()
    for i, p in enumerate(pods):
        rec = pin.Record("n0", f"preempt-{i}", (f"ns/v{i}:uid-v{i}",), f"2026-12-07T11:{i % 60:02d}:00Z")
        assert pre.act.wait_victims(p, rec, {}) == 0  # victims gone: asked to retry
        pre.act.report(p, "r", "Event", "m")
        pre.backoffs.note(pin.uid_of(p), Backoff(1, "2026-12-07T12:00:00Z", f"preempt-{i}"))
    assert sizes() == (1000, 1000, 1000) and len(kube.patched) == 1000
    pre.run_once()  # all still waiting: all kept
    assert sizes() == (1000, 1000, 1000)
    kube.unbound = pods[:10]  # 990 bound or deleted
    pre.run_once()
    assert sizes() == (10, 10, 10)
    kube.unbound = []
    pre.run_once()
    assert sizes() == start == (0, 0, 0)
