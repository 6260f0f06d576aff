"""Which pods a defrag run may evict: only pods a controller recreates, and only when safe.

- ReplicaSet (Deployments) and StatefulSet pods: yes. Job pods: only with `allow_jobs`.
- Bare pods, DaemonSet pods, static (mirror) pods and pods of any other controller: never
  (a DaemonSet pod comes back on the same node; other controllers' semantics are unknown).
- Online pods only with `allow_online`; pods already terminating or not Running never.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpupack.contract import CLASS_ONLINE
from gpupack.core.model import PodRequest

RECREATED = ("ReplicaSet", "StatefulSet")


@dataclass(frozen=True)
class Eligibility:
    allow_online: bool = False
    allow_jobs: bool = False
    namespaces: frozenset[str] | None = None  # None: every namespace


def controller_of(pod: dict[str, Any]) -> tuple[str, str] | None:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller"):
            return str(ref.get("kind", "")), str(ref.get("name", ""))
    return None


def why_not(pod: dict[str, Any], req: PodRequest, rules: Eligibility) -> str | None:
    """None when the pod may move, else a short reason (also a metrics label)."""
    meta = pod.get("metadata") or {}
    if rules.namespaces is not None and req.namespace not in rules.namespaces:
        return "namespace"
    if meta.get("deletionTimestamp"):
        return "terminating"
    if (pod.get("status") or {}).get("phase") != "Running":
        return "not-running"
    owner = controller_of(pod)
    if owner is None:
        return "bare-pod"
    kind = owner[0]
    if kind == "Job":
        if not rules.allow_jobs:
            return "job"
    elif kind not in RECREATED:
        return "daemonset" if kind == "DaemonSet" else "controller"
    if req.pod_class == CLASS_ONLINE and not rules.allow_online:
        return "online"
    if not req.containers:
        return "no-gpu-request"
    return None
