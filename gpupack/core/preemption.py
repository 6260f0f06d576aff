"""Which pods to evict so that a pending pod fits: GPU-aware preemption's victim chooser.

Kubernetes' rules first: a pod evicts only pods of strictly lower priority, never when its
preemptionPolicy is Never, and never a pod of the system priority classes (value >= 1e9). Within
them the fit rules decide (gpupack.core.fit): per GPU share, online and offline never on one GPU
(so freeing a GPU for an online pod means every offline pod on it goes), whole GPUs, multi-GPU
pods and init containers as fit counts them; the node's host CPU and memory (when its Node tracks
them) and its pod slots (when the caller gives them) too, so pods holding no GPU can be victims,
and a pod needing no GPU can be the preemptor.

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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupack.contract import CLASS_OFFLINE
from gpupack.core.fit import Fit, FitFailure, GpuRank, fit, host_fit, tightest
from gpupack.core.model import FULL, Node, PodRequest

# A policy's refusal of a fit it found (Policy.refuses): the reason, or None to take it.
Admit = Callable[[Node, PodRequest], FitFailure | None]

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
    node: str = ""  # where it runs: how a pod that holds no GPU is found on its node


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


def _fits(node: Node, pod: PodRequest, rank: GpuRank, admit: Admit | None = None) -> Fit | None:
    f = host_fit(node, pod) if not node.gpus and not pod.needs_gpu else fit(node, pod, rank)
    if not isinstance(f, Fit):
        return None
    # the policy's own refusals of a fit (a CPU-only pod stranding GPUs): an eviction that leaves
    # the pod refused there would be for nothing
    return f if admit is None or admit(node, pod) is None else None


def _host_short(node: Node, pod: PodRequest, slots_short: int) -> bool:
    """Whether the node lacks host room for the pod as it is: victims that hold no GPU the pod
    will use may then be needed too."""
    return (
        slots_short > 0
        or bool(node.cpu_milli and pod.cpu_milli > node.free_cpu)
        or bool(node.ram_mib and pod.ram_mib > node.free_ram)
    )


def _reprieve(
    node: Node,
    pod: PodRequest,
    victims: list[Victim],
    pods: Mapping[str, Victim],
    rank: GpuRank,
    slots_short: int = 0,
    admit: Admit | None = None,
) -> tuple[list[Victim], Fit] | None:
    """Give victims back while the pod still fits, until none can be; None if it never fits.
    `slots_short`: pod slots the node lacks for it (each victim frees one)."""
    chosen = list(victims)
    if len(chosen) < slots_short:
        return None
    best = _fits(without(node, (v.key for v in chosen), pods), pod, rank, admit)
    if best is None:
        return None
    changed = True
    while changed:  # a second round proves minimality: no victim of the final set can be spared
        changed = False
        for v in list(chosen):
            if len(chosen) <= slots_short:
                break
            rest = [x for x in chosen if x is not v]
            f = _fits(without(node, (x.key for x in rest), pods), pod, rank, admit)
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


def _one_gpu(pod: PodRequest) -> bool:
    """The pod uses one GPU at any time: its victims on other GPUs can only free host room."""
    return pod.gpu_slots == 1 and len(pod.containers) + len(pod.init_containers) >= 1


def _on_node(
    node: Node,
    pre: Preemptor,
    candidates: list[Victim],
    pods: Mapping[str, Victim],
    allowed: Mapping[str, int],
    rank: GpuRank,
    slots_short: int = 0,
    admit: Admit | None = None,
) -> Choice | None:
    pod = pre.pod
    size: dict[str, int] = {}
    for g in node.gpus:
        for k, (mem, _) in g.holders.items():
            size[k] = size.get(k, 0) + mem
    # With host room to spare, a pod on one GPU needs victims on that GPU only, and the per-GPU
    # scopes have tried each: the whole-node scope (quadratic in the node's pods) cannot do better.
    per_gpu_enough = _one_gpu(pod) and not _host_short(node, pod, slots_short)
    best: Choice | None = None
    for scope in _scopes(node, pod):
        if scope is None and per_gpu_enough and best is not None:
            break
        scoped = _scoped(node, scope)
        on = [v for v in candidates if scope is None or any(v.key in node.gpus[i].holders for i in scope)]
        if not on:
            continue
        on.sort(key=lambda v: _keep_first(v, allowed, size.get(v.key, 0)))
        got = _reprieve(scoped, pod, on, pods, rank, slots_short, admit)
        if got is None:
            continue
        chosen, f = got
        if scope is not None and not per_gpu_enough:
            # minimal over the whole node too: a victim the pod could spare by using another GPU
            # (with host room and one GPU, none: the pod would then fit as it is, which choose
            # has ruled out)
            again = _reprieve(node, pod, chosen, pods, rank, slots_short, admit)
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
    pod_room: Mapping[str, int] | None = None,
    memo: dict[Any, Any] | None = None,
    admit: Admit | None = None,
) -> Choice | None:
    """Where and whom to evict so that `pre` fits; None when no eviction the rules allow helps.

    `pods`: the running pods that may be evicted, by holder key (pods missing from it, already
    terminating or picked for another preemptor, stay where they are); a pod holding no GPU is
    found on its node by `Victim.node`. `allowed`: per budget name, the disruptions it allows now
    (a budget missing from it allows none). `pod_room`: per node, the pods it can still take (its
    allocatable pods less those on it); a node missing from it is not limited. A node where the
    pod fits as it is gives a Choice with no victims: nothing needs evicting.

    `memo`: a dict the caller keeps across calls over the same Node objects (one controller
    pass): a node's answer for a pod of the same shape and priority, with the same candidates
    and budgets, is reused. Replace a Node object to change it; never mutate one in place.

    `admit`: the policy's refusal of a fit (`Policy.refuses`), if it has one: a node is chosen
    only where the pod, its victims gone, both fits and is not refused.
    """
    budgets = dict(allowed or {})
    nodes = list(nodes)
    room = dict(pod_room or {})

    def short(n: Node) -> int:
        return max(0, 1 - room[n.name]) if n.name in room else 0

    for n in nodes:
        if short(n):
            continue
        f = _fits(n, pre.pod, rank, admit)
        if f is not None:
            return Choice(n.name, (), f, 0)
    if not pre.may_preempt:
        return None
    eligible = {k: v for k, v in pods.items() if may_evict(pre, v)}
    # first without the pods an exhausted budget protects; only if that finds nothing, with them
    unprotected = {k: v for k, v in eligible.items() if all(budgets.get(b, 0) > 0 for b in v.budgets)}
    hostonly: dict[str, set[str]] = {}
    for k, v in eligible.items():
        if v.node:
            hostonly.setdefault(v.node, set()).add(k)
    for pool in (unprotected, eligible):
        best: Choice | None = None
        for n in nodes:
            on = {k for g in n.gpus for k in g.holders} | hostonly.get(n.name, set())
            cands = [pool[k] for k in sorted(on) if k in pool]
            if not cands:
                continue
            if memo is None:
                c = _on_node(n, pre, cands, pods, budgets, rank, short(n), admit)
            else:
                c = _remembered(memo, n, pre, cands, pods, budgets, rank, short(n), admit)
            if c is not None and (best is None or _order_key(c, pods) < _order_key(best, pods)):
                best = c
        if best is not None:
            return best
        if len(unprotected) == len(eligible):
            break
    return None


def _remembered(
    memo: dict[Any, Any],
    node: Node,
    pre: Preemptor,
    cands: list[Victim],
    pods: Mapping[str, Victim],
    allowed: Mapping[str, int],
    rank: GpuRank,
    slots_short: int,
    admit: Admit | None = None,
) -> Choice | None:
    # Preemptors of one Deployment ask the same question of every unchanged node; the answer
    # depends only on the node, the pod's shape and priority, the candidates and their budgets.
    # Keyed by id(node) with the node kept in the value, so a reused id never matches.
    pod = pre.pod
    shape = (pod.pod_class, pod.containers, pod.init_containers, pod.cpu_milli, pod.ram_mib, pod.gpu_models)
    key = (
        id(node),
        shape,
        pre.priority,
        slots_short,
        tuple((v, tuple(allowed.get(b, 0) for b in v.budgets)) for v in cands),
    )
    hit = memo.get(key)
    if hit is not None and hit[0] is node:
        return hit[1]  # type: ignore[no-any-return]
    c = _on_node(node, pre, cands, pods, allowed, rank, slots_short, admit)
    memo[key] = (node, c)
    return c
