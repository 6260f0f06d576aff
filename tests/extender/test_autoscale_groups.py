"""extender.controllers.autoscale_groups: node-group templates read as gpupack needs them, and the placeholder pod
that makes the autoscaler add exactly one node of a group."""

from __future__ import annotations

import pytest
import yaml

from extender.controllers.autoscale import backoff_delay, read_backoff
from extender.controllers.autoscale_groups import (
    ANN_KWOK_MAX,
    LABEL_PLACEHOLDER,
    placeholder_host,
    placeholder_pod,
    read_templates,
    with_node_allocatable,
)
from gpupack.contract import LABEL_GPU_COUNT, LABEL_GPU_MEM_MIB, LABEL_GPU_MODEL, ContractError
from gpupack.core.node_rules import NodeFacts

LABEL = "gpupack.io/node-group"


def template(group: str | None, labels: dict[str, str], ann: dict[str, str] | None = None,
             alloc: dict[str, str] | None = None, taints: list | None = None) -> dict:  # fmt: skip
    meta: dict = {"name": f"{group}-t", "labels": dict(labels), "annotations": ann or {}}
    if group:
        meta["labels"][LABEL] = group
    node = {"apiVersion": "v1", "kind": "Node", "metadata": meta, "status": {"allocatable": alloc or {}}}
    if taints is not None:
        node["spec"] = {"taints": taints}
    return node


def gpu_labels(model: str = "H100", count: str = "8", mem: str = "81559") -> dict[str, str]:
    return {LABEL_GPU_MODEL: model, LABEL_GPU_COUNT: count, LABEL_GPU_MEM_MIB: mem}


def doc(*items: dict) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": list(items)})


def test_gpu_groups_are_read_and_cpu_groups_skipped():
    text = doc(
        template("h100", gpu_labels(), {ANN_KWOK_MAX: "5"}),
        template("a100", gpu_labels("A100", "4", "40960"), alloc={"gpupack.io/gpu": "32"}),
        template("cpu", {}),
        template(None, gpu_labels()),  # no group label: not a group gpupack can grow
    )
    (h, h_slots, h_max), (a, a_slots, a_max) = read_templates(text, LABEL)
    assert (h.name, h.model, h.gpus, h.mem_mib, h_slots, h_max) == ("h100", "H100", 8, 81559, 128, 5)
    assert (a.name, a.model, a.gpus, a.mem_mib, a_slots, a_max) == ("a100", "A100", 4, 40960, 32, None)
    # no host resources stated: none are checked (the format before templates carried them)
    assert (h.facts.cpu_milli, h.facts.mem_bytes, h.facts.pods) == (None, None, None)
    assert h.facts.labels[LABEL] == "h100" and h.facts.taints == ()


def test_a_templates_labels_taints_and_host_resources_are_read():
    taints = [
        {"key": "gpu", "value": "h100", "effect": "NoSchedule"},
        {"key": "soft", "effect": "PreferNoSchedule"},
    ]
    alloc = {"cpu": "95500m", "memory": "512Gi", "pods": "110", "gpupack.io/gpu": "128"}
    ((g, _, _),) = read_templates(
        doc(template("h100", {**gpu_labels(), "zone": "a"}, alloc=alloc, taints=taints)), LABEL
    )
    assert g.facts == NodeFacts(
        {**gpu_labels(), "zone": "a", LABEL: "h100"}, tuple(taints), 95500, 512 << 30, 110
    )
    assert g.template("n").cpu_milli == 95500 and g.template("n").ram_mib == 512 << 10


def test_a_ready_node_of_the_group_says_its_allocatable_as_the_autoscaler_reads_it():
    ((g, _, _),) = read_templates(
        doc(template("h100", gpu_labels(), alloc={"cpu": "96", "pods": "110"})), LABEL
    )
    node = {"metadata": {"name": "h100-0"}, "status": {"allocatable": {"cpu": "94", "memory": "500Gi"}}}
    seen = with_node_allocatable(g, node).facts
    assert (seen.cpu_milli, seen.mem_bytes, seen.pods) == (94000, 500 << 30, 110)  # pods: the template's
    assert with_node_allocatable(g, None) is g


@pytest.mark.parametrize(
    "text, msg",
    [
        ("kind: Node\n", "kind: List"),
        (doc(template("h", gpu_labels(count="eight"))), "gpupack.io/gpu-count"),
        (doc(template("h", {LABEL_GPU_MODEL: "H100", LABEL_GPU_COUNT: "8"})), "gpupack.io/gpu-mem-mib"),
        (doc(template("h", gpu_labels(count="0"))), "must be positive"),
        (doc(template("h", gpu_labels(), alloc={"cpu": "lots"})), "node template 0 \\(h\\) allocatable cpu"),
        (doc(template("h", gpu_labels(), alloc={"memory": "0"})), "allocatable memory must be positive"),
        (doc(template("h", gpu_labels(), alloc={"pods": "1" * 100})), "allocatable pods"),
        (doc(template("h", gpu_labels(), taints=[{"effect": "NoSchedule"}])), "each taint needs a key"),
        (doc(template("h", gpu_labels(), taints=[{"key": "k", "effect": "Never"}])), "effect 'Never'"),
        (doc(template("h", gpu_labels(), taints="k=v")), "spec.taints must be a list"),
    ],
)
def test_a_template_gpupack_cannot_use_is_refused_with_its_name(text, msg):
    with pytest.raises(ContractError, match=msg):
        read_templates(text, LABEL)


def test_a_placeholder_asks_for_one_whole_node_of_its_group_and_no_scheduler_takes_it():
    p = placeholder_pod("h100", 128, LABEL, "gpupack-system", {"name": "owner", "uid": "u1"})
    spec = p["spec"]
    assert spec["nodeSelector"] == {LABEL: "h100"} and p["metadata"]["labels"] == {LABEL_PLACEHOLDER: "h100"}
    (c,) = spec["containers"]
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"gpupack.io/gpu": "128"}
    assert spec["schedulerName"] not in ("default-scheduler", "gpupack-scheduler")
    assert "priorityClassName" not in spec  # below -10 the autoscaler would ignore it
    assert p["metadata"]["ownerReferences"][0]["uid"] == "u1"


def test_a_placeholder_carries_the_host_requests_of_the_pods_planned_on_its_node():
    p = placeholder_pod("h100", 128, LABEL, "gpupack-system", {"name": "owner", "uid": "u1"}, (80500, 204800))
    (c,) = p["spec"]["containers"]
    assert c["resources"]["requests"] == {"gpupack.io/gpu": "128", "cpu": "80500m", "memory": "204800Mi"}
    assert c["resources"]["limits"] == {"gpupack.io/gpu": "128"}
    assert placeholder_host(p) == (80500, 204800)
    assert placeholder_host(placeholder_pod("h100", 128, LABEL, "ns", {"name": "o", "uid": "u"})) == (0, 0)


@pytest.mark.parametrize(
    "raw, want",
    [
        (None, {}),
        ("not json", {}),
        ("[1, 2]", {}),
        (
            '{"h100": {"failures": 2, "until": 10, "at": 5}}',
            {"h100": {"failures": 2.0, "until": 10.0, "at": 5.0, "cpu": 0.0, "mem": 0.0}},
        ),
        (
            '{"h100": {"failures": 1e9, "until": 1, "at": 1}}',
            {"h100": {"failures": 30.0, "until": 1.0, "at": 1.0, "cpu": 0.0, "mem": 0.0}},
        ),
        ('{"h100": {"failures": "x", "until": 1, "at": 1}, "a": {"until": 1}, "b": 7}', {}),
        ('{"h100": {"failures": 1, "until": Infinity, "at": 1}}', {}),
        (
            '{"h": {"failures": 1, "until": 2, "at": 1, "cpu": 8000, "mem": -5}}',
            {"h": {"failures": 1.0, "until": 2.0, "at": 1.0, "cpu": 8000.0, "mem": 0.0}},
        ),
        ('{"h": {"failures": 1, "until": 2, "at": 1, "cpu": "lots"}}', {}),
    ],
)
def test_a_backoff_record_that_cannot_be_read_is_no_backoff(raw, want):
    assert read_backoff(raw) == want


def test_the_backoff_doubles_and_is_capped():
    assert [backoff_delay(n, 60, 1800) for n in (0, 1, 2, 3, 6, 30, 10**6)] == [
        60,
        60,
        120,
        240,
        1800,
        1800,
        1800,
    ]
