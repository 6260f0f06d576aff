"""Defragmentation planner: which pods to move, and where, so that whole GPUs become free.

Pure: it reads a :class:`ClusterState`, works on a clone, and returns a :class:`Plan` whose every
move was replayed on a second clone through :meth:`ClusterState.place` (which re-checks over-commit,
class separation and exclusivity) plus a GPU-model check, before the plan is handed out.

How it chooses (greedy, deterministic):
- A *drain group* is one used, shared GPU ``g`` together with every pod holding it (``S``). Moving
  all of ``S`` frees ``g`` and every other GPU whose holders all lie in ``S`` (a two-GPU pod that is
  alone on both frees two GPUs with one eviction).
- Groups are ranked by evictions per GPU freed (fewest first), then by whether the drain leaves the
  node with no used GPU at all (whole nodes second), then by how little is on the GPUs (cheapest
  move), then by node name and GPU position (determinism). Rankings are re-checked lazily, because
  earlier moves change the GPUs around a group.
- A moved pod may only land on a GPU that is *already in use* and not being freed, so every group
  lowers the count of used GPUs by exactly the GPUs it frees; idle GPUs are never a target. Among
  the fitting places the tightest one wins (least room left on the chosen GPUs), so holes shrink.
- A group whose pods do not all find a place is skipped whole: a plan never evicts a pod that has
  no verified new place, and never moves half a group (that would evict without freeing a GPU).
- Pods holding a GPU exclusively never move (they need an idle GPU, so moving them frees nothing);
  a pod moves at most once per plan.

Units as in :mod:`gpupack.core.model`: compute in milli of one GPU, memory in MiB.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpupack.core.fit import Fit, fit
from gpupack.core.model import (
    FULL,
    GPU,
    Charged,
    ClusterState,
    Holding,
    Node,
    Placement,
    PlacementError,
    PodRequest,
)


@dataclass(frozen=True)
class Limits:
    """Caps one plan respects. Zero or negative disables a per-scope cap."""

    max_evictions: int = 10
    max_per_node: int = 4  # evictions whose pod runs on one node
    max_per_namespace: int = 5
    # Share of a workload's (namespace + controlling owner) current pods one run may move. A
    # workload always gets at least one move, so single-replica offline work can be repacked;
    # keep online pods out with the eligibility filter instead.
    max_workload_share: float = 0.25
    # Search budget: drain groups tried (failed attempts included). Bounds plan time on huge,
    # tightly packed clusters where almost nothing can move.
    max_attempts: int = 20000


@dataclass(frozen=True)
class Move:
    step: int  # position in the plan; the executor runs moves in this order
    group: int  # drain group this move belongs to
    pod: str  # namespace/name
    namespace: str
    owner_kind: str
    owner_name: str
    pod_class: str
    from_node: str
    from_gpus: tuple[str, ...]  # GPU uuids the pod held
    to_node: str
    to_gpus: tuple[str, ...]  # GPU uuids the replacement will hold
    placement: Placement  # per container shares (indices are positions in the target node's GPUs)
    charged: dict[int, tuple[int, int, bool]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "group": self.group,
            "pod": self.pod,
            "namespace": self.namespace,
            "owner": f"{self.owner_kind}/{self.owner_name}" if self.owner_kind else "",
            "class": self.pod_class,
            "from_node": self.from_node,
            "from_gpus": list(self.from_gpus),
            "to_node": self.to_node,
            "to_gpus": list(self.to_gpus),
            "containers": {
                c: [{"gpu": s.gpu_index, "mem_mib": s.mem_mib, "milli": s.milli} for s in shares]
                for c, shares in self.placement.containers.items()
            },
        }


@dataclass(frozen=True)
class Group:
    """One drain: the pods moved together and the GPUs that become idle once they all moved."""

    id: int
    node: str
    gpus_freed: tuple[str, ...]  # uuids
    pods: tuple[str, ...]
    node_freed: bool  # the node has no used GPU left after this drain


@dataclass
class Plan:
    moves: list[Move] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    used_gpus_before: int = 0
    used_gpus_after: int = 0
    nodes_freed: list[str] = field(default_factory=list)
    attempts: int = 0  # drain groups tried
    skipped: Counter[str] = field(default_factory=Counter)  # why groups were passed over -> count

    @property
    def evictions(self) -> int:
        return len(self.moves)

    @property
    def gpus_freed(self) -> int:
        return sum(len(g.gpus_freed) for g in self.groups)

    @property
    def gpus_per_eviction(self) -> float:
        return self.gpus_freed / self.evictions if self.evictions else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "evictions": self.evictions,
            "gpus_freed": self.gpus_freed,
            "nodes_freed": list(self.nodes_freed),
            "gpus_per_eviction": round(self.gpus_per_eviction, 4),
            "used_gpus_before": self.used_gpus_before,
            "used_gpus_after": self.used_gpus_after,
            "attempts": self.attempts,
            "skipped": dict(sorted(self.skipped.items())),
            "groups": [
                {
                    "group": g.id,
                    "node": g.node,
                    "gpus_freed": list(g.gpus_freed),
                    "pods": list(g.pods),
                    "node_freed": g.node_freed,
                }
                for g in self.groups
            ],
            "moves": [m.to_dict() for m in self.moves],
        }


class PlanError(RuntimeError):
    """A plan failed its replay: a bug, never expected; nothing may be evicted on such a plan."""


def used_gpus(state: ClusterState) -> int:
    return sum(1 for n in state.nodes.values() for g in n.gpus if not g.empty)


def _pod_node_gpus(state: ClusterState, key: str) -> tuple[Node, list[int]]:
    _, placement, charged = state.pods[key]
    return state.nodes[placement.node], sorted(charged)


def _movable_shape(pod: PodRequest, charged: dict[int, tuple[int, int, bool]]) -> bool:
    return bool(pod.containers) and not any(ex for _, _, ex in charged.values())


def workload_of(pod: PodRequest) -> tuple[str, str, str] | None:
    if pod.owner is None:
        return None
    return (pod.namespace, pod.owner[0], pod.owner[1])


class _Caps:
    """The safety caps (`Limits`) both planners apply to a group of evictions, and what the plan
    has used of them so far."""

    def __init__(self, limits: Limits, state: ClusterState) -> None:
        self.limits = limits
        self.per_node: Counter[str] = Counter()
        self.per_ns: Counter[str] = Counter()
        self.per_workload: Counter[tuple[str, str, str]] = Counter()
        self.replicas: Counter[tuple[str, str, str]] = Counter(
            wl for pod, _, _ in state.pods.values() if (wl := workload_of(pod)) is not None
        )

    def refuse(self, pods: list[PodRequest], node: str, evictions: int) -> str | None:
        """Why evicting `pods` from `node` would pass a cap (after `evictions` already planned), or None."""
        lim = self.limits
        if evictions + len(pods) > lim.max_evictions:
            return "cap:run"
        if lim.max_per_node > 0 and self.per_node[node] + len(pods) > lim.max_per_node:
            return "cap:node"
        if lim.max_per_namespace > 0:
            for ns, n in Counter(p.namespace for p in pods).items():
                if self.per_ns[ns] + n > lim.max_per_namespace:
                    return "cap:namespace"
        if lim.max_workload_share > 0:
            for wl, n in Counter(workload_of(p) for p in pods).items():
                if wl is None:
                    continue
                allowed = max(1, math.floor(lim.max_workload_share * self.replicas[wl]))
                if self.per_workload[wl] + n > allowed:
                    return "cap:workload"
        return None

    def record(self, pod: PodRequest, node: str) -> None:
        self.per_node[node] += 1
        self.per_ns[pod.namespace] += 1
        wl = workload_of(pod)
        if wl is not None:
            self.per_workload[wl] += 1


class _Planner:
    def __init__(
        self,
        state: ClusterState,
        movable: set[str],
        limits: Limits,
        order: str,
    ) -> None:
        self.orig = state
        self.w = state.clone()
        self.limits = limits
        self.order = order
        self.movable = {k for k in movable if k in state.pods}
        self.moved: set[str] = set()
        self.node_names = sorted(self.w.nodes)
        # Idle and unhealthy GPUs are never a target: marking them unhealthy in the private clone
        # makes fit() skip them. GPUs freed by the plan join this set.
        self.blocked: set[tuple[str, int]] = set()
        self.health: dict[tuple[str, int], bool] = {}
        # class -> GPUs that can take a moved pod: in use by that class, shared, not blocked.
        self.open: dict[str, set[tuple[str, int]]] = {}
        self.by_room: dict[tuple[str, int], list[tuple[float, str, int]]] = {}
        self.where: dict[tuple[str, int], tuple[str, int, tuple[float, str, int]]] = {}
        for name in self.node_names:
            for i, g in enumerate(self.w.nodes[name].gpus):
                self.health[(name, i)] = g.healthy
                if g.empty or not g.healthy:
                    self._block(name, i)
                else:
                    self._refresh(name, i)
        self.caps = _Caps(self.limits, state)
        self.plan = Plan(used_gpus_before=used_gpus(state))

    # --- blocking ---------------------------------------------------------------------------
    def _block(self, node: str, idx: int) -> None:
        self.blocked.add((node, idx))
        self.w.nodes[node].gpus[idx].healthy = False
        self._refresh(node, idx)

    def _unblock(self, node: str, idx: int) -> None:
        self.blocked.discard((node, idx))
        self.w.nodes[node].gpus[idx].healthy = self.health[(node, idx)]
        self._refresh(node, idx)

    def _refresh(self, node: str, idx: int) -> None:
        g = self.w.nodes[node].gpus[idx]
        old = self.where.pop((node, idx), None)
        if old is not None:
            cls, size, entry = old
            self.open[cls].discard((node, idx))
            lst = self.by_room[(cls, size)]
            del lst[bisect.bisect_left(lst, entry)]
        if g.healthy and not g.exclusive and g.pod_class is not None:
            self.open.setdefault(g.pod_class, set()).add((node, idx))
            # Room left as one number; for GPUs of one memory size, ascending room is ascending
            # "room left after placing", the tightest-fit measure, whatever the request.
            entry = ((g.mem_mib - g.mem_used) / g.mem_mib + (FULL - g.milli_used) / FULL, node, idx)
            bisect.insort(self.by_room.setdefault((g.pod_class, g.mem_mib), []), entry)
            self.where[(node, idx)] = (g.pod_class, g.mem_mib, entry)

    def _place(self, pod: PodRequest, placement: Placement, charged: Charged) -> None:
        self.w.place(pod, placement, charged)
        for i in charged:
            self._refresh(placement.node, i)

    def _release(self, key: str) -> None:
        _, placement, charged = self.w.pods[key]
        self.w.release(key)
        for i in charged:
            self._refresh(placement.node, i)

    # --- groups -------------------------------------------------------------------------------
    def group_of(self, node: Node, idx: int) -> tuple[list[str], list[int]] | None:
        """Pods to move to free GPU `idx` of `node` and the GPUs that frees; None if it cannot move."""
        g = node.gpus[idx]
        if g.empty or g.exclusive or (node.name, idx) in self.blocked:
            return None
        pods = sorted(g.holders)
        for k in pods:
            if k not in self.movable or k in self.moved:
                return None
        pod_set = set(pods)
        freed = []
        touched: set[int] = set()
        for k in pods:
            touched.update(self.w.pods[k][2])
        for i in sorted(touched):
            if set(node.gpus[i].holders) <= pod_set:
                freed.append(i)
        return pods, freed

    def key_of(self, node: Node, idx: int, pods: list[str], freed: list[int]) -> tuple[Any, ...]:
        g = node.gpus[idx]
        if self.order == "emptiest":
            return (g.milli_used / FULL + g.mem_used / max(1, g.mem_mib), node.name, idx)
        freed_set = set(freed)
        node_empties = all(gg.empty or i in freed_set for i, gg in enumerate(node.gpus))
        load = sum(
            node.gpus[i].milli_used / FULL + node.gpus[i].mem_used / max(1, node.gpus[i].mem_mib)
            for i in freed
        )
        used_on_node = sum(1 for gg in node.gpus if not gg.empty)
        return (len(pods) / len(freed), not node_empties, used_on_node, load, node.name, idx)

    def caps_allow(self, pods: list[str], node: str) -> str | None:
        return self.caps.refuse([self.w.pods[k][0] for k in pods], node, self.plan.evictions)

    # --- placing ------------------------------------------------------------------------------
    def find_target(self, pod: PodRequest) -> Fit | None:
        """Tightest fitting place on GPUs already in use; ties by node name (determinism)."""
        cls = pod.pod_class
        need_mem = min((c.mem_mib or 0) for c in pod.containers)
        need_milli = min((c.milli or 0) for c in pod.containers)
        need_gpus = max(c.gpus for c in pod.containers)
        models = pod.gpu_models
        # One container, no init containers: its k tightest GPUs on a node are exactly what fit()
        # picks there (same measure as its in-node rank), so nodes can be ranked before fitting
        # and the first that fits is the tightest. Otherwise every candidate node is fitted.
        simple = len(pod.containers) == 1 and not pod.init_containers
        if simple and need_gpus == 1:
            f = self._find_one(pod, need_mem, need_milli)
            if f is not None:
                return f
        elif simple and need_gpus == 2:
            groups = [key for key in self.by_room if key[0] == cls]
            if len(groups) == 1:
                f = self._find_two(pod, groups[0], need_mem, need_milli)
                if f is not None:
                    return f
        per_node: dict[str, list[float]] = {}
        nodes = self.w.nodes
        for name, i in self.open.get(cls, ()):
            g = nodes[name].gpus[i]
            fm = g.mem_mib - g.mem_used
            fk = FULL - g.milli_used
            if fm < need_mem or fk < need_milli or (models is not None and g.model not in models):
                continue
            per_node.setdefault(name, []).append((fm - need_mem) / g.mem_mib + (fk - need_milli) / FULL)
        ranked: list[tuple[float, str]] = []
        for name, lefts in per_node.items():
            if len(lefts) >= need_gpus:
                if simple:
                    lefts.sort()
                    ranked.append((sum(lefts[:need_gpus]), name))
                else:
                    ranked.append((0.0, name))
        ranked.sort()
        best_key: tuple[float, str] | None = None
        best_fit: Fit | None = None
        for _bound, name in ranked:
            if simple and best_fit is not None:
                break  # exact ranking: the first node that fits is the tightest
            node = self.w.nodes[name]
            got = fit(node, pod)
            if not isinstance(got, Fit):
                continue
            left = 0.0
            for i, (mem, milli, _) in got.charged.items():
                g = node.gpus[i]
                left += (g.free_mem - mem) / max(1, g.mem_mib) + (g.free_milli - milli) / FULL
            k = (left, name)
            if best_key is None or k < best_key:
                best_key, best_fit = k, got
        return best_fit

    def _find_one(self, pod: PodRequest, need_mem: int, need_milli: int) -> Fit | None:
        """One shared GPU: walk each memory size's GPUs from least room up; first fit is tightest."""
        models = pod.gpu_models
        best: tuple[float, str, int] | None = None
        for (cls, size), lst in self.by_room.items():
            if cls != pod.pod_class:
                continue
            nodes = self.w.nodes
            for room, name, i in lst:
                g = nodes[name].gpus[i]
                if g.mem_mib - g.mem_used < need_mem or FULL - g.milli_used < need_milli:
                    continue
                if models is not None and g.model not in models:
                    continue
                cand = (room - need_mem / size - need_milli / FULL, name, i)
                if best is None or cand < best:
                    best = cand
                break
        if best is None:
            return None
        f = fit(self.w.nodes[best[1]], pod)
        # A node-level limit (CPU, RAM) can refuse; the caller then falls back to the full scan.
        return f if isinstance(f, Fit) else None

    def _find_two(
        self, pod: PodRequest, group: tuple[str, int], need_mem: int, need_milli: int
    ) -> Fit | None:
        """Two GPUs of one memory size on one node, least total room first, without a full scan.

        Walking GPUs by ascending room, a node's first two qualifying GPUs are its tightest two.
        The walk stops once no node can beat the best complete pair: an unseen node needs two
        GPUs with at least the current room, a half-seen one a second GPU with at least it.
        """
        models = pod.gpu_models
        nodes = self.w.nodes
        first: dict[str, float] = {}
        firsts: list[tuple[float, str]] = []  # min-heap of half-seen nodes' first room (lazy)
        best: tuple[float, str] | None = None
        for room, name, i in self.by_room[group]:
            if best is not None and 2 * room >= best[0]:
                while firsts and firsts[0][1] not in first:
                    heapq.heappop(firsts)
                if not firsts or firsts[0][0] + room >= best[0]:
                    break
            g = nodes[name].gpus[i]
            if g.mem_mib - g.mem_used < need_mem or FULL - g.milli_used < need_milli:
                continue
            if models is not None and g.model not in models:
                continue
            r0 = first.pop(name, None)
            if r0 is None:
                first[name] = room
                heapq.heappush(firsts, (room, name))
                continue
            cand = (r0 + room, name)
            if best is None or cand < best:
                best = cand
        if best is None:
            return None
        f = fit(nodes[best[1]], pod)
        return f if isinstance(f, Fit) else None

    def try_group(self, node: Node, pods: list[str], freed: list[int]) -> list[tuple[str, Fit]] | None:
        for i in freed:
            self._block(node.name, i)
        originals = {k: self.w.pods[k] for k in pods}
        done: list[tuple[str, Fit]] = []
        # Biggest first: it is the one most likely to find no room.
        order = sorted(pods, key=lambda k: (-sum(m for m, _, _ in originals[k][2].values()), k))
        ok = True
        for k in order:
            pod, _, charged = originals[k]
            self._release(k)
            # Its own other GPUs are no target either: landing where it was is not a move.
            own = [i for i in charged if (node.name, i) not in self.blocked]
            for i in own:
                self._block(node.name, i)
            f = self.find_target(pod)
            for i in own:
                self._unblock(node.name, i)
            if f is None:
                ok = False
                self._place(pod, originals[k][1], charged)
                break
            self._place(pod, f.placement, f.charged)
            done.append((k, f))
        if ok:
            return done
        for k, _ in done:
            self._release(k)
        for k, _ in done:
            self._place(originals[k][0], originals[k][1], originals[k][2])
        for i in freed:
            self._unblock(node.name, i)
        return None

    def commit(
        self,
        node: Node,
        pods: list[str],
        freed: list[int],
        done: list[tuple[str, Fit]],
        originals: dict[str, Holding],
    ) -> None:
        gid = len(self.plan.groups)
        for k, f in done:
            pod, placement, charged = originals[k]
            src = self.orig.nodes[placement.node]
            dst = self.w.nodes[f.placement.node]
            self.plan.moves.append(_move(len(self.plan.moves), gid, k, originals[k], src, f, dst))
            self.moved.add(k)
            self.caps.record(pod, placement.node)
        node_freed = all(g.empty for g in node.gpus)
        self.plan.groups.append(
            Group(
                gid, node.name, tuple(node.gpus[i].uuid for i in freed), tuple(k for k, _ in done), node_freed
            )
        )

    # --- main loop ----------------------------------------------------------------------------
    def run(self) -> Plan:
        heap: list[tuple[tuple[Any, ...], str, int]] = []
        for name in self.node_names:
            node = self.w.nodes[name]
            for i in range(len(node.gpus)):
                grp = self.group_of(node, i)
                if grp is None:
                    continue
                heap.append((self.key_of(node, i, *grp), name, i))
        heapq.heapify(heap)
        dead: set[tuple[str, int]] = set()
        while heap and self.plan.attempts < self.limits.max_attempts:
            if self.plan.evictions >= self.limits.max_evictions:
                break
            key, name, i = heapq.heappop(heap)
            if (name, i) in dead:
                continue
            node = self.w.nodes[name]
            grp = self.group_of(node, i)
            if grp is None:
                continue
            pods, freed = grp
            fresh = self.key_of(node, i, pods, freed)
            if fresh != key:
                heapq.heappush(heap, (fresh, name, i))  # lazy re-ranking
                continue
            why = self.caps_allow(pods, name)
            if why is not None:
                self.plan.skipped[why] += 1
                continue
            self.plan.attempts += 1
            originals = {k: self.w.pods[k] for k in pods}
            done = self.try_group(node, pods, freed)
            if done is None:
                # Moves only fill targets further and freed GPUs stay blocked, so a group that
                # found no room now finds none later: drop it.
                self.plan.skipped["no-target"] += 1
                dead.add((name, i))
                continue
            self.commit(node, pods, freed, done, originals)
        final = _verified(self.orig, self.plan)
        self.plan.nodes_freed = sorted(
            n
            for n, node in final.nodes.items()
            if any(not g.empty for g in self.orig.nodes[n].gpus) and all(g.empty for g in node.gpus)
        )
        if self.plan.used_gpus_before - self.plan.used_gpus_after != self.plan.gpus_freed:
            raise PlanError(
                f"plan frees {self.plan.gpus_freed} GPUs by its groups but the replay shows "
                f"{self.plan.used_gpus_before - self.plan.used_gpus_after}"
            )
        return self.plan


def _movable_keys(
    state: ClusterState, movable: Iterable[str] | Callable[[PodRequest], bool] | None, order: str
) -> set[str]:
    """The keys of the placed pods `movable` allows (pod keys, a predicate, or None: every pod), for
    a planner run in `order`."""
    if order not in ("ratio", "emptiest"):
        raise ValueError(f"unknown order {order!r}")
    if movable is None:
        return set(state.pods)
    if callable(movable):
        return {k for k, (p, _, _) in state.pods.items() if movable(p)}
    return {k for k in movable if k in state.pods}


def _verified(orig: ClusterState, plan: Plan) -> ClusterState:
    """Replay `plan` on the nodes it touches (verify_plan) and set its `used_gpus_after`; the
    replayed nodes."""
    final = verify_plan(orig, plan, touched_only=True)
    touched_before = sum(1 for n in final.nodes for g in orig.nodes[n].gpus if not g.empty)
    plan.used_gpus_after = plan.used_gpus_before - touched_before + used_gpus(final)
    return final


def plan_defrag(
    state: ClusterState,
    movable: Iterable[str] | Callable[[PodRequest], bool] | None = None,
    limits: Limits | None = None,
    order: str = "ratio",
) -> Plan:
    """Plan moves that free whole GPUs. `movable`: pod keys (or a predicate) allowed to move;
    None means every pod. `order="emptiest"` is the simple baseline (drain the emptiest GPUs
    first) kept for the benchmark."""
    keys = _movable_keys(state, movable, order)
    keys = {k for k in keys if _movable_shape(state.pods[k][0], state.pods[k][2])}
    return _Planner(state, keys, limits or Limits(), order).run()


def plan_baseline(
    state: ClusterState,
    movable: Iterable[str] | Callable[[PodRequest], bool] | None = None,
    limits: Limits | None = None,
) -> Plan:
    """The simple baseline: evict from the emptiest GPUs first (same targets, same caps)."""
    return plan_defrag(state, movable, limits, order="emptiest")


def verify_plan(state: ClusterState, plan: Plan, touched_only: bool = False) -> ClusterState:
    """Replay `plan` on a clone of `state`, move by move in execution order; return the result.

    Raises :class:`PlanError` when a move does not start where the plan says, would break an
    invariant (over-commit, class mix, exclusivity, GPU model) or a group's GPUs are not idle after.
    `touched_only`: clone only the nodes the plan moves pods from or to (the result then holds
    just those nodes and their pods), which is all the replay needs.
    """
    if touched_only:
        touched = {m.from_node for m in plan.moves} | {m.to_node for m in plan.moves}
        s = ClusterState(
            {n: state.nodes[n].copy() for n in sorted(touched) if n in state.nodes},
            {k: v for k, v in state.pods.items() if v[1].node in touched},
        )
    else:
        s = state.clone()
    for m in plan.moves:
        entry = s.pods.get(m.pod)
        if entry is None:
            raise PlanError(f"move {m.step}: pod {m.pod} is not in the cluster state")
        pod, placement, _ = entry
        if placement.node != m.from_node:
            raise PlanError(f"move {m.step}: pod {m.pod} runs on {placement.node}, not {m.from_node}")
        dst = s.nodes.get(m.to_node)
        if dst is None:
            raise PlanError(f"move {m.step}: unknown target node {m.to_node}")
        for i in m.charged:
            g: GPU = dst.gpus[i]
            if pod.gpu_models is not None and g.model not in pod.gpu_models:
                raise PlanError(f"move {m.step}: GPU model {g.model} not allowed for {m.pod}")
            if not g.healthy:
                raise PlanError(f"move {m.step}: target GPU {g.uuid} is unhealthy")
        s.release(m.pod)
        try:
            s.place(pod, m.placement, m.charged)
        except PlacementError as e:
            raise PlanError(f"move {m.step}: {e}") from e
    for grp in plan.groups:
        node = s.nodes[grp.node]
        for uuid in grp.gpus_freed:
            freed_gpu = node.gpu(uuid)
            if freed_gpu is None or not freed_gpu.empty:
                raise PlanError(f"group {grp.id}: GPU {uuid} on {grp.node} is not idle after the plan")
    return s


# --- objective "nodes": empty whole GPU nodes ---------------------------------------------------


def _node_load(node: Node) -> float:
    return sum(g.milli_used / FULL + g.mem_used / max(1, g.mem_mib) for g in node.gpus)


def _used_gpus_on(node: Node) -> int:
    return sum(1 for g in node.gpus if not g.empty)


def _move(step: int, group: int, key: str, original: Holding, src: Node, f: Fit, dst: Node) -> Move:
    """The plan's record of moving pod `key` from where it is held (`original`, on `src`) to `f` on `dst`."""
    pod, placement, charged = original
    return Move(
        step=step,
        group=group,
        pod=key,
        namespace=pod.namespace,
        owner_kind=pod.owner[0] if pod.owner else "",
        owner_name=pod.owner[1] if pod.owner else "",
        pod_class=pod.pod_class,
        from_node=placement.node,
        from_gpus=tuple(src.gpus[i].uuid for i in sorted(charged)),
        to_node=f.placement.node,
        to_gpus=tuple(dst.gpus[i].uuid for i in sorted(f.charged)),
        placement=f.placement,
        charged=dict(f.charged),
    )


class _NodePlanner:
    """Empty whole nodes, cheapest first; every pod of a drained node lands on a node that stays.

    - A node can be drained when every pod on it may move (exclusive pods too: they may take an
      idle GPU of a node that stays, which costs no extra node) and it is not `protected` (for
      example annotated for the cluster autoscaler never to remove it: emptying it gains nothing).
    - Cost of a node: its pods (evictions), then the load on its GPUs, then its name. `order=
      "ratio"` (gpupack) drains in ascending cost; `order="emptiest"` (the baseline) in ascending
      GPU utilisation, the measure a resource-utilisation autoscaler uses.
    - Targets: only nodes that keep running (hold a used GPU at planning time, are not drained,
      are schedulable, are not the pod's own node). gpupack picks, per pod, a used GPU before an
      idle one, the busiest node first, then the tightest place; the baseline takes the first
      node by name where the pod fits (what a drain followed by a default scheduler would do).
    - A node that received a moved pod is kept: no pod moves twice in one plan.
    - All or nothing per node: a node whose pods do not all find a verified place stays as is.
    """

    def __init__(
        self, state: ClusterState, movable: set[str], limits: Limits, order: str, protected: set[str]
    ) -> None:
        self.orig = state
        self.w = state.clone()
        self.movable = movable
        self.limits = limits
        self.order = order
        self.protected = protected
        self.plan = Plan(used_gpus_before=used_gpus(state))
        self.drained: set[str] = set()
        self.kept: set[str] = set()
        self.caps = _Caps(limits, state)
        self.pods_on: dict[str, list[str]] = {}
        for k, (_, placement, _) in state.pods.items():
            self.pods_on.setdefault(placement.node, []).append(k)

    def cost(self, name: str) -> tuple[Any, ...]:
        node = self.w.nodes[name]
        pods = len(self.pods_on.get(name, ()))
        if self.order == "emptiest":
            cap = max(1, len(node.gpus))
            return (_node_load(node) / (2 * cap), pods, name)
        return (pods, _node_load(node), name)

    def candidates(self) -> list[str]:
        out = []
        for name, node in self.w.nodes.items():
            if not node.gpus or _used_gpus_on(node) == 0:
                continue
            if name in self.protected:
                self.plan.skipped["protected"] += 1
                continue
            pods = self.pods_on.get(name, [])
            if any(k not in self.movable for k in pods):
                self.plan.skipped["not-movable"] += 1
                continue
            out.append(name)
        return sorted(out, key=self.cost)

    def targets(self, source: str) -> list[Node]:
        nodes = [
            n
            for name, n in self.w.nodes.items()
            if name != source
            and name not in self.drained
            and n.schedulable
            and _used_gpus_on(self.orig.nodes[name]) > 0
        ]
        if self.order == "emptiest":
            return sorted(nodes, key=lambda n: n.name)
        return sorted(nodes, key=lambda n: (-_used_gpus_on(n), -_node_load(n), n.name))

    def find(self, pod: PodRequest, source: str) -> Fit | None:
        best: tuple[Any, ...] | None = None
        best_fit: Fit | None = None
        for node in self.targets(source):
            f = fit(node, pod)
            if not isinstance(f, Fit):
                continue
            if self.order == "emptiest":
                return f
            idle = sum(1 for i in f.charged if node.gpus[i].empty)
            left = sum(
                (node.gpus[i].free_mem - m) / max(1, node.gpus[i].mem_mib)
                + (node.gpus[i].free_milli - k) / FULL
                for i, (m, k, _) in f.charged.items()
            )
            key = (idle, -_used_gpus_on(node), left, node.name)
            if best is None or key < best:
                best, best_fit = key, f
        return best_fit

    def try_node(self, name: str) -> list[tuple[str, Fit]] | None:
        pods = sorted(
            self.pods_on.get(name, []),
            key=lambda k: (-sum(m for m, _, _ in self.w.pods[k][2].values()), k),
        )
        originals = {k: self.w.pods[k] for k in pods}
        done: list[tuple[str, Fit]] = []
        self.drained.add(name)
        for k in pods:
            pod = originals[k][0]
            f = self.find(pod, name)
            if f is None:
                break
            self.w.release(k)
            self.w.place(pod, f.placement, f.charged)
            done.append((k, f))
        if len(done) == len(pods):
            return done
        for k, _ in done:
            self.w.release(k)
            self.w.place(originals[k][0], originals[k][1], originals[k][2])
        self.drained.discard(name)
        return None

    def run(self) -> Plan:
        for name in self.candidates():
            if (
                self.plan.attempts >= self.limits.max_attempts
                or self.plan.evictions >= self.limits.max_evictions
            ):
                break
            if name in self.kept:
                self.plan.skipped["kept-as-target"] += 1
                continue
            pods = self.pods_on.get(name, [])
            why = self.caps.refuse([self.w.pods[k][0] for k in pods], name, self.plan.evictions)
            if why is not None:
                self.plan.skipped[why] += 1
                continue
            self.plan.attempts += 1
            node = self.w.nodes[name]
            freed = [i for i, g in enumerate(node.gpus) if not g.empty]
            originals = {k: self.w.pods[k] for k in pods}
            done = self.try_node(name)
            if done is None:
                self.plan.skipped["no-target"] += 1
                continue
            gid = len(self.plan.groups)
            for k, f in done:
                pod, placement, charged = originals[k]
                dst = self.w.nodes[f.placement.node]
                self.kept.add(f.placement.node)
                self.plan.moves.append(_move(len(self.plan.moves), gid, k, originals[k], node, f, dst))
                self.caps.record(pod, placement.node)
            self.plan.groups.append(
                Group(gid, name, tuple(node.gpus[i].uuid for i in freed), tuple(k for k, _ in done), True)
            )
        final = _verified(self.orig, self.plan)
        self.plan.nodes_freed = sorted(g.node for g in self.plan.groups)
        for g in self.plan.groups:
            if any(not gg.empty for gg in final.nodes[g.node].gpus):
                raise PlanError(f"group {g.id}: node {g.node} still holds pods after the plan")
        return self.plan


def plan_nodes(
    state: ClusterState,
    movable: Iterable[str] | Callable[[PodRequest], bool] | None = None,
    limits: Limits | None = None,
    order: str = "ratio",
    protected: Iterable[str] = (),
) -> Plan:
    """Plan moves that empty whole GPU nodes (`gpupack defrag --objective nodes`), so that the
    cluster autoscaler (or an operator) can remove them. Each drain group is one node; its
    `gpus_freed` are every GPU that node had in use. `order="emptiest"`: the baseline (drain the
    least utilised nodes first, first-fit targets). `protected`: nodes never drained."""
    keys = {k for k in _movable_keys(state, movable, order) if state.pods[k][0].containers}
    return _NodePlanner(state, keys, limits or Limits(), order, set(protected)).run()
