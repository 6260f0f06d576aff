"""Will the preemptor run where its victims leave room? The preemption controller evicts only
where, once the victims are gone, the preemptor passes every filter kube-scheduler applies on that
node. Two sources answer:

- kube-scheduler's own reasons, from the pod's PodScheduled condition (its last attempt): when
  every node failed for a reason that no eviction can fix (node affinity or selector, an
  untolerated taint, pod affinity, a volume's node affinity or zone, an unbound or missing claim,
  a cordoned node), nothing is evicted for the pod. kube-scheduler's own preemption reads these
  failures the same way ("UnschedulableAndUnresolvable").
- the filters checked here on the chosen node with the victims removed (gpupack.core.pod_filters:
  node affinity, taints, host ports, inter-pod affinity and anti-affinity both ways, hard topology
  spread), and the node resources gpupack's chooser does not weigh (ephemeral storage, hugepages,
  extended resources).

Volumes are not read here (the extender has no right to read claims or volumes): a pod that mounts
a PersistentVolumeClaim (or a generic ephemeral volume) is preempted for only when
kube-scheduler's reasons show that its volume filters passed on every node they were asked
about, which is so when no volume reason appears and no node failed an earlier filter that an
eviction could fix (host ports, which run before the volume filters and hide their answer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpupack.core import pod_filters as pf

from ..state.hostuse import HostUse

# kube-scheduler's reasons that no eviction fixes (substrings of its plugins' messages, v1.28-v1.36)
UNFIXABLE = (
    "didn't match Pod's node affinity/selector",
    "had untolerated taint",
    "didn't match pod affinity rules",
    "were unschedulable",
    "didn't match the requested node name",
    "missing required label",
    "didn't satisfy plugin(s)",
)
VOLUME = (
    "volume",  # node affinity conflict, zone, max count, unbound claims, claim not found, ...
    "non-existent pv",
    "did not have enough free storage",
)
# reasons of filters that run before the volume filters and that an eviction may fix: such a
# node's volume answer is unknown
BEFORE_VOLUMES = ("didn't have free ports",)
_COUNTED = re.compile(r"^(\d+) (.+)$")


def scheduler_message(pod: Mapping[str, Any]) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message") or "")
    return ""


def reasons(message: str) -> tuple[list[tuple[int, str]], str]:
    """kube-scheduler's "0/N nodes are available: 2 reason, 1 other." as (count, reason) pairs,
    and what stands there instead of counts (a pod-level error, e.g. a claim not found)."""
    head = message.split(" preemption:", 1)[0].strip()
    _, sep, rest = head.partition("nodes are available:")
    if not sep:
        return [], head
    rest = rest.strip().rstrip(".")
    out: list[tuple[int, str]] = []
    loose: list[str] = []
    for part in rest.split(", "):
        m = _COUNTED.match(part.strip())
        if m:
            out.append((int(m.group(1)), m.group(2)))
        elif part.strip():
            loose.append(part.strip())
    return out, ", ".join(loose)


def _any(text: str, marks: Iterable[str]) -> bool:
    low = text.lower()
    return any(m.lower() in low for m in marks)


def has_claims(pod: Mapping[str, Any]) -> bool:
    """The pod mounts a PersistentVolumeClaim or a generic ephemeral volume (a claim made for it)."""
    vols = (pod.get("spec") or {}).get("volumes") or []
    return any(isinstance(v, Mapping) and ("persistentVolumeClaim" in v or "ephemeral" in v) for v in vols)


def scheduler_refuses(pod: Mapping[str, Any]) -> str | None:
    """Why kube-scheduler's last attempt shows that no eviction can place the pod, or None."""
    msg = scheduler_message(pod)
    counted, loose = reasons(msg)
    if counted and not loose and all(_any(r, UNFIXABLE) or _any(r, VOLUME) for _, r in counted):
        return "kube-scheduler: " + "; ".join(r for _, r in counted)
    if has_claims(pod):
        if loose and _any(loose, VOLUME):
            return f"kube-scheduler: {loose}"
        vol = [r for _, r in counted if _any(r, VOLUME)]
        if vol:
            return f"its volumes do not fit every node (kube-scheduler: {'; '.join(vol)})"
        before = [r for _, r in counted if _any(r, BEFORE_VOLUMES)]
        if before:
            return (
                "it mounts claims, and kube-scheduler did not reach its volume filters on every node "
                f"({'; '.join(before)})"
            )
        if not msg:
            return "it mounts claims, and kube-scheduler has not said yet whether its volumes fit"
    elif not counted and loose and _any(loose, VOLUME):
        return f"kube-scheduler: {loose}"
    return None


def resources_short(want: HostUse, alloc: HostUse, used: HostUse, freed: Iterable[HostUse]) -> str | None:
    """The node resources the chooser does not weigh (ephemeral storage, hugepages, extended
    resources: `want.other`) against what the node has, the victims' requests (`freed`) given
    back: kube-scheduler's reason for the first one short, or None."""
    if want.eph_bytes <= 0 and not want.other:
        return None
    eph, other = used.eph_bytes, dict(used.other)
    for f in freed:
        eph -= f.eph_bytes
        for k, v in f.other:
            other[k] = other.get(k, 0) - v
    if want.eph_bytes > 0 and want.eph_bytes > alloc.eph_bytes - eph:
        return "Insufficient ephemeral-storage"
    have = dict(alloc.other)
    for k, v in want.other:
        if v > 0 and v > have.get(k, 0) - other.get(k, 0):
            return f"Insufficient {k}"
    return None


class PodsInPlace:
    """The pods of the cluster and its nodes as the filters read them, built once a pass and
    only as far as a preemptor needs: every pod for one whose filters read other pods, the pods
    with a required anti-affinity (which any preemptor may meet) otherwise."""

    def __init__(
        self,
        running: list[dict[str, Any]],
        nodes: Mapping[str, pf.NodeFacts],
        ns_labels: pf.NamespaceLabels,
    ) -> None:
        self.running, self.nodes, self.ns_labels = running, nodes, ns_labels
        self._all: list[pf.Placed] | None = None
        self._anti: list[pf.Placed] | None = None

    def every(self) -> list[pf.Placed]:
        if self._all is None:
            self._all = [pf.placed(p) for p in self.running if (p.get("spec") or {}).get("nodeName")]
        return self._all

    def with_anti(self) -> list[pf.Placed]:
        if self._anti is None:
            if self._all is not None:
                self._anti = [p for p in self._all if p.anti]
            else:
                self._anti = [
                    pf.placed(p)
                    for p in self.running
                    if (p.get("spec") or {}).get("nodeName")
                    and ((p.get("spec") or {}).get("affinity") or {}).get("podAntiAffinity")
                ]
                self._anti = [p for p in self._anti if p.anti]
        return self._anti

    def reachable(self, pod: Mapping[str, Any]) -> Callable[[str], bool]:
        """Per node, whether the pod's required pod affinity is met with every pod staying (no
        eviction can meet it otherwise): the nodes worth choosing victims on."""
        if not pf.has_pod_affinity(pod):
            return lambda _name: True
        d = pf.domains(pod, self.nodes, self.every(), self.ns_labels)

        def ok(name: str) -> bool:
            facts = self.nodes.get(name)
            return facts is not None and pf.pod_affinity(pod, facts, d) is None

        return ok

    def refusal(self, pod: Mapping[str, Any], node: str, victims: Iterable[str]) -> str | None:
        """kube-scheduler's reason for refusing `pod` on `node` once `victims` (keys) are gone."""
        facts = self.nodes.get(node)
        if facts is None:
            return "the node is gone"
        gone = set(victims)
        base = self.every() if pf.needs_pods(pod) else self.with_anti()
        staying = [p for p in base if p.key not in gone] if gone else base
        return pf.refusal(pod, facts, self.nodes, staying, self.ns_labels)
