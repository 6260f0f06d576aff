"""A node's fragmentation against a workload, and the integer score both fragmentation policies
give a placement from it.

A node's *fragmentation* is the free GPU capacity that a typical arriving pod could not use there,
averaged over the workload's typical shapes (:class:`gpupack.core.workload.Workload`): for a shape
the node cannot host at all (a GPU model the shape may not use, too little free CPU, too few GPUs
that serve it) all its free capacity counts; for one it can host, the capacity of the GPUs that
cannot serve it. :func:`fragmentation` is the definition; :class:`FragCache` gets the same
integers from per-shape counts it updates per GPU trial, which is what the policies run.

What a GPU is, how much free capacity it holds and whether it serves a shape is the policy's:
FGD sees a GPU as its free milli, gpupack as a view with memory and class (`amount`, `serves`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from gpupack.core.workload import Shape

V = TypeVar("V", bound=Hashable)  # one GPU as a policy sees it: free milli (fgd), a view (gpupack)


def fragmentation(
    gpus: Sequence[V],
    cpu_left: int | None,
    model: str,
    shapes: Sequence[Shape],
    weights: Sequence[int],
    amount: Callable[[V], int],
    serves: Callable[[V, Shape], bool],
) -> int:
    """Σ_shape weight × (free GPU capacity, milli, that the shape cannot use on this node).

    `amount`: a GPU's free capacity; `serves`: whether a GPU can take one GPU's worth of a shape.
    The definition; the policies get the same integers from :class:`FragCache`."""
    amounts = [amount(v) for v in gpus]
    total = sum(amounts)
    out = 0
    for s, w in zip(shapes, weights, strict=True):
        # A node whose GPU model the shape may not use ("no access") counts all its free capacity
        # as fragment for that shape, as the published FGD does: it steers unconstrained pods off
        # the models that constrained pods need.
        if (
            s.gpus
            and (s.models is None or model in s.models)
            and (cpu_left is None or cpu_left >= s.cpu_milli)
        ):
            fits = 0
            part = 0
            for v, a in zip(gpus, amounts, strict=True):
                if serves(v, s):
                    fits += 1
                else:
                    part += a
            if fits >= s.gpus:
                out += w * part
                continue
        out += w * total
    return out


# --- fragmentation kept per node state and updated per GPU trial ------------------------------
# Both fragmentation policies rank each candidate GPU of a node by the fragmentation of the node
# with that one GPU changed, for every node, for every pod: the per-state sum over all GPUs x all
# typical shapes was most of the extender's filter time. Per shape the sum needs only how many of
# the node's GPUs serve the shape and how much free capacity those hold; a trial moves one GPU in
# or out of those counts. The integers are the same as the per-state sum's (`fragmentation`), so
# the decisions are too.


class ShapeTable(Generic[V]):
    """The typical GPU shapes a node of one model may host, as parallel tuples, and which of them
    each GPU serves. A shape the model may not use is left out: it counts all the node's free
    capacity as fragment whatever the node's state."""

    __slots__ = ("shapes", "weight", "gpus", "cpu", "by_cpu", "cpu_sorted", "_serves", "_served", "_moved")

    def __init__(
        self, model: str, shapes: Sequence[Shape], weights: Sequence[int], serves: Callable[[V, Shape], bool]
    ) -> None:
        kept = [
            (s, w)
            for s, w in zip(shapes, weights, strict=True)
            if s.gpus and (s.models is None or model in s.models)
        ]
        self.shapes = tuple(s for s, _ in kept)
        self.weight = tuple(w for _, w in kept)
        self.gpus = tuple(s.gpus for s, _ in kept)
        self.cpu = tuple(s.cpu_milli for s, _ in kept)
        # positions by CPU request, and those requests in that order: the shapes a free CPU allows
        # are a prefix of this order (NodeFrag.hosted_at)
        self.by_cpu = tuple(sorted(range(len(kept)), key=lambda k: self.cpu[k]))
        self.cpu_sorted = tuple(self.cpu[k] for k in self.by_cpu)
        self._serves = serves
        self._served: dict[V, tuple[int, ...]] = {}
        self._moved: dict[tuple[V, V], tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def served(self, v: V) -> tuple[int, ...]:
        """Positions (in `shapes`) of the shapes GPU `v` serves."""
        hit = self._served.get(v)
        if hit is None:
            if len(self._served) > 100_000:
                self._served.clear()
            serves = self._serves
            hit = self._served[v] = tuple(k for k, s in enumerate(self.shapes) if serves(v, s))
        return hit

    def moved(self, v0: V, v1: V) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """A GPU turned from `v0` into `v1`: the positions of the shapes it serves both before and
        after, only before, and only after."""
        key = (v0, v1)
        hit = self._moved.get(key)
        if hit is None:
            if len(self._moved) > 100_000:
                self._moved.clear()
            before, after = self.served(v0), self.served(v1)
            b, a = set(before), set(after)
            hit = self._moved[key] = (
                tuple(k for k in before if k in a),
                tuple(k for k in before if k not in a),
                tuple(k for k in after if k not in b),
            )
        return hit


class NodeFrag(Generic[V]):
    """One node state's per-shape counts, from which its fragmentation follows for any free CPU, and
    after any change of a few GPUs, without going over the node's GPUs again:

        Σ_shape w × (free capacity the shape cannot use)
        = W × total − Σ_{shapes the node can host} w × (free capacity of the GPUs serving it)

    W sums every typical shape's weight (those the model may not use included); a shape can be
    hosted when the free CPU allows it and `fits[k]` (GPUs serving it) reaches its GPU count;
    `served[k]` sums those GPUs' free capacity.
    """

    __slots__ = ("table", "amounts", "total", "fits", "served", "trials", "_prefix")

    def __init__(self, table: ShapeTable[V], views: Sequence[V], amounts: list[int]) -> None:
        self.table = table
        fits = [0] * len(table.shapes)
        served = [0] * len(table.shapes)
        for v, a in zip(views, amounts, strict=True):
            for k in table.served(v):
                fits[k] += 1
                served[k] += a
        self.amounts = amounts  # free capacity per GPU, in the node's order
        self.total = sum(amounts)
        self.fits = fits
        self.served = served
        # (changed GPUs' (before, after) pairs, free CPU after) -> (fragmentation, total after)
        self.trials: dict[tuple[object, ...], tuple[int, int]] = {}
        self._prefix: list[int] | None = None

    def hosted_at(self, cpu_left: int | None) -> int:
        """hosted(fits, served, cpu_left) of this state: the shapes a free CPU allows are those
        first in the table's CPU order, so one pass over the shapes gives every free CPU's sum
        (a state is asked at its own free CPU and at each pod's CPU taken from it)."""
        prefix = self._prefix
        if prefix is None:
            t = self.table
            fits, served, weight, gpus = self.fits, self.served, t.weight, t.gpus
            acc = 0
            prefix = [0]
            for k in t.by_cpu:
                if fits[k] >= gpus[k]:
                    acc += weight[k] * served[k]
                prefix.append(acc)
            self._prefix = prefix
        if cpu_left is None:
            return prefix[-1]
        return prefix[bisect_right(self.table.cpu_sorted, cpu_left)]

    def hosted(self, fits: Sequence[int], served: Sequence[int], cpu_left: int | None) -> int:
        """Σ w × served capacity over the shapes the node can host."""
        t = self.table
        out = 0
        if cpu_left is None:
            for w, g, f, a in zip(t.weight, t.gpus, fits, served, strict=True):
                if f >= g:
                    out += w * a
        else:
            for w, g, c, f, a in zip(t.weight, t.gpus, t.cpu, fits, served, strict=True):
                if f >= g and cpu_left >= c:
                    out += w * a
        return out


class FragCache(Generic[V]):
    """Fragmentation of node states and of GPU trials on them, for one workload version (a new
    version needs a new cache). `amount`: a GPU's free capacity (milli); `serves`: whether a GPU
    can take one GPU's worth of a shape. Memoised: many nodes, and the trials on equal GPUs of one
    node, share a state. Bounded at LIMIT states and trials: an entry takes ~1 KB, so ~50 MB at
    most in the extender, which keeps one cache per policy."""

    LIMIT = 50_000

    def __init__(
        self,
        shapes: Sequence[Shape],
        weights: Sequence[int],
        amount: Callable[[V], int],
        serves: Callable[[V, Shape], bool],
    ) -> None:
        self.shapes = tuple(shapes)
        self.weights = tuple(weights)
        self.wsum = sum(weights)
        self.amount = amount
        self.serves = serves
        self.tables: dict[str, ShapeTable[V]] = {}
        self.nodes: dict[tuple[tuple[V, ...], str], NodeFrag[V]] = {}
        self.entries = 0

    def _count(self) -> None:
        self.entries += 1
        if self.entries > self.LIMIT:
            self.nodes.clear()
            self.entries = 1

    def node(self, views: Sequence[V], model: str) -> NodeFrag[V]:
        key = (tuple(views), model)
        hit = self.nodes.get(key)
        if hit is None:
            table = self.tables.get(model)
            if table is None:
                table = self.tables[model] = ShapeTable(model, self.shapes, self.weights, self.serves)
            self._count()
            amount = self.amount
            hit = self.nodes[key] = NodeFrag(table, views, [amount(v) for v in views])
        return hit

    def frag(self, nf: NodeFrag[V], cpu_left: int | None) -> int:
        """The fragmentation of state `nf` with `cpu_left` free CPU (None: CPU not tracked)."""
        return self.wsum * nf.total - nf.hosted_at(cpu_left)

    def trial(
        self, nf: NodeFrag[V], changes: tuple[tuple[V, V], ...], cpu_left: int | None
    ) -> tuple[int, int]:
        """(fragmentation, free capacity) of state `nf` with one GPU of each `changes[i][0]` turned
        into `changes[i][1]`, and `cpu_left` free CPU. Both are sums over the node's GPUs, so which
        of equal GPUs changes does not matter."""
        key = (changes, cpu_left)
        hit = nf.trials.get(key)
        if hit is None and len(changes) == 1:
            hit = nf.trials[key] = self._trial_one(nf, changes[0][0], changes[0][1], cpu_left)
            self._count()
        if hit is None:
            t = nf.table
            amount = self.amount
            fits = list(nf.fits)
            served = list(nf.served)
            total = nf.total
            for v0, v1 in changes:
                a0 = amount(v0)
                a1 = amount(v1)
                total += a1 - a0
                for k in t.served(v0):
                    fits[k] -= 1
                    served[k] -= a0
                for k in t.served(v1):
                    fits[k] += 1
                    served[k] += a1
            self._count()
            hit = nf.trials[key] = (self.wsum * total - nf.hosted(fits, served, cpu_left), total)
        return hit

    def _trial_one(self, nf: NodeFrag[V], v0: V, v1: V, cpu_left: int | None) -> tuple[int, int]:
        """`trial` of one GPU changed, from the state's hosted sum at `cpu_left` (NodeFrag.hosted_at,
        its prefix sums shared by every trial on the state) and the shapes whose counts the change
        moves: the common trial (one shared GPU a pod) no longer copies and sums every shape's
        counts. The same integers as the general path's."""
        t = nf.table
        a0, a1 = self.amount(v0), self.amount(v1)
        hosted = nf.hosted_at(cpu_left)
        fits, served, weight, gpus, cpu = nf.fits, nf.served, t.weight, t.gpus, t.cpu
        both, lost, gained = t.moved(v0, v1)
        d = a1 - a0
        for k in both:  # still served by the GPU: as many GPUs serve the shape, with d more room
            if fits[k] >= gpus[k] and (cpu_left is None or cpu_left >= cpu[k]):
                hosted += weight[k] * d
        for k in lost:  # one GPU fewer serves the shape, a0 less room
            if cpu_left is None or cpu_left >= cpu[k]:
                f, s, g = fits[k], served[k], gpus[k]
                if f >= g:
                    hosted -= weight[k] * s
                if f > g:
                    hosted += weight[k] * (s - a0)
        for k in gained:  # one GPU more serves the shape, a1 more room
            if cpu_left is None or cpu_left >= cpu[k]:
                f, s, g = fits[k], served[k], gpus[k]
                if f >= g:
                    hosted -= weight[k] * s
                if f + 1 >= g:
                    hosted += weight[k] * (s + a1)
        total = nf.total + d
        return self.wsum * total - hosted, total


# --- the score of a placement ----------------------------------------------------------------
# Integer score k (0..99) iff x >= logit(k/100): one table shared by the per-node code and the
# simulator's vectorised scorers.
SIGMOID_STEPS = tuple(math.log(k / (100 - k)) for k in range(1, 100))


def sigmoid_score(decrease: int, total: int) -> int:
    """``int(100 * sigmoid(decrease / total / 1000))`` without float drift between code paths."""
    if total <= 0:
        return 50
    return bisect_right(SIGMOID_STEPS, decrease / (total * 1000))
