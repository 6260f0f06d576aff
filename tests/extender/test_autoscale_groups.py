"""extender.autoscale_groups: node-group templates read as gpupack needs them, and the placeholder pod
that makes the autoscaler add exactly one node of a group."""

from __future__ import annotations

import pytest
import yaml

from extender.autoscale_groups import ANN_KWOK_MAX, LABEL_PLACEHOLDER, placeholder_pod, read_templates
from gpupack.contract import LABEL_GPU_COUNT, LABEL_GPU_MEM_MIB, LABEL_GPU_MODEL, ContractError
from gpupack.core.autoscale import NodeGroup

LABEL = "gpupack.io/node-group"


def template(group: str | None, labels: dict[str, str], ann: dict[str, str] | None = None,
             alloc: dict[str, str] | None = None) -> dict:  # fmt: skip
    meta: dict = {"name": f"{group}-t", "labels": dict(labels), "annotations": ann or {}}
    if group:
        meta["labels"][LABEL] = group
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "status": {"allocatable": alloc or {}}}


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
    assert read_templates(text, LABEL) == [
        (NodeGroup("h100", "H100", 8, 81559), 128, 5),
        (NodeGroup("a100", "A100", 4, 40960), 32, None),
    ]


@pytest.mark.parametrize(
    "text, msg",
    [
        ("kind: Node\n", "kind: List"),
        (doc(template("h", gpu_labels(count="eight"))), "gpupack.io/gpu-count"),
        (doc(template("h", {LABEL_GPU_MODEL: "H100", LABEL_GPU_COUNT: "8"})), "gpupack.io/gpu-mem-mib"),
        (doc(template("h", gpu_labels(count="0"))), "must be positive"),
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
