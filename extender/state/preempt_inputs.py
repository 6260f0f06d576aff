"""What the preemption controller reads from Kubernetes objects, as the core's plain data: the
pending pods that may preempt, the running pods that may be victims, the budgets covering them,
and the record a preemptor carries of its preemption (the state a restarted leader rebuilds)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpupack.contract import CLASS_OFFLINE, CLASS_ONLINE, LABEL_CLASS, selector_matches
from gpupack.core import pod_filters as pf
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


# The longest termination grace a hold waits out: the API accepts any int64 >= 0 for
# terminationGracePeriodSeconds, and a hold must still end (and its expiry be a date).
MAX_GRACE_S = 86_400
INT32 = 2**31  # PriorityClass values are int32


def priority_of(pod: dict[str, Any]) -> int:
    """The pod's priority, within an int32 as the API keeps it (a value that is not a number
    counts as 0)."""
    try:
        v = int((pod.get("spec") or {}).get("priority") or 0)
    except (TypeError, ValueError):
        return 0
    return max(-INT32, min(v, INT32 - 1))


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


class Unschedulable:
    """Which waiting pods kube-scheduler marked Unschedulable, as the pending-pod watch shows them
    (its events, its lists): the preemption pass reads every waiting pod only when one may want to
    preempt. In a burst of a few thousand queued pods nothing is marked yet, and a list of them all
    every pass (2 s) was CPU spent in the extender and the API server on the burst's own cores.
    Thread-safe: the watch writes, the preemption pass reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[str] = set()
        self.listed = threading.Event()  # set once a list has been read: until then nothing is known

    def apply(self, pod: dict[str, Any]) -> None:
        """An ADDED or MODIFIED event of a waiting pod (or one bound since: no longer waiting)."""
        key, marked = key_of(pod), unschedulable(pod)
        with self._lock:
            if marked:
                self._keys.add(key)
            else:
                self._keys.discard(key)

    def delete(self, pod: dict[str, Any]) -> None:
        """A DELETED event: the pod was deleted, or bound (it left the watch's selection)."""
        with self._lock:
            self._keys.discard(key_of(pod))

    def replace(self, pods: Iterable[dict[str, Any]]) -> None:
        """A fresh list of the waiting pods."""
        keys = {key_of(p) for p in pods if unschedulable(p)}
        with self._lock:
            self._keys = keys
        self.listed.set()

    def none(self) -> bool:
        """True only when a list has been read and no waiting pod is marked now."""
        with self._lock:
            return self.listed.is_set() and not self._keys


def node_allows(
    pod: dict[str, Any], name: str, labels: dict[str, str], taints: frozenset[tuple[str, str, str]]
) -> bool:
    """Whether the pod may run on the node at all, as kube-scheduler's NodeSelector/NodeAffinity
    (required terms) and TaintToleration filters decide: no eviction is made on a node that
    would refuse the preemptor anyway. The filters that read other pods are in
    preempt_feasibility.py (gpupack.core.pod_filters)."""
    return pf.node_allows(pod, pf.NodeFacts(name, labels, taints)) is None


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
    pods: list[dict[str, Any]],
    classes: dict[str, str],
    pdbs: list[dict[str, Any]],
    taken: set[str],
    host_only: bool = False,
) -> dict[str, Victim]:
    """The running pods that may be chosen: those holding GPUs (`classes`: key -> class of the
    GPUs they hold, from the view), and with `host_only` every other pod on a node too (its
    class from its label, the node it runs on: it frees host CPU, memory and a pod slot); not
    being deleted, not terminal, not static (a mirror pod cannot be evicted), not picked for
    another preemptor (`taken`: keys)."""
    by_ns: dict[str, list[tuple[str, Any]]] = {}
    for b in pdbs:
        meta = b.get("metadata") or {}
        ns = str(meta.get("namespace"))
        by_ns.setdefault(ns, []).append((f"{ns}/{meta.get('name')}", (b.get("spec") or {}).get("selector")))
    out: dict[str, Victim] = {}
    for p in pods:
        key = key_of(p)
        meta = p.get("metadata") or {}
        node = str((p.get("spec") or {}).get("nodeName") or "")
        gpu = key in classes
        if (not gpu and not (host_only and node)) or key in taken or meta.get("deletionTimestamp"):
            continue
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if not gpu and MIRROR in (meta.get("annotations") or {}):
            continue
        labels = meta.get("labels") or {}
        budgets = tuple(
            name for name, sel in by_ns.get(str(meta.get("namespace")), []) if selector_matches(sel, labels)
        )
        if gpu:
            out[key] = Victim(key, priority_of(p), classes[key], budgets)
        else:
            cls = CLASS_OFFLINE if labels.get(LABEL_CLASS) == CLASS_OFFLINE else CLASS_ONLINE
            out[key] = Victim(key, priority_of(p), cls, budgets, node=node)
    return out


# The kubelet's mark on a static pod's API mirror: deleting the mirror stops nothing.
MIRROR = "kubernetes.io/config.mirror"


def grace_s(pod: dict[str, Any]) -> int:
    """The pod's termination grace in seconds, clamped to [0, MAX_GRACE_S]: a hold lasts that
    long past the evictions at most."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    v = meta.get("deletionGracePeriodSeconds")  # an eviction under way may have shortened it
    if v is None:
        v = spec.get("terminationGracePeriodSeconds")
    if v is None:
        return 30
    try:
        return max(0, min(int(v), MAX_GRACE_S))
    except (TypeError, ValueError, OverflowError):
        return MAX_GRACE_S
