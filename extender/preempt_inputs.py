"""What the preemption controller reads from Kubernetes objects, as the core's plain data: the
pending pods that may preempt, the running pods that may be victims, the budgets covering them,
and the record a preemptor carries of its preemption (the state a restarted leader rebuilds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpupack.contract import selector_matches
from gpupack.core.preemption import Victim

# Pod annotation the preemption controller writes on a preemptor: the node, the reservation that
# holds its room, and the victims (namespace/name:uid) it evicted for it. Read back by every pass,
# so a restarted leader knows which evictions are still under way and whose room is held.
ANN_PREEMPTION = "gpupack.io/preemption"
PREEMPT_PREFIX = "preempt-"  # reservation ids the controller owns (owner_kind Pod)


@dataclass(frozen=True)
class Record:
    node: str
    reservation: str
    victims: tuple[str, ...]  # namespace/name:uid
    at: str  # RFC 3339, when the evictions were made

    def encode(self) -> str:
        return json.dumps(
            {
                "node": self.node,
                "reservation": self.reservation,
                "victims": list(self.victims),
                "at": self.at,
            },
            separators=(",", ":"),
            sort_keys=True,
        )


def record_of(pod: dict[str, Any]) -> Record | None:
    """The pod's preemption record; None when it has none or it cannot be read (a new plan then)."""
    raw = pod_annotations(pod).get(ANN_PREEMPTION)
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return Record(
            str(d["node"]), str(d["reservation"]), tuple(str(v) for v in d["victims"]), str(d["at"])
        )
    except (ValueError, KeyError, TypeError):
        return None


def pod_annotations(pod: dict[str, Any]) -> dict[str, str]:
    return dict((pod.get("metadata") or {}).get("annotations") or {})


def key_of(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def uid_of(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def priority_of(pod: dict[str, Any]) -> int:
    return int((pod.get("spec") or {}).get("priority") or 0)


def may_preempt(pod: dict[str, Any]) -> bool:
    return (pod.get("spec") or {}).get("preemptionPolicy") != "Never"


def unschedulable(pod: dict[str, Any]) -> bool:
    """Unbound, not being deleted, and marked Unschedulable by kube-scheduler's last attempt."""
    meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or spec.get("nodeName") or st.get("phase") not in ("Pending", None):
        return False
    return any(
        isinstance(c, dict)
        and c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in st.get("conditions") or []
    )


def node_selected(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    """The pod's nodeSelector allows a node with these labels (its other constraints kube-scheduler
    checks: a preemption there still needs its yes, so the controller only holds the room)."""
    sel = (pod.get("spec") or {}).get("nodeSelector") or {}
    return all(labels.get(k) == v for k, v in sel.items())


def budget_allows(pdbs: list[dict[str, Any]]) -> dict[str, int]:
    """Per budget (namespace/name), the disruptions it allows now; a budget not yet computed for
    its current spec allows none."""
    out: dict[str, int] = {}
    for b in pdbs:
        meta, st = b.get("metadata") or {}, b.get("status") or {}
        name = f"{meta.get('namespace')}/{meta.get('name')}"
        current = int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        out[name] = int(st.get("disruptionsAllowed") or 0) if current else 0
    return out


def victims_of(
    pods: list[dict[str, Any]], classes: dict[str, str], pdbs: list[dict[str, Any]], taken: set[str]
) -> dict[str, Victim]:
    """The running pods that hold GPUs (`classes`: key -> class of the GPUs they hold, from the
    view) and may be chosen: not being deleted, not terminal, not picked for another preemptor
    (`taken`: keys)."""
    by_ns: dict[str, list[tuple[str, Any]]] = {}
    for b in pdbs:
        meta = b.get("metadata") or {}
        ns = str(meta.get("namespace"))
        by_ns.setdefault(ns, []).append((f"{ns}/{meta.get('name')}", (b.get("spec") or {}).get("selector")))
    out: dict[str, Victim] = {}
    for p in pods:
        key = key_of(p)
        meta = p.get("metadata") or {}
        if key not in classes or key in taken or meta.get("deletionTimestamp"):
            continue
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        labels = meta.get("labels") or {}
        budgets = tuple(
            name for name, sel in by_ns.get(str(meta.get("namespace")), []) if selector_matches(sel, labels)
        )
        out[key] = Victim(key, priority_of(p), classes[key], budgets)
    return out


def grace_s(pod: dict[str, Any]) -> int:
    v = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return 30 if v is None else int(v)
