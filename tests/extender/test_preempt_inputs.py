"""What the preemption controller reads from Kubernetes objects (extender/state/preempt_inputs.py): the
nodes a preemptor may run on, and which running pods may be its victims. Table tests."""

from __future__ import annotations

from typing import Any

import pytest
from ext_helpers import node_obj
from kubernetes import client

from extender.controllers.preemption import Preempter
from extender.state.preempt_inputs import MIRROR, Unschedulable, node_allows, victims_of
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.core.policies import get_policy
from gpupack.kubeclient import KubeClient

LABELS = {"kubernetes.io/hostname": "n1", "zone": "a", "gpus": "8"}


def spec(**kw: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"}, "spec": kw}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}
    }


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, "values": list(values)}


@pytest.mark.parametrize(
    ("pod", "taints", "allowed"),
    [
        (spec(), frozenset(), True),
        (spec(nodeSelector={"zone": "a"}), frozenset(), True),
        (spec(nodeSelector={"zone": "b"}), frozenset(), False),
        (spec(affinity=required({"matchExpressions": [expr("zone", "In", "a", "b")]})), frozenset(), True),
        (spec(affinity=required({"matchExpressions": [expr("zone", "NotIn", "a")]})), frozenset(), False),
        (spec(affinity=required({"matchExpressions": [expr("zone", "Exists")]})), frozenset(), True),
        (spec(affinity=required({"matchExpressions": [expr("rack", "DoesNotExist")]})), frozenset(), True),
        (spec(affinity=required({"matchExpressions": [expr("gpus", "Gt", "4")]})), frozenset(), True),
        (spec(affinity=required({"matchExpressions": [expr("gpus", "Lt", "4")]})), frozenset(), False),
        # terms are ORed, a term's expressions ANDed
        (
            spec(
                affinity=required(
                    {"matchExpressions": [expr("zone", "In", "b")]},
                    {"matchExpressions": [expr("zone", "In", "a"), expr("gpus", "In", "8")]},
                )
            ),
            frozenset(),
            True,
        ),
        (spec(affinity=required({"matchFields": [expr("metadata.name", "In", "n1")]})), frozenset(), True),
        (spec(affinity=required({"matchFields": [expr("metadata.name", "In", "n2")]})), frozenset(), False),
        (spec(affinity=required({})), frozenset(), False),  # an empty term matches nothing
        (spec(), frozenset({("gpu", "", "NoSchedule")}), False),
        (spec(), frozenset({("gpu", "", "PreferNoSchedule")}), True),
        (
            spec(tolerations=[{"key": "gpu", "operator": "Exists"}]),
            frozenset({("gpu", "", "NoSchedule")}),
            True,
        ),
        (
            spec(tolerations=[{"key": "team", "value": "a", "effect": "NoExecute"}]),
            frozenset({("team", "a", "NoExecute")}),
            True,
        ),
        (
            spec(tolerations=[{"key": "team", "value": "b"}]),
            frozenset({("team", "a", "NoSchedule")}),
            False,
        ),
        (
            spec(tolerations=[{"key": "team", "value": "a", "effect": "NoSchedule"}]),
            frozenset({("team", "a", "NoExecute")}),
            False,
        ),
        (spec(tolerations=[{"operator": "Exists"}]), frozenset({("x", "y", "NoExecute")}), True),
    ],
)
def test_node_allows(pod: dict[str, Any], taints: frozenset[tuple[str, str, str]], allowed: bool) -> None:
    assert node_allows(pod, "n1", LABELS, taints) is allowed


def running(name: str, node: str = "n1", prio: int = 0, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", **meta},
        "spec": {"nodeName": node, "priority": prio},
        "status": {"phase": "Running"},
    }


def test_victims_of_gpu_and_host_only_pods() -> None:
    pods = [
        running("gpu", prio=5),
        running("cpu", prio=1, labels={"gpupack.io/class": "offline", "app": "x"}),
        running("static", annotations={MIRROR: "abc"}),
        running("leaving", deletionTimestamp="2026-01-01T00:00:00Z"),
        {**running("done"), "status": {"phase": "Succeeded"}},
        running("taken"),
    ]
    pdbs = [
        {"metadata": {"name": "b", "namespace": "ns"}, "spec": {"selector": {"matchLabels": {"app": "x"}}}}
    ]
    classes = {"ns/gpu": "online"}
    only_gpu = victims_of(pods, classes, pdbs, {"ns/taken"})
    assert set(only_gpu) == {"ns/gpu"} and only_gpu["ns/gpu"].node == ""
    every = victims_of(pods, classes, pdbs, {"ns/taken"}, host_only=True)
    assert set(every) == {"ns/gpu", "ns/cpu"}
    cpu = every["ns/cpu"]
    assert (cpu.node, cpu.priority, cpu.pod_class, cpu.budgets) == ("n1", 1, "offline", ("ns/b",))


def waiting(name: str, marked: bool, **meta: Any) -> dict[str, Any]:
    cond = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}] if marked else []
    return {
        "metadata": {"name": name, "namespace": "ns", **meta},
        "spec": {},
        "status": {"phase": "Pending", "conditions": cond},
    }


def test_the_marks_follow_the_pending_watch() -> None:
    """Unschedulable: what the pending-pod watch shows marked; nothing is known before a list."""
    marks = Unschedulable()
    assert not marks.none()  # no list read yet: the pass must look for itself
    marks.apply(waiting("a", True))
    marks.replace([waiting("a", False), waiting("b", False)])
    assert marks.none()
    marks.apply(waiting("a", True))
    assert not marks.none()
    marks.apply(waiting("a", False))  # tried again and not marked now
    assert marks.none()
    marks.apply(waiting("b", True))
    marks.delete(waiting("b", True))  # bound or deleted: gone from the watch
    assert marks.none()
    marks.apply(waiting("c", True, deletionTimestamp="2026-12-05T12:00:00Z"))  # on its way out
    assert marks.none()
    marks.replace([waiting("d", True)])
    assert not marks.none()


class CountingKube:
    """Only what a preemption pass reads when nothing waits: how often it lists the waiting pods."""

    def __init__(self) -> None:
        self.lists = 0

    def unscheduled_pods(self, scheduler: str, cached: bool = False) -> list[dict[str, Any]]:
        self.lists += 1
        return []

    def list_pods(self) -> dict[str, Any]:
        return {"items": []}


def test_a_pass_lists_the_waiting_pods_only_when_one_may_preempt() -> None:
    """With the pending watch's marks, a pass reads nothing while no waiting pod is marked
    Unschedulable and the controller holds no room; without them (or before the watch listed),
    every pass lists."""
    view = ClusterView()
    view.replace_nodes([node_obj("n1")])
    view.replace_pods([])
    view.synced.set()
    kube = CountingKube()
    ext = Extender(view, get_policy("gpupack"), kube)  # type: ignore[arg-type]
    marks = Unschedulable()
    unused = KubeClient(client.ApiClient())  # the evictions' client: no pass here evicts
    pre = Preempter(ext, unused, None, None, marks=marks)
    pre.run_once()
    assert kube.lists == 1  # the watch has not listed yet
    marks.replace([])
    pre.run_once()
    assert (kube.lists, pre.skipped) == (1, 1)
    pre.marks = None  # no pending watch to tell
    pre.run_once()
    assert kube.lists == 2
    pre.marks = marks
    marks.apply(waiting("a", True))
    pre.run_once()
    assert kube.lists == 3
    marks.delete(waiting("a", True))
    pre.run_once()
    assert (kube.lists, pre.skipped) == (3, 2)
