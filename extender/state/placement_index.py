"""The placement index: per pod shape, each node's fit (`PlacementIndex`), and the filter answer
built from those fits (`FilterAnswer`), serving filter, prioritize's and keep-best's scores
(scoring.py keeps its scores in the same kind of table), bind's re-check, the shape warmer and the
new-shape sampler.

One rule keeps every entry current: an entry computed for a node holds while the node's version
is the one it was computed at (`VersionedTable`; versions never repeat, journal.Journal), and an
answer over many nodes looks again only at the nodes the view's journal lists as changed since
the position it was last brought to, at the nodes it was not asked about then, and at nodes
holding defrag reservations (whose answer depends on the time) (`AnswerCache.current`). Nodes in
the same state (`PlacementIndex.state`) share one fit. Kept shapes are capped (CACHE_SHAPES);
a deleted node's entries go at once (`PlacementIndex.node_gone`)."""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from gpupack.contract import RES_GPU, Reservation
from gpupack.core.fit import Fit, FitFailure, host_fit
from gpupack.core.model import Node, Placement, PodRequest
from gpupack.core.policies import Policy

from . import reservations as resv
from .hostuse import NO_HOST_USE
from .journal import Journal
from .node_resources import HostedPodRequest, node_resources_fit
from .records import NodeInfo
from .view import ClusterView

log = logging.getLogger("gpupack.extender")
V = TypeVar("V")
# a cache key: a pod shape (shape_of), or a shape and the learning epoch
Key = tuple[Any, ...]
# Pod shapes whose answers are kept. A shape not kept costs a fit of every node at its next filter
# (~300 ms of CPU at 5,000 nodes with 100,000 running pods, which make most nodes' states distinct)
# against ~1 ms kept; a kept shape costs ~5 MiB at that size (benchmarks/bench_view.py), so 64 of
# them up to ~330 MiB. A burst of 40 shapes (two classes, six share sizes, three host sizes)
# through 32 kept missed often enough for filter p99 466 ms.
CACHE_SHAPES = 64


def shape_of(pod: PodRequest) -> Key:
    # host CPU/memory decide fits (free CPU) and scores (the policy's CPU terms) once nodes carry them
    # (and every host resource kube-scheduler counts, which the extender checks: node_resources.py)
    return (pod.pod_class, pod.containers, pod.init_containers, pod.gpu_models, pod.cpu_milli, pod.ram_mib,
            getattr(pod, "host", None))  # fmt: skip


class VersionedTable(dict[str, tuple[int, V]]):
    """node -> (node version, result): a result holds while the node's version is the one it was
    computed at (versions never repeat, see journal.Journal)."""

    def fresh(self, node: str, version: int) -> tuple[int, V] | None:
        """The entry for `node` if it was computed at `version` (its result is entry[1]), else None."""
        hit = self.get(node)
        return hit if hit is not None and hit[0] == version else None

    def put(self, node: str, version: int, result: V) -> None:
        self[node] = (version, result)


class Tables(Generic[V]):
    """A VersionedTable per key (a pod shape, or shape and learning epoch), the most recent
    `keys` only. In the fit tables a node's Fit may be that of another node in the same state, its
    placement naming that node (PlacementIndex.fit_every_node); PlacementIndex.node_fit hands
    out the node's own."""

    def __init__(self, keys: int = CACHE_SHAPES) -> None:
        self.keys = keys
        self.data: OrderedDict[Key, VersionedTable[V]] = OrderedDict()

    def table(self, key: Key) -> VersionedTable[V]:
        t = self.data.get(key)
        if t is None:
            t = self.data[key] = VersionedTable()
            while len(self.data) > self.keys:
                self.data.popitem(last=False)
        else:
            self.data.move_to_end(key)
        return t

    def forget_node(self, name: str) -> None:
        """A deleted node's entries go from every table."""
        for t in self.data.values():
            t.pop(name, None)

    def entries(self) -> int:
        return sum(map(len, self.data.values()))


class Answer(Protocol):
    names: list[str]
    name_set: set[str]
    pos: int

    def reorder(self, names: list[str]) -> None: ...

    def forget(self, n: str) -> None: ...


A = TypeVar("A", bound=Answer)


class NameSets:
    """set(names) of the last request's node list, built once per list: filter asks two answer
    caches (its own and the best-node index) about the same list."""

    def __init__(self) -> None:
        self._last: tuple[list[str], set[str]] | None = None

    def of(self, names: list[str]) -> set[str]:
        last = self._last
        if last is not None and last[0] is names:
            return last[1]
        asked = set(names)
        self._last = (names, asked)
        return asked


class AnswerCache(Generic[A]):
    """The last answer per key (a pod shape, or shape and epoch), the `keys` most recent."""

    def __init__(
        self, factory: Callable[[list[str]], A], names: NameSets | None = None, keys: int = CACHE_SHAPES
    ) -> None:
        self.factory = factory
        self.names = names or NameSets()
        self.keys = keys
        self.data: OrderedDict[Key, A] = OrderedDict()

    def current(
        self, key: Key, names: list[str], journal: Journal, reserved: set[str]
    ) -> tuple[A, Collection[str]]:
        """The last answer for `key` and the nodes it must look at again: those changed since (or
        holding reservations, whose answer depends on the time), and those not asked about last
        time, and the nodes in `reserved` (defrag reservations: their answer depends on the time); nodes no longer asked about are dropped from it. A fresh answer and every node (the
        list `names` itself) when there is none, or the journal no longer reaches back to it. The
        caller updates those nodes and sets the answer's `pos`. View lock held."""
        st = self.data.get(key)
        added: set[str] = set()
        if st is not None and st.names != names:
            # kube-scheduler's list of the nodes that passed its own filters starts where its last
            # search stopped and is filled in parallel, so with percentageOfNodesToScore: 100 it is
            # the same set in a new order almost every time; and a node its own filters now refuse
            # (its CPU is taken, say) leaves it, without changing the answer for any other node.
            asked = self.names.of(names)
            if asked != st.name_set:
                for n in st.name_set - asked:
                    st.forget(n)
                added = asked - st.name_set
                st.name_set = set(asked)
            st.reorder(names)
        if st is not None:
            self.data.move_to_end(key)
            changed = journal.changed_since(st.pos)
            if changed is not None:
                todo = set(changed)
                todo.update(reserved)
                todo &= st.name_set
                todo |= added
                return st, todo
        st = self.factory(names)
        self.data[key] = st
        while len(self.data) > self.keys:
            self.data.popitem(last=False)
        return st, names


def signature(node: Node) -> Key:
    """What a fit or a score may depend on: every GPU's state, the node's CPU/RAM and
    schedulability, not its name."""
    return (
        tuple(
            (
                g.model,
                g.mem_mib,
                g.mem_used,
                g.milli_used,
                g.pod_class,
                g.exclusive,
                g.healthy,
                bool(g.holders),
            )
            for g in node.gpus
        ),
        node.cpu_milli,
        node.cpu_used,
        node.ram_mib,
        node.ram_used,
        node.schedulable,
    )


class MemoFailure:
    """A FitFailure remembered with the node it came from (its reason may name that node)."""

    __slots__ = ("failure", "node", "reason")

    def __init__(self, failure: FitFailure, node: str) -> None:
        self.failure, self.node, self.reason = failure, node, failure.reason


class FilterAnswer:
    """A filter answer kept up to date node by node."""

    __slots__ = (
        "names",
        "name_set",
        "pos",
        "ok",
        "failed",
        "unresolvable",
        "code_of",
        "codes",
        "steered",
        "passed",
    )

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name_set = set(names)
        self.pos = -1
        self.ok: set[str] = set()
        self.failed: dict[str, str] = {}
        self.unresolvable: dict[str, str] = {}
        self.code_of: dict[str, str] = {}
        self.codes: Counter[str] = Counter()
        self.steered: dict[str, Reservation] = {}
        self.passed: list[str] | None = None  # in the request's order; None: to be rebuilt

    def reorder(self, names: list[str]) -> None:
        """The same nodes, asked in the order of `names`: the answer follows that order."""
        self.names = names
        self.passed = None

    def _unrecord(self, n: str) -> bool:
        """Take node `n` out of the answer; whether it passed."""
        old = self.code_of.pop(n, None)
        if old is not None:
            self.codes[old] -= 1
            self.failed.pop(n, None)
            self.unresolvable.pop(n, None)
            was_ok = False
        else:
            was_ok = n in self.ok
            self.ok.discard(n)
        self.steered.pop(n, None)
        return was_ok

    def forget(self, n: str) -> None:
        """Node `n` is no longer asked about."""
        self._unrecord(n)
        self.passed = None

    def update(self, n: str, r: Fit | FitFailure, res: Reservation | None) -> None:
        if self._unrecord(n):
            self.passed = None
        if r.__class__ is Fit:
            self.ok.add(n)
            self.passed = None
            if res is not None:
                self.steered[n] = res
        else:
            assert isinstance(r, FitFailure)
            (self.unresolvable if r.unresolvable else self.failed)[n] = r.reason
            self.code_of[n] = r.code
            self.codes[r.code] += 1


STATE_IDS_MAX = 10_000  # node states numbered (PlacementIndex.state); ~1.2 KB each at 8 GPUs

FitResult = Fit | FitFailure
FitTable = VersionedTable[FitResult]
# node state -> what node_fit answered for the first node in it (see PlacementIndex.node_fit's `memo`)
FitMemo = dict[int | None, Fit | MemoFailure]


def fit_on(f: Fit, node: str) -> Fit:
    """`f` (a fit on another node in the same state: the same GPUs) as a fit on `node`."""
    return Fit(Placement(node, f.placement.containers), f.charged)


class PlacementIndex:
    """A pod's fit on the view's nodes, per pod shape and node version, and the filter answers
    built from them. Every method is called with the view's lock held."""

    def __init__(self, view: ClusterView, policy: Policy) -> None:
        self.view = view
        self.policy = policy
        self.fits: Tables[FitResult] = Tables()  # pod shape -> node -> (version, fit)
        # the set of a request's node list, built once per list for every answer cache asked
        self.names = NameSets()
        # pod shape -> the filter answer, brought up to date node by node (filter_answer)
        self.answers: AnswerCache[FilterAnswer] = AnswerCache(FilterAnswer, self.names)
        self.last_fitted = 0  # nodes the last filter_answer fitted again (the slow-filter log)
        self._states: VersionedTable[int | None] = VersionedTable()
        self._state_ids: dict[Key, int] = {}
        self._state_seq = itertools.count()
        view.gone_hooks.add(self.node_gone)

    def node_gone(self, name: str) -> None:
        """Node `name` was deleted: its entries go from every kept shape's table (view lock held)."""
        self._states.pop(name, None)
        self.fits.forget_node(name)

    def tracked_sizes(self) -> dict[str, int]:
        """Entries kept: pod shapes, their per-node fits, node states, filter answers (view lock
        held). The names are the `gpupack_extender_tracked_entries` gauge's labels."""
        return {
            "fitter.shapes": len(self.fits.data),
            "fitter.fits": self.fits.entries(),
            "fitter.node_states": len(self._states),
            "fitter.state_ids": len(self._state_ids),
            "filter.answers": len(self.answers.data),
        }

    def knows(self, shape: Key) -> bool:
        """Whether the shape has a filter answer kept (one filter of it brought every node in)."""
        return shape in self.answers.data

    def fit_table(self, shape: Key) -> FitTable:
        """The shape's fits by node version (kept as the most recent of CACHE_SHAPES)."""
        return self.fits.table(shape)

    def filter_answer(self, pod: PodRequest, names: list[str], now: datetime) -> FilterAnswer:
        """The pod shape's filter answer over `names`, updated for the nodes changed since it was
        last given (all of them for a new shape); `last_fitted` says how many that was."""
        shape = shape_of(pod)
        table = self.fits.table(shape)
        view = self.view
        st, todo = self.answers.current(shape, names, view.journal, view.reserved)
        pos = view.journal.seq
        nodes = view.nodes
        self.last_fitted = len(todo)
        if todo is names and pod.needs_gpu:
            self.fit_every_node(st, names, pod, now, table)
        else:
            memo: FitMemo = {}
            update = st.update
            node_fit = self.node_fit
            for n in todo:
                info = nodes.get(n)
                res = None
                if info is not None and not info.reservations:
                    hit = table.fresh(n, info.version)
                    if hit is not None:
                        r = hit[1]
                    else:
                        r, res = node_fit(n, pod, now, table, memo)
                else:
                    r, res = node_fit(n, pod, now, table, memo)
                update(n, r, res)
        st.pos = pos
        return st

    def node_fit(
        self, name: str, pod: PodRequest, now: datetime, table: FitTable | None, memo: FitMemo | None = None
    ) -> tuple[FitResult, Reservation | None]:
        """Fit on one node, honouring defrag reservations; the reservation the fit uses."""
        view = self.view
        info = view.nodes.get(name)
        node = view.state.nodes.get(name)
        if info is None or node is None:
            return FitFailure(
                f"node {name} is not in gpupack's view of the cluster (yet)", "unknown-node"
            ), None
        if view.track_host and isinstance(pod, HostedPodRequest):
            # kube-scheduler's NodeResourcesFit filter, off in the shipped profile (node_resources.py);
            # a preemptor's hold keeps its host room from the others
            kept, held_pods = (
                resv.held_host(view.active_reservations(name, now), pod)
                if info.reservations
                else (NO_HOST_USE, 0)
            )
            short = node_resources_fit(info, pod.host, kept, held_pods)
            if short is not None:
                return short, None
        if not pod.needs_gpu:
            return self.host_only_fit(name, node, pod, now, table), None
        if info.inventory_error:
            return FitFailure(
                f"node {name}: its {('gpupack.io/inventory')} annotation is unreadable ({info.inventory_error})",
                "corrupt-inventory",
                True,
            ), None
        if info.slots <= 0:
            return FitFailure(
                f"node {name}: no {RES_GPU} slots allocatable (the gpupack device plugin is not registered "
                "with its kubelet, or has gone)",
                "no-slots",
            ), None
        if info.inventory_conflict:
            return FitFailure(info.inventory_conflict, "inventory-contradicts-kubelet", True), None
        need = pod.gpu_slots
        free = view.slots_free(name)
        if need > free:
            return FitFailure(
                f"node {name}: {need} {RES_GPU} slot(s) needed, {max(free, 0)} of {info.slots} free "
                "(the kubelet admits no more GPU containers)",
                "slots",
            ), None
        held = view.active_reservations(name, now)
        if not held:
            return self._plain_fit(name, info, node, pod, table, memo), None
        last: FitResult = FitFailure("no fit", "none")
        for cand, reservation in resv.candidates(node, held, pod, now, set()):
            r = self.policy.fit(cand, pod)
            if r:
                return r, reservation
            last = r
        if isinstance(last, FitFailure) and "reservation" not in last.reason:
            last = FitFailure(f"{last.reason} (with {len(held)} defrag reservation(s) held)", last.code)
        return last, None

    def _plain_fit(
        self,
        name: str,
        info: NodeInfo,
        node: Node,
        pod: PodRequest,
        table: FitTable | None,
        memo: FitMemo | None,
    ) -> FitResult:
        """The fit on a node without reservations: from the table, from another node in the same
        state (`memo`: a fresh or evenly filled cluster), or the policy's."""
        if table is not None:
            hit = table.fresh(name, info.version)
            if hit is not None:
                f = hit[1]
                if isinstance(f, Fit) and f.placement.node != name:
                    f = fit_on(f, name)  # a node in the same state's (fit_every_node)
                return f
        r: FitResult | None = None
        sig = None
        if memo is not None:
            sig = self.state(name, info)
            known = memo.get(sig)
            if isinstance(known, Fit):
                r = fit_on(known, name)
            elif known is not None and known.reason.find(known.node) < 0:
                r = known.failure
        if r is None:
            r = self.policy.fit(node, pod)
            if memo is not None:
                memo[sig] = r if isinstance(r, Fit) else MemoFailure(r, name)
        if table is not None:
            table.put(name, info.version, r)
        return r

    def host_only_fit(
        self, name: str, node: Node, pod: PodRequest, now: datetime, table: FitTable | None
    ) -> FitResult:
        """A CPU-only pod's fit: no slots, no handoff, no inventory needed (it never meets the device
        plugin). On a GPU node the policy's own fit, as the simulator's schedule() runs it; defrag
        reservations hold their GPUs there, but none steers it (it takes no GPU)."""
        info = self.view.nodes[name]
        held = self.view.active_reservations(name, now)
        if not held and table is not None:
            hit = table.fresh(name, info.version)
            if hit is not None:
                return hit[1]
        if not node.gpus:
            r = host_fit(node, pod)
        else:
            r = self.policy.fit(resv.hold(node, held) if held else node, pod)
        if not held and table is not None:
            table.put(name, info.version, r)
        return r

    def fit_every_node(
        self, st: FilterAnswer, names: list[str], pod: PodRequest, now: datetime, table: FitTable
    ) -> None:
        """Fill a new filter answer (`st`, nothing in it yet): the first filter of a pod shape, so
        every asked node. node_fit's answer for each, with its work done once per node state
        (`state`) instead of once per node: kube-scheduler waits for this filter, and with a few
        dozen states among 1,000 nodes the per-node cost is what is left (~5 ms a new shape at
        1,000 nodes through node_fit, ~27 ms at 5,000). A failure whose reason names its node is
        not handed on to another; a Fit is, in the fit table only (its placement names the
        state's first node; node_fit copies it for the node asked about)."""
        nodes = self.view.nodes
        states = self._states
        host = pod.host if self.view.track_host and isinstance(pod, HostedPodRequest) else None
        by_state: dict[int, Fit | MemoFailure] = {}  # as node_fit's memo keeps them
        ok, failed, unresolvable = st.ok, st.failed, st.unresolvable
        code_of, codes = st.code_of, st.codes
        for n in names:
            info = nodes.get(n)
            if info is None or info.reservations:
                r, res = self.node_fit(n, pod, now, table)
                st.update(n, r, res)
                continue
            if host is not None:
                short = node_resources_fit(info, host)
                if short is not None:
                    st.update(n, short, None)
                    continue
            hit = table.fresh(n, info.version)
            if hit is not None:
                st.update(n, hit[1], None)
                continue
            sh = states.fresh(n, info.version)
            state = sh[1] if sh is not None else self.state(n, info)
            known = by_state.get(state) if state is not None else None
            if known is None or (known.__class__ is MemoFailure and known.reason.find(known.node) >= 0):
                r, _ = self.node_fit(n, pod, now, table)
                if state is not None and known is None:
                    by_state[state] = r if isinstance(r, Fit) else MemoFailure(r, n)
                st.update(n, r, None)
                continue
            if isinstance(known, Fit):
                r = known  # the table keeps the first node's Fit: node_fit hands out this node's
                ok.add(n)
            else:
                r = known.failure
                (unresolvable if r.unresolvable else failed)[n] = r.reason
                code_of[n] = r.code
                codes[r.code] += 1
            table.put(n, info.version, r)
        st.passed = None

    def state(self, name: str, info: NodeInfo) -> int | None:
        """A number for everything node_fit's answer on a node without reservations depends on,
        apart from the node's name: its signature, its free and allocatable slots, whether its
        inventory reads (None: a node gpupack does not know). Nodes with the same number fit and
        score the same. A number, not the tuple: hashing a node's signature (a tuple per GPU) is
        what a lookup by it costs, ~2 µs a node. Cached per node version, as every input is
        charged under one (a slot's use too)."""
        hit = self._states.fresh(name, info.version)
        if hit is not None:
            return hit[1]
        node = self.view.state.nodes.get(name)
        state = None
        if node is not None:
            key = (signature(node), self.view.slots_free(name), info.slots, bool(info.inventory_error),
                   bool(info.inventory_conflict))  # fmt: skip
            state = self._state_ids.get(key)
            if state is None:
                if len(self._state_ids) >= STATE_IDS_MAX:
                    self._state_ids.clear()  # numbers are never reused: new ones from here on
                state = self._state_ids[key] = next(self._state_seq)
        self._states.put(name, info.version, state)
        return state
