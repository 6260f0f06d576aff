"""The extender's caches, as public types that keep themselves current: per-node results by node
version (`VersionedTable`, `Tables`), and per pod shape the filter and prioritize answers and the
policy's node order (`AnswerCache` of `FilterAnswer`, `PriorityAnswer`, `BestIndex`), updated node
by node from the view's journal: only nodes whose state changed are fitted or scored again."""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Generic, Protocol, TypeVar

from gpupack.contract import (
    Reservation,
)
from gpupack.core.fit import Fit, FitFailure
from gpupack.core.model import Node, PodRequest
from gpupack.core.score_scale import MAX_SCORE, normalised

from ..state.journal import Journal

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
    placement naming that node (fitting.Fitter.fit_every_node); Fitter.node_fit hands out the
    node's own."""

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


class PriorityAnswer:
    """Raw scores of a prioritize answer kept up to date node by node, and its last result."""

    __slots__ = ("names", "name_set", "pos", "raw", "steered", "out")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name_set = set(names)
        self.pos = -1
        self.raw: dict[str, float] = {}
        self.steered: set[str] = set()
        self.out: list[int] | None = None

    def reorder(self, names: list[str]) -> None:
        """The same nodes, asked in the order of `names`: the scores follow that order."""
        self.names = names
        self.out = None

    def forget(self, n: str) -> None:
        self.raw.pop(n, None)
        self.steered.discard(n)
        self.out = None


def normalise(names: list[str], raw: dict[str, float], steered: set[str]) -> list[int]:
    """Raw scores to 0..MAX_SCORE over the lowest..highest (gpupack.core.score_scale); no fit 0;
    steered nodes MAX_SCORE."""
    norm = normalised(raw.values())
    get = raw.get
    out = [norm.get(get(n), 0) for n in names]  # type: ignore[arg-type]
    if steered:
        out = [MAX_SCORE if n in steered else s for n, s in zip(names, out, strict=True)]
    return out


def sorted_index(
    key_of: dict[str, tuple[bool, float, float]], scored: dict[str, float], ranked: list[str]
) -> list[tuple[tuple[bool, float, float], str]]:
    """sorted((key, n) for n, key in key_of.items()), the order of a new BestIndex, built without
    comparing those tuples: `ranked` (every node the policy ranked, by tie key then name) filtered
    to key_of's nodes, nodes it has not ranked (tie key 2.0) after them by name, then a stable sort
    on one float per node (its score negated; no score: after every score). After a learning flush
    every pod shape builds one of ~1,000-5,000 nodes on kube-scheduler's serial cycle; the tuple
    sort took ~0.7 ms at 1,000 nodes. A score that is not finite falls back to the tuple sort."""
    if not all(math.isfinite(v) for v in scored.values()):
        return sorted((k, n) for n, k in key_of.items())
    members = [n for n in ranked if n in key_of]
    if len(members) < len(key_of):
        known = set(members)
        members += sorted(n for n in key_of if n not in known)
    last = math.inf
    get = scored.get
    members.sort(key=lambda n: -s if (s := get(n)) is not None else last)
    return [(key_of[n], n) for n in members]


class BestIndex:
    """A request's nodes in the order :meth:`scoring.Scorer.keep_best` takes them, for one (shape,
    epoch), kept up to date node by node: each node's sort key, and (key, node) sorted."""

    __slots__ = ("names", "name_set", "pos", "key_of", "order")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name_set = set(names)
        self.pos = -1
        self.key_of: dict[str, tuple[bool, float, float]] = {}
        self.order: list[tuple[tuple[bool, float, float], str]] = []

    def reorder(self, names: list[str]) -> None:
        self.names = names  # the order of the request does not matter here

    def _unlist(self, n: str, key: tuple[bool, float, float]) -> bool:
        """Take (key, n) out of `order`. False when it is not found there (a key that does not
        compare equal to itself: a NaN score), and `order` was sorted again from `key_of` instead."""
        i = bisect.bisect_left(self.order, (key, n))
        if i < len(self.order) and self.order[i] == (key, n):
            del self.order[i]
            return True
        self.order = sorted((k, m) for m, k in self.key_of.items())
        return False

    def forget(self, n: str) -> None:
        key = self.key_of.pop(n, None)
        if key is not None:
            self._unlist(n, key)

    def set(self, n: str, key: tuple[bool, float, float]) -> None:
        old = self.key_of.get(n)
        if old == key:
            return
        self.key_of[n] = key
        if old is not None and not self._unlist(n, old):
            return  # sorted again, with the new key
        bisect.insort(self.order, (key, n))
