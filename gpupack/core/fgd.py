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

Scores are integers 0..100, ``int(100 * sigmoid(decrease / 1000))`` as in the published simulator
(:func:`gpupack.core.frag.sigmoid_score`), so many nodes tie; :func:`gpupack.core.policies.schedule`
breaks ties with the policy's seeded RNG. The workload types and the fragmentation definition both
fragmentation policies share are in :mod:`gpupack.core.workload` and :mod:`gpupack.core.frag`.

Fragmentation is kept as an integer (shape counts × milli) so that the trace replay's vectorised
fast path and this per-node code compute bit-identical scores.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpupack.core.fit import Fit, FitFailure, fit
from gpupack.core.frag import SIGMOID_STEPS, FragCache, NodeFrag, fragmentation, sigmoid_score
from gpupack.core.model import FULL, GPU, Node, PodRequest
from gpupack.core.policy_base import WorkloadPolicy
from gpupack.core.workload import (
    WORKLOAD_FORMAT,
    Shape,
    Workload,
    WorkloadError,
    shape_of,
    workload_from_json,
    workload_to_json,
)

# Where these names were first defined: the extender and older callers import them from here.
__all__ = [
    "SIGMOID_STEPS",
    "WORKLOAD_FORMAT",
    "FGDPolicy",
    "FragCache",
    "Shape",
    "Workload",
    "WorkloadError",
    "frag",
    "node_state",
    "shape_of",
    "sigmoid_score",
    "workload_from_json",
    "workload_to_json",
]


def node_state(node: Node) -> tuple[list[int], int | None]:
    """Free milli per GPU (an unhealthy GPU has none) and free CPU (None when CPU is not tracked)."""
    frees = [g.free_milli if g.healthy else 0 for g in node.gpus]
    return frees, (node.free_cpu if node.cpu_milli else None)


def frag(
    frees: Sequence[int], cpu_left: int | None, model: str, shapes: Sequence[Shape], weights: Sequence[int]
) -> int:
    """Expected fragmentation × pod count: Σ_shape count × (free milli that shape cannot use here),
    for GPUs seen as their free milli (:func:`gpupack.core.frag.fragmentation`)."""
    return fragmentation(frees, cpu_left, model, shapes, weights, _free, _takes)


def _free(f: int) -> int:
    return f


def _takes(f: int, s: Shape) -> bool:
    return f >= s.milli


def after(
    frees: Sequence[int], cpu_left: int | None, pod: PodRequest, charged: dict[int, tuple[int, int, bool]]
) -> tuple[list[int], int | None]:
    out = list(frees)
    for idx, (_, milli, ex) in charged.items():
        out[idx] -= FULL if ex else milli
    return out, (None if cpu_left is None else cpu_left - pod.cpu_milli)


class FGDPolicy(WorkloadPolicy):
    """The `fgd` policy; registered in :mod:`gpupack.core.policies`.

    `workload`: the target workload (the replay passes the trace's shapes). Without one the policy
    learns it from the pods it is shown through `observe`, which is what a live scheduler does.
    """

    name = "fgd"

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed, workload)
        self._frag_cache: tuple[tuple[int, int, bool], FragCache[int], int] | None = None

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
