"""Node groups read from the autoscaler's node templates, and the placeholder pods gpupack keeps
for them (the objects the autoscale controller reads and writes; the decisions are in
`gpupack.core.autoscale`).

A template is a Node object in a `kind: List` (the kwok provider's `kwok-provider-templates`
format; for a cloud, an operator writes one per node group). A template node has no device
plugin, so it says what gpupack needs in labels a cloud node group can carry too:
`gpupack.io/gpu-model`, `gpupack.io/gpu-count` (the device plugin publishes both on real nodes)
and `gpupack.io/gpu-mem-mib`; its group is the value of the group label (`--autoscale-group-label`).

A pod's rules are judged against the template's labels and `spec.taints`, and its host requests
against the template's `status.allocatable` `cpu`, `memory` and `pods` (the kwok provider's
templates state them; for a cloud group the operator does). As the autoscaler itself does, the
allocatable of a Ready node of the group, when one exists, is preferred to the template's
(`with_node_allocatable`). Neither known: that resource is not checked for the group.
"""

from __future__ import annotations

import dataclasses
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
    parse_quantity,
)
from gpupack.core.autoscale import NodeGroup
from gpupack.core.node_rules import BLOCKING_EFFECTS, NodeFacts, node_facts

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
        facts = _template_facts(node, where)
        out.append((NodeGroup(group, labels[LABEL_GPU_MODEL], gpus, mem, facts=facts), slots, max_size))
    return out


def _template_facts(node: Mapping[str, Any], where: str) -> NodeFacts:
    """The template's labels, taints and stated host resources, each checked: a value the
    operator wrote that gpupack cannot read is an error naming it, never a guess."""
    alloc = ((node.get("status") or {}).get("allocatable")) or {}
    if not isinstance(alloc, Mapping):
        raise ContractError(f"{where}: status.allocatable must be a map")
    for key in ("cpu", "memory", "pods"):
        if key in alloc:
            q = parse_quantity(alloc[key], f"{where} allocatable {key}")
            if q <= 0:
                raise ContractError(f"{where}: allocatable {key} must be positive, got {alloc[key]!r}")
    taints = (node.get("spec") or {}).get("taints") or []
    if not isinstance(taints, list):
        raise ContractError(f"{where}: spec.taints must be a list")
    for t in taints:
        if not isinstance(t, Mapping) or not t.get("key") or not isinstance(t.get("key"), str):
            raise ContractError(f"{where}: each taint needs a key")
        if t.get("effect") not in (*BLOCKING_EFFECTS, "PreferNoSchedule"):
            raise ContractError(f"{where}: taint {t.get('key')!r} has effect {t.get('effect')!r}, "
                                "expected NoSchedule, PreferNoSchedule or NoExecute")  # fmt: skip
    return node_facts(node, with_name=False)


def with_node_allocatable(group: NodeGroup, node: Mapping[str, Any] | None) -> NodeGroup:
    """The group with the allocatable host resources of one of its Ready nodes where it states
    them (the autoscaler builds a group's template from such a node when one exists)."""
    if node is None:
        return group
    seen = node_facts(node, with_name=False)
    f = group.facts
    facts = dataclasses.replace(
        f,
        cpu_milli=seen.cpu_milli if seen.cpu_milli is not None else f.cpu_milli,
        mem_bytes=seen.mem_bytes if seen.mem_bytes is not None else f.mem_bytes,
        pods=seen.pods if seen.pods is not None else f.pods,
    )
    return dataclasses.replace(group, facts=facts)


def placeholder_pod(
    group: str,
    slots: int,
    group_label: str,
    namespace: str,
    owner: Mapping[str, str],
    host: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """A pod that needs exactly one whole new node of `group` in the autoscaler's eyes: every
    `gpupack.io/gpu` slot of one node, only on that group's nodes. It tolerates every taint, so
    the group's own taints do not hide it from the group. `host`: the CPU (milli) and memory
    (MiB) the pods planned on that node ask together; the placeholder asks for them too, so the
    autoscaler adds no node its own view of the group says cannot hold them."""
    requests: dict[str, str] = {RES_GPU: str(slots)}
    if host[0] > 0:
        requests["cpu"] = f"{host[0]}m"
    if host[1] > 0:
        requests["memory"] = f"{host[1]}Mi"
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
                    "resources": {"requests": requests, "limits": {RES_GPU: str(slots)}},
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


def placeholder_host(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The (CPU milli, memory MiB) a placeholder asks for; (0, 0) if it states none (or one made
    before placeholders carried them)."""
    out = []
    for c in ((pod.get("spec") or {}).get("containers") or [])[:1]:
        req = (c.get("resources") or {}).get("requests") or {}
        for key, scale in (("cpu", 1000), ("memory", 1)):
            try:
                q = parse_quantity(req.get(key, 0), key) * scale
            except ContractError:
                q = parse_quantity(0)
            out.append(int(q) if key == "cpu" else -(-int(q) // (1 << 20)))
    return (out[0], out[1]) if out else (0, 0)
