"""Which pods to evict so that a pending pod fits: GPU-aware preemption's victim chooser.

Kubernetes' rules first: a pod evicts only pods of strictly lower priority, never when its
preemptionPolicy is Never, and never a pod of the system priority classes (value >= 1e9). Within
them the fit rules decide (gpupack.core.fit): per GPU share, online and offline never on one GPU
(so freeing a GPU for an online pod means every offline pod on it goes), whole GPUs, multi-GPU
pods and init containers as fit counts them.

The choice, per node: every eligible pod removed must make the pod fit, or the node is no
candidate (no eviction for a pod that cannot fit anyway); then victims are given back (reprieved)
one at a time while the pod still fits, budget-protected, higher-priority, online and small ones
first, until no victim can be given back (minimal). Single-GPU pods try each GPU on its own
first, which keeps the victims on one GPU. Nodes compare by PodDisruptionBudget violations, then
the highest victim priority, the number of victims, their priority sum and online victims. A pod
covered by a budget that allows no more disruptions is a candidate only when no choice without
one exists.

Plain data in and out, no I/O: the extender's preemption controller and the simulator call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpupack.contract import CLASS_OFFLINE
from gpupack.core.fit import Fit, GpuRank, fit, tightest
from gpupack.core.model import FULL, Node, PodRequest

# Kubernetes' system priority classes (system-cluster-critical, system-node-critical) start here;
# user PriorityClasses may not go above it, and nothing preempts a pod at or above it.
SYSTEM_PRIORITY = 1_000_000_000


@dataclass(frozen=True)
class Preemptor:
    """The pending pod: its request, its priority and whether it may preempt at all."""

    pod: PodRequest
    priority: int = 0
    may_preempt: bool = True  # False when spec.preemptionPolicy is Never


@dataclass(frozen=True)
class Victim:
    """A running pod that could be evicted, as the chooser needs it."""

    key: str  # the holder key on the GPUs (namespace/name)
    priority: int = 0
    pod_class: str = "online"
    budgets: tuple[str, ...] = ()  # PodDisruptionBudgets covering it
    cpu_milli: int = 0  # host CPU and memory it frees, when the nodes track them
    ram_mib: int = 0


@dataclass(frozen=True)
class Choice:
    """Evict `victims` on `node`, then the pod fits as `fit` says."""

    node: str
    victims: tuple[str, ...]
    fit: Fit
    budget_violations: int = 0  # victims whose eviction a budget does not allow now


def may_evict(pre: Preemptor, v: Victim) -> bool:
    return pre.may_preempt and v.priority < pre.priority and v.priority < SYSTEM_PRIORITY


def without(node: Node, victims: Iterable[str], pods: Mapping[str, Victim] | None = None) -> Node:
    """A copy of `node` with the victims' shares (and host CPU/memory) released."""
    gone = set(victims)
    out = node.copy()
    for g in out.gpus:
        left = gone.intersection(g.holders)
        if not left:
            continue
        for k in left:
            mem, milli = g.holders.pop(k)
            if not g.exclusive:
                g.mem_used -= mem
                g.milli_used -= milli
        if g.exclusive and not g.holders:
            g.exclusive = False
        if not g.holders:
            g.pod_class, g.mem_used, g.milli_used = None, 0, 0
        elif g.exclusive:
            g.mem_used, g.milli_used = g.mem_mib, FULL
    if pods is not None:
        for k in gone:
            v = pods.get(k)
            if v is not None:
                out.cpu_used -= v.cpu_milli
                out.ram_used -= v.ram_mib
    return out


def budget_violations(victims: Iterable[Victim], allowed: Mapping[str, int]) -> int:
    """How many of `victims` a budget would refuse, evicted in this order."""
    left = dict(allowed)
    n = 0
    for v in victims:
        over = False
        for b in v.budgets:
            left[b] = left.get(b, 0) - 1
            over = over or left[b] < 0
        n += over
    return n


def _scoped(node: Node, gpus: frozenset[int] | None) -> Node:
    if gpus is None:
        return node
    out = node.copy()
    for g in out.gpus:
        if g.index not in gpus:
            g.healthy = False
    return out


def _fits(node: Node, pod: PodRequest, rank: GpuRank) -> Fit | None:
    f = fit(node, pod, rank)
    return f if isinstance(f, Fit) else None


def _reprieve(
    node: Node, pod: PodRequest, victims: list[Victim], pods: Mapping[str, Victim], rank: GpuRank
) -> tuple[list[Victim], Fit] | None:
    """Give victims back while the pod still fits, until none can be; None if it never fits."""
    chosen = list(victims)
    best = _fits(without(node, (v.key for v in chosen), pods), pod, rank)
    if best is None:
        return None
    changed = True
    while changed:  # a second round proves minimality: no victim of the final set can be spared
        changed = False
        for v in list(chosen):
            rest = [x for x in chosen if x is not v]
            f = _fits(without(node, (x.key for x in rest), pods), pod, rank)
            if f is not None:
                chosen, best, changed = rest, f, True
    return chosen, best


def _keep_first(v: Victim, allowed: Mapping[str, int], size: int) -> tuple[int, int, int, int, str]:
    # the order victims are offered back: protected by an exhausted budget, higher priority,
    # online, smaller (sparing the small ones leaves the big ones to make room), then by key
    protected = any(allowed.get(b, 0) <= 0 for b in v.budgets)
    return (not protected, -v.priority, v.pod_class == CLASS_OFFLINE, size, v.key)


def _order_key(c: Choice, pods: Mapping[str, Victim]) -> tuple[int, int, int, int, int, str]:
    vs = [pods[k] for k in c.victims]
    return (
        c.budget_violations,
        max((v.priority for v in vs), default=-(2**62)),
        len(vs),
        sum(v.priority for v in vs),
        sum(v.pod_class != CLASS_OFFLINE for v in vs),
        c.node,
    )


def _scopes(node: Node, pod: PodRequest) -> list[frozenset[int] | None]:
    single = all(c.gpus == 1 for c in (*pod.containers, *pod.init_containers))
    out: list[frozenset[int] | None] = []
    if single and pod.containers:
        out.extend(frozenset({g.index}) for g in node.gpus)
    out.append(None)
    return out


def _on_node(
    node: Node,
    pre: Preemptor,
    candidates: list[Victim],
    pods: Mapping[str, Victim],
    allowed: Mapping[str, int],
    rank: GpuRank,
) -> Choice | None:
    pod = pre.pod
    size: dict[str, int] = {}
    for g in node.gpus:
        for k, (mem, _) in g.holders.items():
            size[k] = size.get(k, 0) + mem
    best: Choice | None = None
    for scope in _scopes(node, pod):
        scoped = _scoped(node, scope)
        on = [v for v in candidates if scope is None or any(v.key in node.gpus[i].holders for i in scope)]
        if not on:
            continue
        on.sort(key=lambda v: _keep_first(v, allowed, size.get(v.key, 0)))
        got = _reprieve(scoped, pod, on, pods, rank)
        if got is None:
            continue
        chosen, f = got
        if scope is not None:
            # minimal over the whole node too: a victim the pod could spare by using another GPU
            again = _reprieve(node, pod, chosen, pods, rank)
            if again is None:
                continue
            chosen, f = again
        c = Choice(node.name, tuple(v.key for v in chosen), f, budget_violations(chosen, allowed))
        if best is None or _order_key(c, pods) < _order_key(best, pods):
            best = c
    return best


def choose(
    nodes: Iterable[Node],
    pre: Preemptor,
    pods: Mapping[str, Victim],
    allowed: Mapping[str, int] | None = None,
    rank: GpuRank = tightest,
) -> Choice | None:
    """Where and whom to evict so that `pre` fits; None when no eviction the rules allow helps.

    `pods`: the running pods that may be evicted, by holder key (pods missing from it, already
    terminating or picked for another preemptor, stay where they are). `allowed`: per budget name,
    the disruptions it allows now (a budget missing from it allows none). A node where the pod
    fits as it is gives a Choice with no victims: nothing needs evicting.
    """
    budgets = dict(allowed or {})
    nodes = list(nodes)
    for n in nodes:
        f = _fits(n, pre.pod, rank)
        if f is not None:
            return Choice(n.name, (), f, 0)
    if not pre.may_preempt:
        return None
    eligible = {k: v for k, v in pods.items() if may_evict(pre, v)}
    # first without the pods an exhausted budget protects; only if that finds nothing, with them
    unprotected = {k: v for k, v in eligible.items() if all(budgets.get(b, 0) > 0 for b in v.budgets)}
    for pool in (unprotected, eligible):
        best: Choice | None = None
        for n in nodes:
            on = {k for g in n.gpus for k in g.holders}
            cands = [pool[k] for k in sorted(on) if k in pool]
            if not cands:
                continue
            c = _on_node(n, pre, cands, pods, budgets, rank)
            if c is not None and (best is None or _order_key(c, pods) < _order_key(best, pods)):
                best = c
        if best is not None:
            return best
        if len(unprotected) == len(eligible):
            break
    return None
