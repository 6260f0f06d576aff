"""What the preemption controller reads from Kubernetes objects (extender/preempt_inputs.py): the
nodes a preemptor may run on, and which running pods may be its victims. Table tests."""

from __future__ import annotations

from typing import Any

import pytest

from extender.preempt_inputs import MIRROR, node_allows, victims_of

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
