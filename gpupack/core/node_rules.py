"""Would a node take a pod, as kube-scheduler's NodeAffinity, TaintToleration and NodeResourcesFit
filters judge it: plain dicts in (a pod's spec; a node's labels, taints and allocatable), a reason
or None out. The autoscale plan asks this of a node group's template before it orders a node for a
pod, so that no node is added that the pod could never use.

Every value comes from a tenant's pod: nothing here raises on a malformed spec, numbers are parsed
with the bounded quantity parser and kept as Python ints (no overflow), and each reason quotes at
most a short prefix of what the tenant wrote.

Scope: the required rules only (preferred terms and PreferNoSchedule taints never keep a pod off a
node). `matchFields` names a node (`metadata.name`), which a node not yet made cannot carry: such a
term never matches a new node, and on an existing one it is checked against the node's name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from gpupack.contract import ContractError, parse_quantity

_INT64 = 1 << 63
_LABEL_INT = re.compile(r"[+-]?[0-9]{1,19}")
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
MIB = 1 << 20


def _short(v: Any, n: int = 40) -> str:
    s = str(v)
    return s if len(s) <= n else s[: n - 3] + "..."


@dataclass(frozen=True)
class HostNeeds:
    """What a pod asks of a node's host resources, as the scheduler adds them up."""

    cpu_milli: int = 0
    mem_bytes: int = 0
    pods: int = 1


@dataclass(frozen=True)
class NodeFacts:
    """What a node (or a group's template node) offers the rules: labels, taints (each a dict with
    key, value, effect) and allocatable host resources (None: not known, not checked)."""

    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    taints: tuple[Mapping[str, Any], ...] = ()
    cpu_milli: int | None = None
    mem_bytes: int | None = None
    pods: int | None = None
    name: str = ""  # an existing node's name (matchFields); "" for a node not yet made


@dataclass(frozen=True)
class PodTerms:
    """The parts of a pod's spec the rules read, taken apart once per pass. `problem` is set when
    the spec cannot be judged (a malformed quantity): such a pod is placed nowhere."""

    selector: Mapping[str, Any] = field(default_factory=dict, hash=False)
    terms: tuple[Mapping[str, Any], ...] | None = None  # None: no required node affinity
    tolerations: tuple[Mapping[str, Any], ...] = ()
    needs: HostNeeds = HostNeeds()
    problem: str | None = None


def _dict(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _amount(v: Any, what: str, scale: int) -> int:
    """A request in whole units of 1/`scale` (milli-CPU: 1000; bytes: 1), rounded up."""
    q = parse_quantity(v, what)
    if q < 0:
        raise ContractError(f"{what}: {_short(v)} is negative")
    return int((q * scale).to_integral_value(ROUND_CEILING))


def _requests(c: Any, where: str) -> tuple[int, int]:
    req = _dict(_dict(_dict(c).get("resources")).get("requests"))
    name = _short(_dict(c).get("name", "?"), 30)
    cpu = _amount(req["cpu"], f"{where} {name!r} cpu request", 1000) if "cpu" in req else 0
    mem = _amount(req["memory"], f"{where} {name!r} memory request", 1) if "memory" in req else 0
    return cpu, mem


def host_needs(spec: Mapping[str, Any]) -> HostNeeds:
    """The pod's effective requests as kube-scheduler computes them: the app containers and the
    restartable (sidecar) init containers together, or the largest moment of the init sequence
    if more, plus the pod's overhead. Raises ContractError on a quantity that does not parse."""
    cpu = mem = 0
    for c in _list(spec.get("containers")):
        a, b = _requests(c, "container")
        cpu, mem = cpu + a, mem + b
    side_cpu = side_mem = init_cpu = init_mem = 0
    for c in _list(spec.get("initContainers")):
        a, b = _requests(c, "init container")
        if _dict(c).get("restartPolicy") == "Always":
            side_cpu, side_mem = side_cpu + a, side_mem + b
            a, b = side_cpu, side_mem
        else:
            a, b = a + side_cpu, b + side_mem
        init_cpu, init_mem = max(init_cpu, a), max(init_mem, b)
    cpu, mem = max(cpu + side_cpu, init_cpu), max(mem + side_mem, init_mem)
    over = _dict(spec.get("overhead"))
    if "cpu" in over:
        cpu += _amount(over["cpu"], "overhead cpu", 1000)
    if "memory" in over:
        mem += _amount(over["memory"], "overhead memory", 1)
    return HostNeeds(cpu, mem, 1)


def pod_terms(spec: Any, host: bool = True) -> PodTerms:
    """Take a pod's spec apart for :func:`refusal`; never raises. `host=False` leaves its host
    requests unread (for a caller that asks only :func:`rule_refusal`)."""
    spec = _dict(spec)
    affinity = _dict(_dict(spec.get("affinity")).get("nodeAffinity"))
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = None
    if required is not None:
        terms = tuple(_dict(t) for t in _list(_dict(required).get("nodeSelectorTerms")))
    tolerations = tuple(_dict(t) for t in _list(spec.get("tolerations")))
    needs, problem = HostNeeds(), None
    try:
        if host:
            needs = host_needs(spec)
    except ContractError as e:
        problem = f"cannot place: {e}"
    return PodTerms(_dict(spec.get("nodeSelector")), terms, tolerations, needs, problem)


def _label_int(v: Any) -> int | None:
    """A label value or Gt/Lt operand as the scheduler reads it (a base-10 int64), else None."""
    if not isinstance(v, str) or not _LABEL_INT.fullmatch(v):
        return None
    n = int(v)
    return n if -_INT64 <= n < _INT64 else None


def expression_holds(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """One nodeSelectorRequirement against a node's labels (operators In, NotIn, Exists,
    DoesNotExist, Gt, Lt; anything else never holds)."""
    key, op = expr.get("key"), expr.get("operator")
    values = _list(expr.get("values"))
    if not isinstance(key, str):
        return False
    has = key in labels
    value = labels.get(key)
    if op == "In":
        return has and value in values
    if op == "NotIn":
        return not has or value not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt"):
        if not has or len(values) != 1:
            return False
        a, b = _label_int(value), _label_int(values[0])
        if a is None or b is None:
            return False
        return a > b if op == "Gt" else a < b
    return False


def _field_holds(expr: Mapping[str, Any], name: str) -> bool:
    """A matchFields requirement: only metadata.name exists, and a new node has no name yet."""
    if not name or expr.get("key") != "metadata.name":
        return False
    return expression_holds({**expr, "key": "n"}, {"n": name})


def term_holds(term: Mapping[str, Any], facts: NodeFacts) -> bool:
    """A nodeSelectorTerm: all of its requirements; an empty term matches no node."""
    exprs = [_dict(e) for e in _list(term.get("matchExpressions"))]
    fields = [_dict(e) for e in _list(term.get("matchFields"))]
    if not exprs and not fields:
        return False
    return all(expression_holds(e, facts.labels) for e in exprs) and all(
        _field_holds(e, facts.name) for e in fields
    )


def tolerates(tol: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """kube's Toleration.ToleratesTaint: effect (empty = all), key (empty with Exists = all),
    operator Exists (any value) or Equal (default; the same value)."""
    effect = tol.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = tol.get("key") or ""
    op = tol.get("operator") or "Equal"
    if key != (taint.get("key") or "") and not (key == "" and op == "Exists"):
        return False
    if op == "Exists":
        return True
    return op == "Equal" and (tol.get("value") or "") == (taint.get("value") or "")


def _taint_text(t: Mapping[str, Any]) -> str:
    v = t.get("value")
    return f"{_short(t.get('key'))}{'=' + _short(v) if v else ''}:{t.get('effect')}"


def affinity_refusal(pod: PodTerms, facts: NodeFacts, where: str = "template") -> str | None:
    """Why the pod's nodeSelector or required node affinity keeps it off the node, or None."""
    for k, v in pod.selector.items():
        if facts.labels.get(k) != v:
            return f"nodeSelector {_short(k)}={_short(v)} not in {where} labels"
    if pod.terms is not None and not any(term_holds(t, facts) for t in pod.terms):
        return f"required node affinity: none of its {len(pod.terms)} term(s) matches the {where} labels"
    return None


def taint_refusal(pod: PodTerms, facts: NodeFacts) -> str | None:
    """The first of the node's NoSchedule/NoExecute taints the pod does not tolerate, or None."""
    for t in facts.taints:
        if t.get("effect") in BLOCKING_EFFECTS and not any(tolerates(tol, t) for tol in pod.tolerations):
            return f"taint {_taint_text(t)} not tolerated"
    return None


def rule_refusal(pod: PodTerms, facts: NodeFacts, where: str = "template") -> str | None:
    """Why the node's labels and taints keep the pod off it (the first reason), or None."""
    return pod.problem or affinity_refusal(pod, facts, where) or taint_refusal(pod, facts)


def _cpus(milli: int) -> str:
    return f"{milli // 1000} CPUs" if milli % 1000 == 0 else f"{milli}m CPU"


def _mem(b: int) -> str:
    gib = Decimal(b) / (1 << 30)
    return f"{gib.quantize(Decimal('0.1'), ROUND_FLOOR)} GiB" if gib < 10**9 else f"{b:.3g} bytes"


def host_refusal(needs: HostNeeds, facts: NodeFacts) -> str | None:
    """Why an empty node of these allocatable resources cannot hold the pod, or None."""
    if facts.cpu_milli is not None and needs.cpu_milli > facts.cpu_milli:
        return f"needs {_cpus(needs.cpu_milli)}, a node has {_cpus(facts.cpu_milli)}"
    if facts.mem_bytes is not None and needs.mem_bytes > facts.mem_bytes:
        return f"needs {_mem(needs.mem_bytes)} of memory, a node has {_mem(facts.mem_bytes)}"
    if facts.pods is not None and needs.pods > facts.pods:
        return f"a node takes {facts.pods} pods"
    return None


def refusal(pod: PodTerms, facts: NodeFacts, where: str = "template") -> str | None:
    """The first reason the node would not take the pod (rules, then host resources), or None."""
    return rule_refusal(pod, facts, where) or host_refusal(pod.needs, facts)


def node_facts(node: Mapping[str, Any], with_name: bool = True) -> NodeFacts:
    """A Node object's (or a template Node's) facts. Allocatable values that do not parse count
    as unknown: a node's status is written by its kubelet or the operator, not by a tenant."""
    meta, spec = _dict(node.get("metadata")), _dict(node.get("spec"))
    alloc = _dict(_dict(node.get("status")).get("allocatable"))
    labels = {str(k): str(v) for k, v in _dict(meta.get("labels")).items()}
    taints = tuple(_dict(t) for t in _list(spec.get("taints")))
    out: list[int | None] = []
    for key, scale in (("cpu", 1000), ("memory", 1), ("pods", 1)):
        try:
            q = parse_quantity(alloc[key], f"allocatable {key}") if key in alloc else None
            out.append(None if q is None or q < 0 else int((q * scale).to_integral_value(ROUND_FLOOR)))
        except ContractError:
            out.append(None)
    return NodeFacts(labels, taints, out[0], out[1], out[2], str(meta.get("name") or "") if with_name else "")


def ceil_mib(b: int) -> int:
    return -(-b // MIB)
