"""The workload a fragmentation-aware policy packs against: pod shapes and their popularity.

A :class:`Shape` is what one kind of pod asks for; a :class:`Workload` counts the shapes seen (or
given) and names the typical ones, those covering most pods (`typical`). Both fragmentation
policies (:mod:`gpupack.core.fgd`, :mod:`gpupack.core.gpupack_policy`) and the simulator read these
types; the workload travels as a JSON document (`workload_to_json`, `gpupack extender
--workload-file`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpupack.core.model import FULL, PodRequest


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


# Distinct pod shapes a learnt workload keeps (see Workload.max_shapes). The openb traces' pods
# come in 80-312 shapes; every field of a shape is the pod author's to choose (a GPU memory request
# of 1..N MiB makes N shapes), and without a bound one tenant could grow the mix, and the work of
# every policy table built from it, without end.
LEARNT_SHAPES_MAX = 1024


class Workload:
    """Popularity of pod shapes; `typical()` keeps the most popular ones covering `coverage` of pods.

    Weights stay integer counts; `total` counts every pod seen and `kept` the pods of the typical
    shapes, by which the published simulator renormalises their weights (FGD scales its score by
    it).

    `max_shapes` (None: no bound): once `add` makes more distinct shapes than this, the least
    popular ones are forgotten until half of them are left (the most popular first, ties to the one
    seen first, as `typical` ranks them), so a flood of one-off shapes cannot push out the shapes
    the workload is made of, and the cost of that pruning is spread over the many adds after it.
    """

    def __init__(
        self,
        counts: Counter[Shape] | None = None,
        coverage: float = 0.95,
        by_demand: bool = False,
        max_shapes: int | None = None,
    ) -> None:
        self.counts: Counter[Shape] = Counter(counts or {})
        self.max_shapes = max_shapes
        self.forgotten = 0  # shapes dropped by the bound (tests, the extender's log)
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
        if self.max_shapes is not None and len(self.counts) > self.max_shapes:
            self._forget_least()

    def _forget_least(self) -> None:
        assert self.max_shapes is not None
        ranked = sorted(self.counts.items(), key=lambda kv: -self.weight(*kv))  # stable: first seen first
        keep = {s for s, _ in ranked[: max(1, self.max_shapes // 2)]}
        self.forgotten += len(self.counts) - len(keep)
        self.counts = Counter({s: n for s, n in self.counts.items() if s in keep})  # first-seen order kept

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
