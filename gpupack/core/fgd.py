"""Fragmentation Gradient Descent (FGD), as published for the openb trace.

Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC 2023.

A node's *fragmentation* is the GPU capacity (milli) that a typical arriving pod could not use
there, averaged over a target workload: the pod shapes that make up ~95% of the pods, each weighted
by its popularity. For one shape, a node that cannot host it at all (a GPU model the shape's
`gpu_spec` does not allow, too little CPU, too few GPUs with enough free milli) counts all of its
free GPU milli as fragment; a node that can counts only the GPUs whose free milli is below the
shape's per-GPU request. FGD places a pod where, and on the GPU where, that expected fragmentation
grows least. Host RAM is ignored, as published.

Three details of the published simulator (hkust-adsl/kubernetes-scheduler-simulator,
`pkg/utils/frag.go`) decide the figures on the GPU-model-constrained traces (docs/simulate.md):
- a node whose model a shape may not use is "no access" for it and ALL its free milli counts;
- a shape is keyed by the pod's `gpu_spec` text as written (`V100M16|V100M32` and
  `V100M16|V100M32|V100M32` are two shapes), and shapes of equal count are ranked by
  (CPU, per-GPU milli, GPU count, spec text), largest first, before the 95% cut;
- the kept shapes' weights are renormalised to sum to one, so the score's scale is the kept
  pods' count (:attr:`Workload.kept`), not all pods.

Scores are integers 0..100, ``int(100 * sigmoid(decrease / 1000))`` as in the published simulator,
so many nodes tie; :func:`gpupack.core.policies.schedule` breaks ties with the policy's seeded RNG.

Fragmentation is kept as an integer (shape counts × milli) so that the trace replay's vectorised
fast path and this per-node code compute bit-identical scores.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gpupack.core.fit import Fit, FitFailure, fit
from gpupack.core.model import FULL, GPU, Node, PodRequest


@dataclass(frozen=True)
class Shape:
    """What one kind of pod asks for: host CPU, GPU count and per-GPU share, allowed models, class."""

    cpu_milli: int
    gpus: int
    milli: int  # per GPU; FULL for whole GPUs
    mem_mib: int = 0  # per GPU; 0 in the openb trace
    models: frozenset[str] | None = None
    pod_class: str | None = None
    spec: str = ""  # the models as the trace writes them: the published simulator's shape key


def shape_of(pod: PodRequest) -> Shape:
    """The pod's shape; a multi-container pod is summarised by its largest GPU container."""
    cs = pod.containers
    if not cs:
        return Shape(pod.cpu_milli, 0, 0, 0, pod.gpu_models, pod.pod_class)
    c = max(cs, key=lambda c: (c.exclusive, c.gpus, c.milli or 0, c.mem_mib or 0))
    milli = FULL if c.exclusive else (c.milli or 0)
    return Shape(pod.cpu_milli, c.gpus, milli, c.mem_mib or 0, pod.gpu_models, pod.pod_class)


class Workload:
    """Popularity of pod shapes; `typical()` keeps the most popular ones covering `coverage` of pods.

    Weights stay integer counts; `total` counts every pod seen and `kept` the pods of the typical
    shapes, by which the published simulator renormalises their weights (FGD scales its score by
    it).
    """

    def __init__(
        self, counts: Counter[Shape] | None = None, coverage: float = 0.95, by_demand: bool = False
    ) -> None:
        self.counts: Counter[Shape] = Counter(counts or {})
        self.coverage = coverage
        # by_demand: weigh each shape by count × the GPU milli it asks for, not by count alone.
        self.by_demand = by_demand
        self._cache: tuple[int, tuple[tuple[Shape, ...], tuple[int, ...]]] | None = None
        # (version, by_demand, total): the policies read `total` per node scored, and summing
        # every shape's weight each time was most of their cost.
        self._total: tuple[int, bool, int] | None = None
        self._version = 0

    @classmethod
    def of(cls, shapes: Iterable[Shape], coverage: float = 0.95) -> Workload:
        return cls(Counter(shapes), coverage)

    def weight(self, s: Shape, n: int) -> int:
        return n * s.gpus * max(s.milli, 1) if self.by_demand else n

    @property
    def total(self) -> int:
        t = self._total
        if t is None or t[0] != self._version or t[1] != self.by_demand:
            t = self._total = (
                self._version,
                self.by_demand,
                sum(self.weight(s, n) for s, n in self.counts.items()),
            )
        return t[2]

    @property
    def kept(self) -> int:
        return sum(self.typical()[1])

    def add(self, shape: Shape) -> None:
        self.counts[shape] += 1
        self._version += 1

    def typical(self) -> tuple[tuple[Shape, ...], tuple[int, ...]]:
        if self._cache is not None and self._cache[0] == self._version:
            return self._cache[1]
        total = self.total
        shapes: list[Shape] = []
        weights: list[int] = []
        acc = 0
        ranked = sorted(
            self.counts.items(), key=lambda kv: -self.weight(*kv)
        )  # stable: first-seen order on ties
        for s, n in ranked:
            w = self.weight(s, n)
            if w <= 0:
                break
            shapes.append(s)
            weights.append(w)
            acc += w
            if acc >= self.coverage * total:
                break
        out = (tuple(shapes), tuple(weights))
        self._cache = (self._version, out)
        return out


def node_state(node: Node) -> tuple[list[int], int | None]:
    """Free milli per GPU (an unhealthy GPU has none) and free CPU (None when CPU is not tracked)."""
    frees = [g.free_milli if g.healthy else 0 for g in node.gpus]
    return frees, (node.free_cpu if node.cpu_milli else None)


def frag(
    frees: Sequence[int], cpu_left: int | None, model: str, shapes: Sequence[Shape], weights: Sequence[int]
) -> int:
    """Expected fragmentation × pod count: Σ_shape count × (free milli that shape cannot use here).

    The definition; the policy gets the same integers from per-shape counts it updates per GPU
    trial (:class:`FragCache`)."""
    total = sum(frees)
    out = 0
    for s, w in zip(shapes, weights, strict=True):
        # A model the shape may not use ("no access") falls through: all free milli is fragment.
        if (
            s.gpus
            and (s.models is None or model in s.models)
            and (cpu_left is None or cpu_left >= s.cpu_milli)
        ):
            fits = 0
            part = 0
            for f in frees:
                if f >= s.milli:
                    fits += 1
                else:
                    part += f
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
# or out of those counts. The integers are the same as the per-state sum's (`frag`, and
# gpupack's `fragmentation`), so the decisions are too.

V = TypeVar("V", bound=Hashable)  # one GPU as a policy sees it: free milli (fgd), a view (gpupack)


class ShapeTable(Generic[V]):
    """The typical GPU shapes a node of one model may host, as parallel tuples, and which of them
    each GPU serves. A shape the model may not use is left out: it counts all the node's free
    capacity as fragment whatever the node's state."""

    __slots__ = ("shapes", "weight", "gpus", "cpu", "_serves", "_served")

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
        self._serves = serves
        self._served: dict[V, tuple[int, ...]] = {}

    def served(self, v: V) -> tuple[int, ...]:
        """Positions (in `shapes`) of the shapes GPU `v` serves."""
        hit = self._served.get(v)
        if hit is None:
            if len(self._served) > 100_000:
                self._served.clear()
            serves = self._serves
            hit = self._served[v] = tuple(k for k, s in enumerate(self.shapes) if serves(v, s))
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

    __slots__ = ("table", "amounts", "total", "fits", "served", "by_cpu", "trials")

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
        self.by_cpu: dict[int | None, int] = {}  # free CPU -> the hosted sum of this state
        # (changed GPUs' (before, after) pairs, free CPU after) -> (fragmentation, total after)
        self.trials: dict[tuple[object, ...], tuple[int, int]] = {}

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
        hosted = nf.by_cpu.get(cpu_left)
        if hosted is None:
            hosted = nf.by_cpu[cpu_left] = nf.hosted(nf.fits, nf.served, cpu_left)
        return self.wsum * nf.total - hosted

    def trial(
        self, nf: NodeFrag[V], changes: tuple[tuple[V, V], ...], cpu_left: int | None
    ) -> tuple[int, int]:
        """(fragmentation, free capacity) of state `nf` with one GPU of each `changes[i][0]` turned
        into `changes[i][1]`, and `cpu_left` free CPU. Both are sums over the node's GPUs, so which
        of equal GPUs changes does not matter."""
        key = (changes, cpu_left)
        hit = nf.trials.get(key)
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


def _free(f: int) -> int:
    return f


def _takes(f: int, s: Shape) -> bool:
    return f >= s.milli


# Integer score k (0..99) iff x >= logit(k/100): one table shared by both code paths.
SIGMOID_STEPS = tuple(math.log(k / (100 - k)) for k in range(1, 100))


def sigmoid_score(decrease: int, total: int) -> int:
    """``int(100 * sigmoid(decrease / total / 1000))`` without float drift between code paths."""
    if total <= 0:
        return 50
    return bisect_right(SIGMOID_STEPS, decrease / (total * 1000))


def after(
    frees: Sequence[int], cpu_left: int | None, pod: PodRequest, charged: dict[int, tuple[int, int, bool]]
) -> tuple[list[int], int | None]:
    out = list(frees)
    for idx, (_, milli, ex) in charged.items():
        out[idx] -= FULL if ex else milli
    return out, (None if cpu_left is None else cpu_left - pod.cpu_milli)


class FGDPolicy:
    """Mixin body for the `fgd` policy; registered in :mod:`gpupack.core.policies`.

    `workload`: the target workload (the replay passes the trace's shapes). Without one the policy
    learns it from the pods it is shown through `observe`, which is what a live scheduler does.
    """

    name = "fgd"
    workload: Workload
    learn: bool

    def _setup(self, workload: Workload | None) -> None:
        self._frag_cache: tuple[tuple[int, int, bool], FragCache[int], int] | None = None
        self.learn = workload is None
        self.workload = workload if workload is not None else Workload()

    def observe(self, pod: PodRequest) -> None:
        if self.learn:
            self.workload.add(shape_of(pod))

    def _frags(self) -> tuple[FragCache[int], int]:
        """The fragmentation cache of the current workload version, and its `kept` weight."""
        wl = self.workload
        key = (id(wl), wl._version, wl.by_demand)
        c = self._frag_cache
        if c is None or c[0] != key:
            shapes, weights = wl.typical()
            c = self._frag_cache = (key, FragCache(shapes, weights, _free, _takes), sum(weights))
        return c[1], c[2]

    def _frag(self, frees: list[int], cpu: int | None, model: str) -> int:
        cache, _ = self._frags()
        return cache.frag(cache.node(frees, model), cpu)

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        cache, total = self._frags()
        # Only a share is ranked by the state it leaves: the node's state is read at the first
        # share ranked (fit changes nothing before), so whole-GPU pods never build it.
        frees: list[int] = []
        nf: NodeFrag[int] | None = None
        before = 0
        cpu_after: int | None = None

        def rank(n: Node, g: GPU, mem: int, milli: int) -> float:
            nonlocal frees, nf, before, cpu_after
            if milli >= FULL:
                return g.index  # whole GPUs: all idle ones leave the same node behind
            if nf is None:
                frees, cpu = node_state(node)
                cpu_after = None if cpu is None else cpu - pod.cpu_milli
                nf = cache.node(frees, node.model)
                before = cache.frag(nf, cpu)
            f = frees[g.index]
            return -sigmoid_score(before - cache.trial(nf, ((f, f - milli),), cpu_after)[0], total)

        return fit(node, pod, rank)

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        cache, total = self._frags()
        frees, cpu = node_state(node)
        nf = cache.node(frees, node.model)
        changes = tuple(
            (frees[idx], frees[idx] - (FULL if ex else milli)) for idx, (_, milli, ex) in f.charged.items()
        )
        cpu_after = None if cpu is None else cpu - pod.cpu_milli
        return sigmoid_score(cache.frag(nf, cpu) - cache.trial(nf, changes, cpu_after)[0], total)


# --- the workload as a file: what `gpupack extender --workload-file` is given ---------------------
WORKLOAD_FORMAT = "gpupack.io/workload/v1"
_SHAPE_FIELDS = ("count", "cpu_milli", "gpus", "milli", "mem_mib", "models", "pod_class", "spec")


class WorkloadError(ValueError):
    """A workload document that cannot be read; the message names the field and what is wrong."""


def workload_to_json(wl: Workload) -> dict[str, object]:
    """A JSON-ready document of `wl`: its shapes in its own order (which breaks popularity ties)."""
    return {
        "format": WORKLOAD_FORMAT,
        "coverage": wl.coverage,
        "by_demand": wl.by_demand,
        "shapes": [
            {
                "count": n,
                "cpu_milli": s.cpu_milli,
                "gpus": s.gpus,
                "milli": s.milli,
                "mem_mib": s.mem_mib,
                "models": None if s.models is None else sorted(s.models),
                "pod_class": s.pod_class,
                "spec": s.spec,
            }
            for s, n in wl.counts.items()
        ],
    }


def _whole(v: object, where: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WorkloadError(f"{where}: expected a whole number, got {v!r}")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise WorkloadError(f"{where}: {v} is out of range ({bound})")
    return v


def _shape(obj: object, where: str) -> tuple[Shape, int]:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_SHAPE_FIELDS))
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(_SHAPE_FIELDS)})"
        )
    for k in ("count", "cpu_milli", "gpus", "milli"):
        if k not in obj:
            raise WorkloadError(f"{where}: missing {k!r}")
    count = _whole(obj["count"], f"{where}.count", 1)
    gpus = _whole(obj["gpus"], f"{where}.gpus", 0, 64)
    milli = _whole(obj["milli"], f"{where}.milli", 0, FULL)
    if gpus and not milli:
        raise WorkloadError(
            f"{where}.milli: a shape with GPUs needs 1..{FULL} milli per GPU ({FULL}: whole GPUs)"
        )
    models = obj.get("models")
    if models is not None:
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise WorkloadError(
                f"{where}.models: expected null or a non-empty list of GPU model names, got {models!r}"
            )
        models = frozenset(models)
    pod_class = obj.get("pod_class")
    if pod_class is not None and pod_class not in ("online", "offline"):
        raise WorkloadError(f'{where}.pod_class: expected null, "online" or "offline", got {pod_class!r}')
    spec = obj.get("spec", "")
    if not isinstance(spec, str):
        raise WorkloadError(f"{where}.spec: expected a string, got {spec!r}")
    shape = Shape(
        _whole(obj["cpu_milli"], f"{where}.cpu_milli", 0),
        gpus,
        milli,
        _whole(obj.get("mem_mib", 0), f"{where}.mem_mib", 0),
        models,
        pod_class,
        spec,
    )
    return shape, count


def workload_from_json(doc: object) -> Workload:
    """The workload a :func:`workload_to_json` document describes; WorkloadError naming the field
    otherwise (unknown fields are errors too: a misspelt one would silently change the policy)."""
    if not isinstance(doc, dict):
        raise WorkloadError(
            f'expected a JSON object with "format": "{WORKLOAD_FORMAT}", got {type(doc).__name__}'
        )
    if doc.get("format") != WORKLOAD_FORMAT:
        raise WorkloadError(f"format: expected {WORKLOAD_FORMAT!r}, got {doc.get('format')!r}")
    unknown = sorted(set(doc) - {"format", "coverage", "by_demand", "shapes"})
    if unknown:
        raise WorkloadError(f"unknown field(s) {', '.join(unknown)}")
    coverage = doc.get("coverage", 0.95)
    if isinstance(coverage, bool) or not isinstance(coverage, int | float) or not 0 < coverage <= 1:
        raise WorkloadError(f"coverage: expected a number in (0, 1], got {coverage!r}")
    by_demand = doc.get("by_demand", False)
    if not isinstance(by_demand, bool):
        raise WorkloadError(f"by_demand: expected true or false, got {by_demand!r}")
    shapes = doc.get("shapes")
    if not isinstance(shapes, list) or not shapes:
        raise WorkloadError("shapes: expected a non-empty list of pod shapes")
    counts: Counter[Shape] = Counter()
    first: dict[Shape, int] = {}
    for i, obj in enumerate(shapes):
        shape, n = _shape(obj, f"shapes[{i}]")
        if shape in first:
            raise WorkloadError(f"shapes[{i}]: the same shape as shapes[{first[shape]}]")
        first[shape] = i
        counts[shape] = n
    if not any(s.gpus for s in counts):
        raise WorkloadError("shapes: none asks for a GPU (a GPU policy has nothing to pack against)")
    return Workload(counts, float(coverage), by_demand)
