"""One consistent picture of the cluster for a defrag run, from lists of Node and Pod objects.

Reuses the extender's pure :class:`extender.state.view.ClusterView` (no watch is started), so defrag
charges GPUs exactly as the extender does. The view keeps only what binding needs per pod; the
planner also needs containers, model constraints and owners, so each pod's full request is
parsed again here. Active reservations (other runs', or this run's) are held as used capacity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpupack.contract import ContractError
from gpupack.core.model import ClusterState, PodRequest
from gpupack.core.request import parse_pod

from ...state.reservations import hold
from ...state.view import ClusterView


@dataclass
class Snapshot:
    state: ClusterState
    pods: dict[str, dict[str, Any]]  # key -> the pod object (camelCase dict)
    nodes: dict[str, dict[str, Any]]
    gpu_indexes: dict[str, list[int]]  # node -> NVML index per GPU position
    problems: list[str] = field(default_factory=list)


def build_snapshot(
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    now: datetime,
    namespace_labels: dict[str, dict[str, str]] | None = None,
) -> Snapshot:
    problems: list[str] = []
    view = ClusterView(on_problem=lambda kind, msg: problems.append(msg))
    view.replace_nodes(nodes)
    view.replace_pods(pods)
    state = ClusterState()
    for name, node in view.state.nodes.items():
        held = view.active_reservations(name, now)
        state.add_node(hold(node, held) if held else node.copy())
    by_key = {}
    for p in pods:
        meta = p.get("metadata") or {}
        by_key[f"{meta.get('namespace') or 'default'}/{meta.get('name')}"] = p
    for key, (req, placement, charged) in view.state.pods.items():
        full: PodRequest = req
        obj = by_key.get(key)
        if obj is not None:
            ns = (obj.get("metadata") or {}).get("namespace") or "default"
            try:
                parsed = parse_pod(obj, (namespace_labels or {}).get(ns))
                # The assignment's class is what the GPU holds; it wins over today's labels.
                full = dataclasses.replace(parsed, pod_class=req.pod_class, uid=req.uid or parsed.uid)
            except ContractError as e:
                problems.append(f"pod {key}: {e} (it stays where it is)")
        state.pods[key] = (full, placement, charged)
    return Snapshot(
        state=state,
        pods=by_key,
        nodes={str((n.get("metadata") or {}).get("name")): n for n in nodes},
        gpu_indexes={n: list(info.gpu_indexes) for n, info in view.nodes.items()},
        problems=problems,
    )
