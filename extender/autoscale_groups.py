"""Node groups read from the autoscaler's node templates, and the placeholder pods gpupack keeps
for them (the objects the autoscale controller reads and writes; the decisions are in
`gpupack.core.autoscale`).

A template is a Node object in a `kind: List` (the kwok provider's `kwok-provider-templates`
format; for a cloud, an operator writes one per node group). A template node has no device
plugin, so it says what gpupack needs in labels a cloud node group can carry too:
`gpupack.io/gpu-model`, `gpupack.io/gpu-count` (the device plugin publishes both on real nodes)
and `gpupack.io/gpu-mem-mib`; its group is the value of the group label (`--autoscale-group-label`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gpupack.contract import (
    DOMAIN,
    LABEL_GPU_COUNT,
    LABEL_GPU_MEM_MIB,
    LABEL_GPU_MODEL,
    RES_GPU,
    SLOTS_PER_GPU,
    ContractError,
    parse_int_quantity,
)
from gpupack.core.autoscale import NodeGroup

# kwok's template annotation for a group's size limit; a cloud template may carry it as well
ANN_KWOK_MAX = "cluster-autoscaler.kwok.nodegroup/max-count"
# Placeholder pods: labelled with their group; the scheduler name is one nobody serves, so no
# scheduler ever binds them and they hold nothing: they only make the autoscaler add a node.
LABEL_PLACEHOLDER = f"{DOMAIN}/placeholder"
PLACEHOLDER_SCHEDULER = "gpupack-placeholder"
PLACEHOLDER_IMAGE = "registry.k8s.io/pause:3.9"
OWNER_CONFIGMAP = "gpupack-autoscale"  # the placeholders' owner: deleting it removes them all
# The autoscaler's own per-node opt-out of scale-down, and gpupack's note of why it set it (so it
# only ever removes a mark it made).
ANN_SCALE_DOWN_DISABLED = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
ANN_PINNED = f"{DOMAIN}/scale-down-pinned"


def read_templates(text: str, group_label: str) -> list[tuple[NodeGroup, int, int | None]]:
    """The node groups in a templates List: (group, `gpupack.io/gpu` slots of one node, max size).
    Templates without the group label or the GPU labels are skipped (CPU node groups)."""
    doc = yaml.safe_load(text) or {}
    items = doc.get("items") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ContractError("node templates: expected a kind: List with items")
    out = []
    for i, node in enumerate(items):
        meta = (node or {}).get("metadata") or {}
        labels: Mapping[str, str] = meta.get("labels") or {}
        ann: Mapping[str, str] = meta.get("annotations") or {}
        group = labels.get(group_label)
        if not group or LABEL_GPU_MODEL not in labels:
            continue
        where = f"node template {i} ({group})"
        gpus = parse_int_quantity(labels.get(LABEL_GPU_COUNT, ""), f"{where} label {LABEL_GPU_COUNT}")
        mem = parse_int_quantity(labels.get(LABEL_GPU_MEM_MIB, ""), f"{where} label {LABEL_GPU_MEM_MIB}")
        alloc = ((node.get("status") or {}).get("allocatable")) or {}
        slots = parse_int_quantity(alloc.get(RES_GPU, gpus * SLOTS_PER_GPU), f"{where} allocatable {RES_GPU}")
        top = ann.get(ANN_KWOK_MAX)
        max_size = parse_int_quantity(top, f"{where} annotation {ANN_KWOK_MAX}") if top else None
        if gpus <= 0 or mem <= 0 or slots <= 0:
            raise ContractError(f"{where}: GPU count, memory and {RES_GPU} must be positive")
        out.append((NodeGroup(group, labels[LABEL_GPU_MODEL], gpus, mem), slots, max_size))
    return out


def placeholder_pod(
    group: str, slots: int, group_label: str, namespace: str, owner: Mapping[str, str]
) -> dict[str, Any]:
    """A pod that needs exactly one whole new node of `group` in the autoscaler's eyes: every
    `gpupack.io/gpu` slot of one node, only on that group's nodes. It tolerates every taint, so
    the group's own taints do not hide it from the group."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"gpupack-placeholder-{group}-"[:58],
            "namespace": namespace,
            "labels": {LABEL_PLACEHOLDER: group},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["name"], "uid": owner["uid"]}
            ],
        },
        "spec": {
            "schedulerName": PLACEHOLDER_SCHEDULER,
            "nodeSelector": {group_label: group},
            "tolerations": [{"operator": "Exists"}],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "placeholder",
                    "image": PLACEHOLDER_IMAGE,
                    "resources": {"requests": {RES_GPU: str(slots)}, "limits": {RES_GPU: str(slots)}},
                }
            ],
        },
    }


def unschedulable_condition(now: str) -> dict[str, Any]:
    """What kube-scheduler would write on a pod it found no node for: the autoscaler acts only on
    pods marked so, and no scheduler looks at a placeholder, so gpupack marks it."""
    return {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "gpupack placeholder: gpupack pods need a node of this group",
        "lastTransitionTime": now,
    }
