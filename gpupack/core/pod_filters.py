"""Would kube-scheduler's filters let a pod onto a node once some pods there are gone?

The preemption controller evicts only where its preemptor will run: the victims' room is no use
to a pod that kube-scheduler's other filters keep off the node. These are those filters, as
kube-scheduler (v1.28-v1.36) applies them, over plain Kubernetes dicts:

- NodeAffinity (nodeSelector and required node affinity) and TaintToleration;
- NodePorts: a host port the pod asks for, in use by a pod that stays;
- InterPodAffinity: the pod's required affinity and anti-affinity terms, and the required
  anti-affinity terms of the pods that stay (the symmetric rule);
- PodTopologySpread: constraints with `whenUnsatisfiable: DoNotSchedule`.

Evicting a pod can fix an anti-affinity conflict, a host port and a spread skew, and can break an
affinity (the pod it needed leaves); the caller passes the pods that stay, so each filter is
judged as it will be. Pods being deleted still count, as they do in kube-scheduler's snapshot,
except for topology spread, which skips them.

Plain data in and out, no I/O: the caller supplies the nodes, the pods that stay and a lookup of
namespace labels (for `namespaceSelector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupack.contract import selector_matches
from gpupack.core import node_rules as nr

Taint = tuple[str, str, str]  # key, value, effect
# kube-scheduler's reasons (its plugins' messages), so an Event reads as `kubectl describe` would
NODE_AFFINITY = "node(s) didn't match Pod's node affinity/selector"
TAINT = "node(s) had untolerated taint"
PORTS = "node(s) didn't have free ports for the requested pod ports"
AFFINITY = "node(s) didn't match pod affinity rules"
ANTI_AFFINITY = "node(s) didn't match pod anti-affinity rules"
EXISTING_ANTI_AFFINITY = "node(s) didn't satisfy existing pods anti-affinity rules"
SPREAD = "node(s) didn't match pod topology spread constraints"
SPREAD_LABEL = "node(s) didn't match pod topology spread constraints (missing required label)"


@dataclass(frozen=True)
class NodeFacts:
    """A node as the filters read it."""

    name: str
    labels: Mapping[str, str]
    taints: frozenset[Taint] = frozenset()


@dataclass(frozen=True)
class Placed:
    """A pod on a node, as the filters read it (see `placed`)."""

    key: str  # namespace/name
    namespace: str
    node: str
    labels: Mapping[str, str]
    anti: tuple[Mapping[str, Any], ...] = ()  # its required anti-affinity terms
    ports: frozenset[tuple[str, str, int]] = frozenset()  # (protocol, host IP, host port)
    terminating: bool = False


NamespaceLabels = Callable[[str], Mapping[str, str] | None]  # None: unknown


def _spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    s = pod.get("spec")
    return s if isinstance(s, Mapping) else {}


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    m = pod.get("metadata")
    return m if isinstance(m, Mapping) else {}


def _labels(pod: Mapping[str, Any]) -> dict[str, str]:
    raw = _meta(pod).get("labels")
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}


def _list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else []


def _terms(pod: Mapping[str, Any], kind: str) -> tuple[Mapping[str, Any], ...]:
    aff = _spec(pod).get("affinity")
    part = aff.get(kind) if isinstance(aff, Mapping) else None
    terms = part.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(part, Mapping) else None
    return tuple(t for t in _list(terms) if isinstance(t, Mapping))


def host_ports(pod: Mapping[str, Any]) -> frozenset[tuple[str, str, int]]:
    """(protocol, host IP, host port) of every container port with a host port; restartable init
    containers (sidecars) count, as they run beside the app containers."""
    out = set()
    spec = _spec(pod)
    cs = _list(spec.get("containers")) + [
        c
        for c in _list(spec.get("initContainers"))
        if isinstance(c, Mapping) and c.get("restartPolicy") == "Always"
    ]
    for c in cs:
        for p in _list(c.get("ports") if isinstance(c, Mapping) else None):
            if not isinstance(p, Mapping):
                continue
            try:
                port = int(p.get("hostPort") or 0)
            except (TypeError, ValueError):
                continue
            if port > 0:
                out.add((str(p.get("protocol") or "TCP"), str(p.get("hostIP") or "0.0.0.0"), port))
    return frozenset(out)


def placed(pod: Mapping[str, Any]) -> Placed:
    meta = _meta(pod)
    ns = str(meta.get("namespace") or "default")
    return Placed(
        f"{ns}/{meta.get('name')}",
        ns,
        str(_spec(pod).get("nodeName") or ""),
        _labels(pod),
        _terms(pod, "podAntiAffinity"),
        host_ports(pod),
        bool(meta.get("deletionTimestamp")),
    )


# --- NodeAffinity and TaintToleration ---------------------------------------------------------


def node_allows(pod: Mapping[str, Any], node: NodeFacts) -> str | None:
    """None when NodeAffinity and TaintToleration let the pod onto the node, else the reason.
    No pod leaving changes these. The matching itself is node_rules' (the autoscale plan asks the
    same of a group's template), so both judge a selector or toleration alike."""
    terms, facts = nr.pod_terms(_spec(pod), host=False), _facts(node)
    if nr.affinity_refusal(terms, facts, "node") is not None:
        return NODE_AFFINITY
    if nr.taint_refusal(terms, facts) is not None:
        return TAINT
    return None


def _facts(node: NodeFacts) -> nr.NodeFacts:
    """The node as node_rules reads it (taints as the API's dicts)."""
    taints = tuple({"key": k, "value": v, "effect": e} for k, v, e in node.taints)
    return nr.NodeFacts(node.labels, taints, name=node.name)


# --- NodePorts --------------------------------------------------------------------------------


def _ports_clash(a: tuple[str, str, int], b: tuple[str, str, int]) -> bool:
    return a[0] == b[0] and a[2] == b[2] and (a[1] == b[1] or "0.0.0.0" in (a[1], b[1]))


def ports_free(pod: Mapping[str, Any], node: str, staying: Iterable[Placed]) -> bool:
    want = host_ports(pod)
    if not want:
        return True
    return not any(
        _ports_clash(w, u) for p in staying if p.node == node and p.ports for u in p.ports for w in want
    )


# --- InterPodAffinity -------------------------------------------------------------------------


def _term_namespaces_match(
    term: Mapping[str, Any], owner_ns: str, ns: str, ns_labels: NamespaceLabels
) -> bool | None:
    """Whether a pod in `ns` is in the term's namespaces (the term belongs to a pod in
    `owner_ns`); None when its namespaceSelector needs labels that are unknown."""
    names = [str(n) for n in _list(term.get("namespaces"))]
    sel = term.get("namespaceSelector")
    if not names and sel is None:
        return ns == owner_ns
    if ns in names:
        return True
    if sel is None or not isinstance(sel, Mapping):
        return False
    labels = ns_labels(ns)
    if labels is None:
        return None
    return selector_matches(sel, labels)


def _term_matches(
    term: Mapping[str, Any], owner_ns: str, ns: str, labels: Mapping[str, str], ns_labels: NamespaceLabels
) -> bool | None:
    sel = term.get("labelSelector")
    if not isinstance(sel, Mapping) or not selector_matches(sel, labels):
        return False  # a null selector matches no pod
    return _term_namespaces_match(term, owner_ns, ns, ns_labels)


@dataclass(frozen=True)
class Domains:
    """What InterPodAffinity reads of the pods that stay, for one pod: per topology pair
    (key, value), how many pods match its affinity terms; the pairs holding a pod its
    anti-affinity terms match; the pairs whose pods' anti-affinity terms match it."""

    affinity: Mapping[tuple[str, str], int]
    anti: frozenset[tuple[str, str]]
    existing_anti: frozenset[tuple[str, str]]
    self_match: bool  # the pod matches all its own affinity terms


def domains(
    pod: Mapping[str, Any],
    nodes: Mapping[str, NodeFacts],
    staying: Iterable[Placed],
    ns_labels: NamespaceLabels,
) -> Domains:
    """One walk over the pods that stay; a namespace whose labels are unknown counts against the
    pod (its affinity not met, an anti-affinity matched): the caller then does not evict."""
    meta = _meta(pod)
    ns, labels = str(meta.get("namespace") or "default"), _labels(pod)
    aff, anti = _terms(pod, "podAffinity"), _terms(pod, "podAntiAffinity")
    counts: dict[tuple[str, str], int] = {}
    anti_hit: set[tuple[str, str]] = set()
    existing: set[tuple[str, str]] = set()
    me = f"{ns}/{meta.get('name')}"
    for p in staying:
        if p.key == me:
            continue
        where = nodes.get(p.node)
        if where is None:
            continue
        for t in aff:
            key = str(t.get("topologyKey") or "")
            if key in where.labels and _term_matches(t, ns, p.namespace, p.labels, ns_labels):
                counts[(key, where.labels[key])] = counts.get((key, where.labels[key]), 0) + 1
        for t in anti:
            key = str(t.get("topologyKey") or "")
            if key in where.labels and _term_matches(t, ns, p.namespace, p.labels, ns_labels) is not False:
                anti_hit.add((key, where.labels[key]))
        for t in p.anti:  # the pods that stay may not want this one near them
            key = str(t.get("topologyKey") or "")
            if key in where.labels and _term_matches(t, p.namespace, ns, labels, ns_labels) is not False:
                existing.add((key, where.labels[key]))
    self_match = all(_term_matches(t, ns, ns, labels, ns_labels) for t in aff)
    return Domains(counts, frozenset(anti_hit), frozenset(existing), self_match)


def inter_pod_affinity(pod: Mapping[str, Any], node: NodeFacts, d: Domains) -> str | None:
    """None when InterPodAffinity lets the pod onto the node, the pods that stay read into `d`,
    else the reason."""
    if any((k, v) in d.existing_anti for k, v in node.labels.items()):
        return EXISTING_ANTI_AFFINITY
    for t in _terms(pod, "podAntiAffinity"):
        key = str(t.get("topologyKey") or "")
        if key in node.labels and (key, node.labels[key]) in d.anti:
            return ANTI_AFFINITY
    return pod_affinity(pod, node, d)


def pod_affinity(pod: Mapping[str, Any], node: NodeFacts, d: Domains) -> str | None:
    """The affinity half of InterPodAffinity. Pods leaving can only break it (but for the first
    pod of a series), so a node it refuses with every pod staying is no candidate."""
    aff = _terms(pod, "podAffinity")
    if aff:
        exist = True
        for t in aff:
            key = str(t.get("topologyKey") or "")
            if key not in node.labels:
                return AFFINITY  # every topology key must be on the node
            if d.affinity.get((key, node.labels[key]), 0) <= 0:
                exist = False
        # the first pod of a series with affinity to itself: allowed when no pod anywhere
        # matches any term and the pod matches all its own terms
        if not exist and (d.affinity or not d.self_match):
            return AFFINITY
    return None


# --- PodTopologySpread ------------------------------------------------------------------------


def _int(v: Any, default: int, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return default
    return max(lo, min(hi, n))


def topology_spread(
    pod: Mapping[str, Any], node: NodeFacts, nodes: Mapping[str, NodeFacts], staying: Iterable[Placed]
) -> str | None:
    """None when every DoNotSchedule spread constraint of the pod allows the node with
    `staying` the pods in the cluster, else the reason. Domains are those of the nodes that
    carry every constraint's key and (nodeAffinityPolicy Honor, the default) pass the pod's node
    affinity, and (nodeTaintsPolicy Honor only) tolerate its taints."""
    cons = [
        c
        for c in _list(_spec(pod).get("topologySpreadConstraints"))
        if isinstance(c, Mapping) and c.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule"
    ]
    if not cons:
        return None
    meta = _meta(pod)
    ns, labels = str(meta.get("namespace") or "default"), _labels(pod)
    keys = [str(c.get("topologyKey") or "") for c in cons]
    if any(k not in node.labels for k in keys):
        return SPREAD_LABEL
    staying = [p for p in staying if not p.terminating and p.namespace == ns]
    terms = nr.pod_terms(_spec(pod), host=False)
    for c, key in zip(cons, keys, strict=True):
        sel = c.get("labelSelector")
        sel = dict(sel) if isinstance(sel, Mapping) else None
        extra = {k: labels[k] for k in (str(x) for x in _list(c.get("matchLabelKeys"))) if k in labels}
        if extra:
            sel = dict(sel or {})
            sel["matchLabels"] = {**dict(sel.get("matchLabels") or {}), **extra}

        def eligible(n: NodeFacts, c: Mapping[str, Any] = c) -> bool:
            if any(k not in n.labels for k in keys):
                return False
            facts = _facts(n)
            if (
                c.get("nodeAffinityPolicy", "Honor") == "Honor"
                and nr.affinity_refusal(terms, facts) is not None
            ):
                return False
            return c.get("nodeTaintsPolicy", "Ignore") != "Honor" or nr.taint_refusal(terms, facts) is None

        domains = {n.labels[key]: 0 for n in nodes.values() if eligible(n)}
        for p in staying:
            where = nodes.get(p.node)
            if where is None or not eligible(where):
                continue
            if sel is not None and selector_matches(sel, p.labels):
                domains[where.labels[key]] = domains.get(where.labels[key], 0) + 1
        domains.setdefault(node.labels[key], 0)
        least = min(domains.values())
        min_domains = _int(c.get("minDomains"), 1, 1, 1 << 20)
        if len(domains) < min_domains:
            least = 0
        me = 1 if sel is not None and selector_matches(sel, labels) else 0
        if domains[node.labels[key]] + me - least > _int(c.get("maxSkew"), 1, 1, 1 << 30):
            return SPREAD
    return None


def refusal(
    pod: Mapping[str, Any],
    node: NodeFacts,
    nodes: Mapping[str, NodeFacts],
    staying: Iterable[Placed],
    ns_labels: NamespaceLabels,
) -> str | None:
    """None when every filter here lets the pod onto `node` with `staying` the pods in the
    cluster (the victims removed), else kube-scheduler's reason for the first that does not."""
    staying = list(staying)
    why = node_allows(pod, node)
    if why is None and not ports_free(pod, node.name, staying):
        why = PORTS
    return (
        why
        or topology_spread(pod, node, nodes, staying)
        or inter_pod_affinity(pod, node, domains(pod, nodes, staying, ns_labels))
    )


def has_pod_affinity(pod: Mapping[str, Any]) -> bool:
    return bool(_terms(pod, "podAffinity"))


def needs_pods(pod: Mapping[str, Any]) -> bool:
    """Whether any filter here reads the other pods for this pod (beyond the symmetric
    anti-affinity of the pods that stay, which any pod may meet)."""
    spec = _spec(pod)
    return bool(
        host_ports(pod)
        or _terms(pod, "podAffinity")
        or _terms(pod, "podAntiAffinity")
        or any(
            isinstance(c, Mapping) and c.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule"
            for c in _list(spec.get("topologySpreadConstraints"))
        )
    )
