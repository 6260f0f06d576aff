"""Which cluster changes make the view report room (ClusterView.on_room), and the Requeuer's
bounds: one list and at most `max_pods` PATCHes a pass, a burst coalesced into one pass, only pods
the scheduler parked as Unschedulable. The real scheduler's side is in test_extender_requeue.py."""

from __future__ import annotations

import copy
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from ext_helpers import container, node_obj, pod_obj
from kubernetes.client.rest import ApiException

from extender.controllers.requeue import Janitor, Requeuer
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from extender.verbs.upkeep import ANN_REQUEUED
from gpupack import handoff
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, HANDOFF_DONE, Assignment, GPUShare
from gpupack.core.policies import DEFAULT_POLICY, get_policy


def watched(view: ClusterView) -> list[str]:
    seen: list[str] = []
    view.on_room = lambda node, why: seen.append(f"{node}:{why}")
    return seen


def test_node_changes_that_can_let_pods_fit_are_reported_and_heartbeats_are_not():
    view = ClusterView()
    seen = watched(view)
    n = node_obj("n1", 2)
    n["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t0"}]
    view.apply_node(n)
    assert seen == ["n1:node-added"]

    def change(mutate: Any) -> list[str]:
        seen.clear()
        mutate(n)
        view.apply_node(copy.deepcopy(n))
        return list(seen)

    assert change(lambda o: o["status"]["conditions"][0].update(lastHeartbeatTime="t1")) == []
    assert change(lambda o: o["spec"].update(unschedulable=True)) == []
    assert change(lambda o: o["spec"].update(unschedulable=False)) == ["n1:node-uncordoned"]
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    assert change(lambda o: o["spec"].update(taints=[taint])) == []
    assert change(lambda o: o["spec"].update(taints=[{**taint, "effect": "PreferNoSchedule"}])) == [
        "n1:taint-removed"
    ]
    assert change(lambda o: o["spec"].update(taints=[])) == []  # PreferNoSchedule never kept a pod off
    assert change(lambda o: o["status"]["conditions"][0].update(status="False")) == []
    assert change(lambda o: o["status"]["conditions"][0].update(status="True")) == ["n1:node-ready"]
    assert change(lambda o: o["status"]["allocatable"].update({"gpupack.io/gpu": "8"})) == []
    assert change(lambda o: o["status"]["allocatable"].update({"gpupack.io/gpu": "16"})) == ["n1:slots-grew"]
    bigger = node_obj("n1", 4)["metadata"]["annotations"]
    assert change(lambda o: o["metadata"]["annotations"].update(bigger)) == ["n1:inventory-grew"]
    smaller = node_obj("n1", 1)["metadata"]["annotations"]
    assert change(lambda o: o["metadata"]["annotations"].update(smaller)) == []
    assert change(lambda o: o["metadata"]["labels"].update(zone="a")) == ["n1:labels-changed"]


def _charged_pod(name: str, node: str) -> dict[str, Any]:
    pod = pod_obj(name, [container("c", 1, 1000, 10)], uid=f"uid-{name}")
    a = Assignment(f"uid-{name}", node, "online", {"c": (GPUShare(f"GPU-{node}-0", 0, 1000, 10),)},
                   handoff.rfc3339(datetime.now(UTC)))  # fmt: skip
    pod["metadata"]["annotations"] = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
    pod["spec"]["nodeName"] = node
    pod["status"]["phase"] = "Running"
    return pod


def test_a_pod_leaving_reports_room_but_a_pod_charged_again_does_not():
    view = ClusterView()
    view.apply_node(node_obj("n1", 2))
    seen = watched(view)
    pod = _charged_pod("p", "n1")
    view.apply_pod(pod)
    view.apply_pod(copy.deepcopy(pod))  # an update of a running pod
    assert seen == []
    view.apply_pod({**pod, "status": {"phase": "Succeeded"}})
    assert seen == ["n1:pod-left"]
    seen.clear()
    view.apply_pod(pod)
    view.delete_pod(pod)
    assert seen == ["n1:pod-left"]


class FakeKube:
    """The two calls requeue_waiting makes, counted; `pods` is what the list returns."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.lists = 0
        self.cached = False
        self.patched: list[str] = []
        self.lock = threading.Lock()

    def unscheduled_pods(self, scheduler_name: str, cached: bool = False) -> list[dict[str, Any]]:
        self.cached = cached
        with self.lock:
            self.lists += 1
            return copy.deepcopy(self.pods)

    def patch_pod_metadata(self, ns: str, name: str, ann: dict, labels: dict, rv: str | None) -> dict:
        with self.lock:
            self.patched.append(name)
            for p in self.pods:
                if p["metadata"]["name"] == name:
                    p["metadata"].setdefault("annotations", {}).update(ann)
        return {}


def waiting(name: str, reason: str = "Unschedulable", **meta: Any) -> dict[str, Any]:
    pod = pod_obj(name, [container("c", 1, 1000, 10)], namespace="ns")
    pod["metadata"].update(meta)
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": reason}]
    return pod


@pytest.fixture
def requeuer():
    made: list[Requeuer] = []

    def make(pods: list[dict[str, Any]], **kw: Any) -> tuple[Requeuer, FakeKube]:
        view = ClusterView()
        kube = FakeKube(pods)
        ext = Extender(view, get_policy(DEFAULT_POLICY), kube)  # type: ignore[arg-type]
        r = Requeuer(ext, **kw).start()
        made.append(r)
        return r, kube

    yield make
    # each thread ends with its test: one still in a pass would log into a later test, or after the
    # run into a closed stream ("--- Logging error ---")
    assert all([r.close() for r in made]), "a requeuer thread did not stop"


def test_requeuer_touches_only_parked_pods_and_coalesces_a_burst(requeuer):
    pods = [waiting("parked"), waiting("gated", reason="SchedulingGated"), waiting("new"),
            waiting("going", deletionTimestamp="2026-01-01T00:00:00Z")]  # fmt: skip
    pods[2]["status"] = {"phase": "Pending"}  # not tried yet
    r, kube = requeuer(pods, min_interval_s=0.5, settle_s=0.1)
    for i in range(50):
        r.poke(f"n{i}", "node-added")  # before the first sync: the Janitor's restart pass covers them
    time.sleep(0.3)
    assert kube.lists == 0
    r.ext.view.synced.set()
    time.sleep(0.7)
    for i in range(50):
        r.poke(f"n{i}", "slots-grew")
    deadline = time.monotonic() + 30  # a wait for a condition: generous under load
    while not kube.patched and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.8)
    # one pass (two if a slow machine spread the pokes across the first one's start)
    assert 1 <= kube.lists <= 2 and set(kube.patched) == {"parked"}, (kube.lists, kube.patched)
    assert kube.cached, "a list repeated every few seconds must come from the API server's cache"
    assert (kube.pods[0]["metadata"]["annotations"] or {}).get(ANN_REQUEUED)


def test_requeuer_passes_are_rate_limited_and_capped(requeuer):
    pods = [waiting(f"p{i}") for i in range(25)]
    r, kube = requeuer(pods, min_interval_s=0.4, settle_s=0.05, max_pods=10)
    r.ext.view.synced.set()
    time.sleep(0.6)
    t0 = time.monotonic()
    r.poke("n1", "node-added")
    # 25 pods, 10 a pass: three passes cover each pod once, the longest untouched first
    deadline = time.monotonic() + 30  # a wait for a condition: generous under load
    while len(kube.patched) < 25 and time.monotonic() < deadline:
        time.sleep(0.02)
    took = time.monotonic() - t0
    time.sleep(1.0)
    assert sorted(kube.patched) == sorted(f"p{i}" for i in range(25)), kube.patched
    assert kube.lists == 3 and took >= 0.8, (kube.lists, took)
    # a steady stream of pokes still makes at most one pass per interval
    lists, stop = kube.lists, time.monotonic() + 1.2
    while time.monotonic() < stop:
        r.poke("n1", "pod-left")
        time.sleep(0.01)
    time.sleep(0.2)
    assert 1 <= kube.lists - lists <= 4, kube.lists - lists


def test_the_restart_pass_touches_each_pod_whose_attempt_failed_and_no_fresh_one():
    pods = [waiting("parked"), waiting("errored", reason="SchedulerError"), waiting("fresh"),
            waiting("going", deletionTimestamp="2026-01-01T00:00:00Z")]  # fmt: skip
    pods[2]["status"] = {"phase": "Pending"}  # created after the sync: not tried yet, nothing to retry
    kube = FakeKube(pods)
    ext = Extender(ClusterView(), get_policy(DEFAULT_POLICY), kube)  # type: ignore[arg-type]
    assert ext.requeue_waiting() == (2, 0)
    assert sorted(kube.patched) == ["errored", "parked"] and not kube.cached


class ConflictingKube(FakeKube):
    """The first touch of each pod answers 409 (kube-scheduler updated its status meanwhile);
    `bound` pods read back bound."""

    def __init__(self, pods: list[dict[str, Any]], bound: frozenset[str] = frozenset()) -> None:
        super().__init__(pods)
        self.bound = bound
        self.conflicted: set[str] = set()
        self.reads: list[str] = []

    def patch_pod_metadata(self, ns: str, name: str, ann: dict, labels: dict, rv: str | None) -> dict:
        if name not in self.conflicted:
            self.conflicted.add(name)
            raise ApiException(status=409, reason="Conflict")
        return super().patch_pod_metadata(ns, name, ann, labels, rv)

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        self.reads.append(name)
        pod = copy.deepcopy(next(p for p in self.pods if p["metadata"]["name"] == name))
        if name in self.bound:
            pod["spec"]["nodeName"] = "n1"
        return pod


def test_a_requeue_touch_that_conflicts_is_read_again_and_retried():
    kube = ConflictingKube(
        [waiting("parked"), waiting("bound-meanwhile")], bound=frozenset({"bound-meanwhile"})
    )
    ext = Extender(ClusterView(), get_policy(DEFAULT_POLICY), kube)  # type: ignore[arg-type]
    touched, left = ext.requeue_waiting()
    assert (touched, left) == (1, 0)
    assert kube.patched == ["parked"] and sorted(kube.reads) == ["bound-meanwhile", "parked"]


def test_the_restart_requeue_waits_for_the_verbs_listener():
    """Touched while kube-scheduler's filter is still refused, a pod is parked again by its next
    failed attempt: the restart pass runs only once the listener is bound."""
    kube = FakeKube([waiting("parked")])
    view = ClusterView()
    ext = Extender(view, get_policy(DEFAULT_POLICY), kube)  # type: ignore[arg-type]
    listening = threading.Event()
    janitor = Janitor(ext, interval_s=60, listening=listening).start()
    try:
        view.synced.set()
        time.sleep(1.2)  # two of its waits: it must still be waiting
        assert kube.lists == 0 and kube.patched == []
        listening.set()
        deadline = time.monotonic() + 30
        while not kube.patched and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kube.patched == ["parked"]
    finally:
        assert janitor.close()
