"""`gpupack`: the default placement policy — fragmentation- and stranding-aware packing.

It keeps FGD's idea (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with
Fragmentation Gradient Descent", USENIX ATC 2023): a node's *fragmentation* is the free GPU
capacity that a typical arriving pod could not use there, averaged over the observed workload;
place each pod where that grows least. gpupack generalises and extends it:

1. **Memory and SM share.** A GPU can serve a pod shape only if both its free memory and its free
   SM share are enough; its free capacity is the scarcer of the two (normalised to milli), since a
   GPU with half its SMs but 5% of its memory free is 5% free in practice.
2. **Models.** A node whose GPU model a shape may not use counts all its free capacity as fragment
   for that shape (as the published FGD does), which keeps unconstrained pods off the models that
   constrained pods need.
3. **Classes.** `online` and `offline` pods never share a GPU, so a GPU holding one class is
   fragment for every shape of the other; shapes carry their class.
4. **Stranding.** FGD sees host CPU only as a step: a node becomes fragmented for a shape once its
   free CPU drops below that shape's request. Pods (CPU-only ones especially) that eat a GPU-dense
   node's CPU long before that point strand its GPUs later. gpupack adds the GPU capacity the node's
   remaining CPU cannot feed at the workload's observed CPU-per-GPU ratio,
   ``max(0, free GPU milli − free CPU × ΣGPU/ΣCPU)``, to the fragmentation it minimises: a
   placement is charged the stranding it adds, and rewarded for stranding it removes only where no
   later pod needs those GPUs more (see `gain`). On the openb trace this steers CPU-only and
   CPU-heavy pods to CPU-rich, GPU-poor nodes, and CPU-light GPU pods onto GPUs whose CPU others
   ate. The extender tracks each node's CPU (allocatable, and requested by every pod on it), so
   a cluster gets this term too.
5. **Consolidation.** Like the published FGD runs the score is a coarse integer 0..99; ties go to
   the node first in a fixed per-policy random order, so near-equal choices keep landing on the same
   nodes and idle nodes stay whole for multi-GPU pods.

6. **Eventual waste.** FGD looks one typical pod ahead. For a sharing pod gpupack also counts how
   much of the GPU it lands on will end up wasted once typical pods fill it (`waste_table`), at
   half the weight of the fragmentation term: on the GPU-sharing-heavy openb variants this pairs
   pods into GPUs they fill (gpushare60: 8.35% → 8.22%, seeds 42–43).
7. **Packing cost.** Both look-aheads above assume an unlimited supply of every pod size. The
   workload's shares, packed as a cutting-stock problem, price each size by what it is worth in
   the best packing (`gpupack.core.share_prices`); a share is charged what its placement loses
   against that packing (`SharePrices.cost`, zero where it fits one) at `PRICE_WEIGHT`, so a 320
   goes next to a 650 or onto an idle GPU rather than into the 530 a 470 leaves, whose remaining
   210 only scarce small pods could fill (openb, seeds 42–51: gpushare80 10.37% → 9.58%,
   gpushare60 8.20% → 7.57%, default 4.08% → 3.78%).

8. **CPU kept for GPUs.** Where CPU is what runs out (openb's cpu235 and cpu300 traces), a score
   alone does not save the GPUs: every CPU-only pod is placed while any node has its CPU free, and
   the CPU it takes is gone for the GPU pods that arrive later. So a pod that asks for no GPU is
   refused on a node where its CPU would strand free GPU capacity (`stranded` grows: the node's
   CPU left after it feeds fewer of its free GPUs at the learnt CPU-per-GPU ratio than before);
   it goes to nodes with CPU to spare beyond their GPUs' needs, or waits (`refuses`,
   `keep_cpu_for_gpus`). Nothing changes until the policy has seen GPU pods (no ratio), nor where
   CPU is plentiful (openb, seeds 42–51: cpu300 13.24% → 4.47%, cpu235 4.72% → 3.92%, every
   other trace as it was, decision for decision).

The workload (pod shapes and their popularity) is either given (the trace replay passes the
trace's shapes, as FGD gets them) or learnt from the pods the scheduler is shown (`observe`).
Everything is integer arithmetic so the replay's vectorised fast path
(`gpupack.simulate.fast_policy.gpupack_scores`) reproduces this per-node code's decisions exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from gpupack.core.fit import Fit, FitFailure, fit
from gpupack.core.frag import FragCache, NodeFrag, sigmoid_score
from gpupack.core.frag import fragmentation as frag_definition
from gpupack.core.model import FULL, GPU, Node, PodRequest
from gpupack.core.policy_base import WorkloadPolicy
from gpupack.core.share_prices import SharePrices, share_prices
from gpupack.core.workload import Shape, Workload

# One GPU as the policy sees it: (free milli, free memory MiB, memory size MiB, class or None, usable)
GpuView = tuple[int, int, int, "str | None", bool]


def gpu_views(node: Node) -> list[GpuView]:
    return [
        (g.free_milli, g.free_mem, g.mem_mib, g.pod_class, g.healthy and not g.exclusive) for g in node.gpus
    ]


def _amount(v: GpuView) -> int:
    milli, mem, size, _, ok = v
    if not ok:
        return 0
    return min(milli, mem * FULL // size) if size > 0 else milli


def _serves(v: GpuView, s: Shape) -> bool:
    milli, mem, _, cls, ok = v
    return (
        ok
        and milli >= s.milli
        and mem >= s.mem_mib
        and (cls is None or s.pod_class is None or cls == s.pod_class)
    )


def fragmentation(
    views: Sequence[GpuView],
    cpu_left: int | None,
    model: str,
    shapes: Sequence[Shape],
    weights: Sequence[int],
) -> int:
    """Σ_shape weight × (free GPU capacity, milli, that the shape cannot use on this node), for GPUs
    seen as views (:func:`gpupack.core.frag.fragmentation`)."""
    return frag_definition(views, cpu_left, model, shapes, weights, _amount, _serves)


def stranded(total_free: int, cpu_left: int | None, ratio: tuple[int, int]) -> int:
    """Free GPU milli the node's free CPU cannot feed at `ratio` = (ΣCPU milli, ΣGPU milli) of GPU pods."""
    cpu_sum, gpu_sum = ratio
    if cpu_left is None or cpu_sum <= 0:
        return 0
    return max(0, total_free - cpu_left * gpu_sum // cpu_sum)


def cpu_gpu_ratio(workload: Workload) -> tuple[int, int]:
    cpu = sum(n * s.cpu_milli for s, n in workload.counts.items() if s.gpus)
    gpu = sum(n * s.gpus * s.milli for s, n in workload.counts.items() if s.gpus)
    return cpu, gpu


def reserved_models(shapes: Sequence[Shape]) -> frozenset[str]:
    """GPU models some typical model-constrained GPU shape may use."""
    out: set[str] = set()
    for s in shapes:
        if s.gpus and s.models is not None:
            out |= s.models
    return frozenset(out)


def rewards_unstranding(
    cpu_cap: int, gpu_cap: int, model: str, ratio: tuple[int, int], reserved: frozenset[str]
) -> bool:
    """Whether a placement on this node is rewarded for the stranding it removes (see `gain`).

    Not on a node whose whole CPU could never feed its GPUs at `ratio` (CPU-poor models strand from
    the start and would attract every CPU-light GPU pod), nor on a model that a typical
    model-constrained shape may use: a pod constrained to it would take those GPUs later, while the
    pod placed now could go elsewhere.
    """
    cpu_sum, gpu_sum = ratio
    return cpu_sum > 0 and cpu_cap * gpu_sum // cpu_sum >= gpu_cap and model not in reserved


# The eventual-waste term weighs half as much as the fragmentation term: both measure the same
# holes (FGD one pod ahead, this one until the GPU is full), and at full weight it overrides
# FGD's steering of whole-GPU and multi-GPU capacity (docs/simulate.md: 1, 1/2 and 1/4 compared).
WASTE_WEIGHT = 0.5


def waste_table(shapes: Sequence[Shape], weights: Sequence[int]) -> tuple[float, ...]:
    """Expected milli a GPU with `v` free (0..FULL) ends up wasting, index v.

    The GPU is filled by typical pods drawn by popularity among those that fit what is left, until
    none fits; what is left then is waste. Per-GPU view: a whole-GPU or multi-GPU shape takes a
    GPU only when it is entirely free.
    """
    by_milli: dict[int, int] = {}
    for s, x in zip(shapes, weights, strict=True):
        if s.gpus:
            by_milli[s.milli] = by_milli.get(s.milli, 0) + x
    sizes = sorted(by_milli)
    phi = [0.0] * (FULL + 1)
    for v in range(FULL + 1):
        num = den = 0.0
        for m in sizes:
            if m > v:
                break
            num += by_milli[m] * phi[v - m]
            den += by_milli[m]
        phi[v] = num / den if den else float(v)
    return tuple(phi)


def waste_gain(phi: Sequence[float], weight: int, before: int, after: int) -> float:
    """`weight`-scaled eventual waste removed by taking a share: (before − after) free milli."""
    return WASTE_WEIGHT * weight * (phi[before] - phi[after])


# The packing cost of a share (`SharePrices.cost`, micro-GPUs) weighs ten milli of fragmentation per
# milli-GPU lost: at that weight it decides wherever it is not zero, and the other terms choose
# among the placements that lose nothing (docs/simulate.md: 0.25 to 20 and ordering by the cost
# first compared; the gain grows up to 10, and 10, 20 and cost-first are alike).
PRICE_WEIGHT = 10


def price_loss(weight: int, cost: int) -> int:
    """`weight`-scaled fragmentation equivalent of a share's packing cost of `cost` micro-GPUs."""
    return PRICE_WEIGHT * weight * cost // 1000


def share_size(milli: int, mem_mib: int, gpu_mem_mib: int) -> int:
    """What a share of `milli` SM and `mem_mib` memory takes from an idle GPU of `gpu_mem_mib`, as
    `_amount` counts it: the scarcer of the two."""
    idle: GpuView = (FULL, gpu_mem_mib, gpu_mem_mib, None, True)
    return FULL - _amount(_take(idle, mem_mib, milli, ""))


def share_counts(counts: Mapping[Shape, int], pod_class: str | None, gpu_mem_mib: int) -> dict[int, int]:
    """Share size on a GPU of `gpu_mem_mib` -> how many shares of that size the workload's pods ask
    for, over the shapes a `pod_class` GPU can hold (that class's and classless ones); a share too
    big for that GPU is left out."""
    out: dict[int, int] = {}
    for s, n in counts.items():
        if not s.gpus or s.milli >= FULL or (s.pod_class is not None and s.pod_class != pod_class):
            continue
        size = share_size(s.milli, s.mem_mib, gpu_mem_mib)
        if 0 < size < FULL:
            out[size] = out.get(size, 0) + n * s.gpus
    return out


def _outgrown(at: tuple[int, int] | None, workload: Workload, part: int) -> bool:
    """Whether a table built at `at` = (workload id, version) is due again: another workload, or
    this one grown by more than 1/`part` (and 16 pods) since."""
    return at is None or at[0] != id(workload) or workload._version - at[1] > max(16, workload.total // part)


class _Prepared:
    """What the policy derives from one workload version, once: the workload's weight, the CPU-per-GPU
    ratio, the fragmentation of the node states seen, and `rewards_unstranding` per kind of node."""

    __slots__ = ("key", "total", "ratio", "frags", "rewards")

    def __init__(self, key: tuple[int, int, bool], workload: Workload, ratio: tuple[int, int]) -> None:
        self.key = key
        self.total = workload.total
        self.ratio = ratio
        self.frags: FragCache[GpuView] = FragCache(*workload.typical(), _amount, _serves)
        self.rewards: dict[tuple[int, int, str], bool] = {}

    def state(self, nf: NodeFrag[GpuView], cpu_left: int | None) -> tuple[int, int]:
        """(fragmentation, stranded milli) of node state `nf` with `cpu_left` free CPU."""
        return self.frags.frag(nf, cpu_left), stranded(nf.total, cpu_left, self.ratio)

    def trial(
        self, nf: NodeFrag[GpuView], changes: tuple[tuple[GpuView, GpuView], ...], cpu_left: int | None
    ) -> tuple[int, int]:
        """(fragmentation, stranded milli) of `nf` after `changes` (FragCache.trial)."""
        frag, total = self.frags.trial(nf, changes, cpu_left)
        return frag, stranded(total, cpu_left, self.ratio)


class KeptScore(NamedTuple):
    """What a fit on one shared GPU worked out of its node score (Fit.score_memo), and what it
    depends on: the policy's prepared tables, the node state (its NodeFrag), `_score_inputs`, the
    waste table, the share prices of that GPU's size, and the size itself."""

    prep: _Prepared
    nf: NodeFrag[GpuView]
    inputs: tuple[int | None, int, int, str]
    waste: tuple[float, ...]
    prices: SharePrices
    gpu_mem_mib: int
    score: float


class GpupackPolicy(WorkloadPolicy):
    name = "gpupack"

    def __init__(
        self, seed: int = 0, workload: Workload | None = None, keep_cpu_for_gpus: bool = True
    ) -> None:
        super().__init__(seed, workload)
        self._prep: _Prepared | None = None
        # 8. in the module's doc: pods asking for no GPU are refused where they would strand GPUs
        self.keep_cpu_for_gpus = keep_cpu_for_gpus

    @property
    def ratio(self) -> tuple[int, int]:
        key = (id(self.workload), self.workload._version)
        if getattr(self, "_ratio_key", None) != key:
            self._ratio_key, self._ratio = key, cpu_gpu_ratio(self.workload)
        return self._ratio

    @property
    def reserved(self) -> frozenset[str]:
        key = (id(self.workload), self.workload._version)
        if getattr(self, "_reserved_key", None) != key:
            self._reserved_key, self._reserved = key, reserved_models(self.workload.typical()[0])
        return self._reserved

    def _prepared(self) -> _Prepared:
        wl = self.workload
        key = (id(wl), wl._version, wl.by_demand)
        prep = self._prep
        if prep is None or prep.key != key:
            prep = self._prep = _Prepared(key, wl, self.ratio)
        return prep

    def _rewards(self, prep: _Prepared, node: Node, cpu: int | None) -> bool:
        if cpu is None:
            return False
        key = (node.cpu_milli, len(node.gpus), node.model)
        hit = prep.rewards.get(key)
        if hit is None:
            hit = prep.rewards[key] = rewards_unstranding(
                node.cpu_milli, len(node.gpus) * FULL, node.model, self.ratio, self.reserved
            )
        return hit

    @property
    def waste(self) -> tuple[float, ...]:
        # A learnt workload changes with every pod; the table (a few ms to build) follows it once
        # the workload has grown by 1/64 since, which moves its popularity weights very little.
        wl = self.workload
        if _outgrown(getattr(self, "_waste_at", None), wl, 64):
            self._waste_at, self._waste = (id(wl), wl._version), waste_table(*wl.typical())
        return self._waste

    def prices(self, pod_class: str | None, gpu_mem_mib: int) -> SharePrices:
        """The share prices for a `pod_class` pod on a GPU of `gpu_mem_mib` (`share_prices`).

        Solved from a copy of the workload's counts taken when the tables were last reset: the
        prices of a learnt workload move little (the same on every openb variant), and one solve
        is ~20-30 ms, so they follow it once it has grown by 1/16 since."""
        wl = self.workload
        if _outgrown(getattr(self, "_prices_at", None), wl, 16):
            self._prices_at = (id(wl), wl._version)
            self._prices_counts: dict[Shape, int] = dict(wl.counts)
            self._prices: dict[tuple[str | None, int], SharePrices] = {}
            self._prices_solved: dict[tuple[tuple[int, int], ...], SharePrices] = {}
        key = (pod_class, gpu_mem_mib)
        hit = self._prices.get(key)
        if hit is None:
            counts = share_counts(self._prices_counts, pod_class, gpu_mem_mib)
            # GPUs of another memory size give the same sizes for shapes without a memory request
            same = tuple(sorted(counts.items()))
            hit = self._prices_solved.get(same)
            if hit is None:
                hit = self._prices_solved[same] = share_prices(counts)
            self._prices[key] = hit
        return hit

    def _state(self, views: Sequence[GpuView], cpu_left: int | None, model: str) -> tuple[int, int]:
        """(fragmentation, stranded milli) of a node state. Memoised: many nodes share a state."""
        prep = self._prepared()
        return prep.state(prep.frags.node(views, model), cpu_left)

    def _score(
        self,
        total: int,
        before: tuple[int, int],
        after: tuple[int, int],
        shares: Sequence[tuple[int, int, SharePrices]],
        reward: bool,
    ) -> int:
        """`total`: the workload's weight; `shares`: (free amount before, after, the share prices
        for that GPU) of each GPU the pod shares (not whole GPUs); `reward`: whether removed
        stranding counts on this node (`rewards_unstranding`)."""
        dec = gain(before, after, total, reward)
        # The waste table is read only for a share, as it always was: reading it may rebuild it,
        # and when it is rebuilt decides the table later scores use.
        for a0, a1, prices in shares:
            dec += int(waste_gain(self.waste, total, a0, a1)) - price_loss(total, prices.cost(a0, a1))
        return sigmoid_score(dec, total)

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        prep = self._prepared()
        cls = pod.pod_class
        # Only a share is ranked by the state it leaves: the node's state is read at the first
        # share ranked (fit changes nothing before), so whole-GPU pods and nodes with no candidate
        # GPU never build it.
        views: list[GpuView] = []
        nf: NodeFrag[GpuView] | None = None
        before = (0, 0)
        cpu_after: int | None = None
        reward = False
        waste: tuple[float, ...] = ()
        prices: dict[int, SharePrices] = {}  # by GPU memory size: the workload holds during a fit
        # A rank depends on the GPU only through its view: equal GPUs (the idle ones of a node, say)
        # are ranked once a fit. (view, share) -> rank
        ranked: dict[tuple[GpuView, int, int], float] = {}

        def rank(n: Node, g: GPU, mem: int, milli: int) -> float:
            nonlocal views, nf, before, cpu_after, reward, waste
            if milli >= FULL:
                return g.index  # whole GPUs: any idle one leaves the same node behind
            if nf is None:
                views = gpu_views(node)
                cpu = node.free_cpu if node.cpu_milli else None
                cpu_after = None if cpu is None else cpu - pod.cpu_milli
                nf = prep.frags.node(views, node.model)
                before = prep.state(nf, cpu)
                reward = self._rewards(prep, node, cpu)
                waste = self.waste
            v = views[g.index]
            hit = ranked.get((v, mem, milli))
            if hit is not None:
                return hit
            t = _take(v, mem, milli, cls)
            after = prep.trial(nf, ((v, t),), cpu_after)
            total = prep.total
            a0, a1 = nf.amounts[g.index], _amount(t)
            p = prices.get(v[2])
            if p is None:
                p = prices[v[2]] = self.prices(cls, v[2])
            dec = (
                gain(before, after, total, reward)
                + int(waste_gain(waste, total, a0, a1))
                - price_loss(total, p.cost(a0, a1))
            )
            key = ranked[(v, mem, milli)] = -sigmoid_score(dec, total)
            return key

        r = fit(node, pod, rank)
        if r.__class__ is Fit and not r.charged:
            refused = self.refuses(node, pod)
            if refused is not None:
                return refused
        if r.__class__ is Fit and len(r.charged) == 1 and nf is not None:
            # One shared GPU: the rank that chose it is its node score (node_score's formula for
            # that one change), kept with the node state and tables it was worked out under.
            ((idx, (mem, milli, ex)),) = r.charged.items()
            key = None if ex else ranked.get((views[idx], mem, milli))
            if key is not None:
                size = views[idx][2]
                kept = KeptScore(prep, nf, _score_inputs(node, pod), waste, prices[size], size, -key)
                return Fit(r.placement, r.charged, kept)
        return r

    def refuses(self, node: Node, pod: PodRequest) -> FitFailure | None:
        """A pod asking for no GPU, on a node whose free CPU it would leave short of feeding the
        node's free GPUs at the workload's CPU-per-GPU ratio (more `stranded` after it than
        before): refused, unresolvable (evicting pods there frees GPUs as well, whose CPU is then
        kept too). Gauged exactly as the score's stranding term (the node's GPUs seen as views),
        so the replay's fast path (`fast_policy.gpupack_scores`) refuses the same nodes."""
        if not self.keep_cpu_for_gpus or pod.needs_gpu or not node.gpus or not node.cpu_milli:
            return None
        ratio = self.ratio
        if ratio[0] <= 0 or ratio[1] <= 0:
            return None  # no GPU pod seen yet: nothing to keep CPU for
        cpu = node.free_cpu
        total = self._prepared().frags.node(gpu_views(node), node.model).total
        added = stranded(total, cpu - pod.cpu_milli, ratio) - stranded(total, cpu, ratio)
        if added <= 0:
            return None
        per_gpu = ratio[0] * FULL // ratio[1]
        return FitFailure(
            f"node {node.name}: its free CPU is kept for its free GPUs ({pod.cpu_milli}m of its {cpu}m "
            f"free would leave {added / FULL:.2f} GPU(s) without the {per_gpu}m CPU per GPU the GPU pods "
            "seen ask for); a pod asking for no GPU goes where CPU is to spare",
            "cpu-kept-for-gpus",
            True,
        )

    def _still_holds(self, prep: _Prepared, kept: KeptScore, pod: PodRequest) -> bool:
        """Whether a kept score's pod side and tables are this pod's and the policy's now. The
        waste table and the prices are read last, as the full computation reads them (reading may
        rebuild them)."""
        return (
            kept.prep is prep
            and kept.inputs[2:] == (pod.cpu_milli, pod.pod_class)
            and self.waste is kept.waste
            and self.prices(pod.pod_class, kept.gpu_mem_mib) is kept.prices
        )

    def kept_score(self, pod: PodRequest, f: Fit) -> float | None:
        # The node's side (its NodeFrag, free and allocatable CPU) is the caller's to vouch for.
        kept = f.score_memo
        if isinstance(kept, KeptScore) and self._still_holds(self._prepared(), kept, pod):
            return kept.score
        return None

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        prep = self._prepared()
        views = gpu_views(node)
        cpu = node.free_cpu if node.cpu_milli else None
        nf = prep.frags.node(views, node.model)
        kept = f.score_memo
        if (
            isinstance(kept, KeptScore)
            and kept.nf is nf
            and kept.inputs[:2] == _score_inputs(node, pod)[:2]
            and self._still_holds(prep, kept, pod)
        ):
            # `fit` worked this score out on this node state for this pod, under these tables
            return kept.score
        changes = []
        shares = []
        cls = pod.pod_class
        for idx, (mem, milli, ex) in f.charged.items():
            v = views[idx]
            t = (0, 0, v[2], cls, v[4]) if ex else _take(v, mem, milli, cls)
            changes.append((v, t))
            if not ex:
                shares.append((nf.amounts[idx], _amount(t), self.prices(cls, v[2])))
        cpu_after = None if cpu is None else cpu - pod.cpu_milli
        return self._score(
            prep.total,
            prep.state(nf, cpu),
            prep.trial(nf, tuple(changes), cpu_after),
            shares,
            self._rewards(prep, node, cpu),
        )


def gain(before: tuple[int, int], after: tuple[int, int], weight: int, reward: bool) -> int:
    """What a placement gains: the fragmentation it removes, minus the stranding it adds, plus the
    stranding it removes where `reward` (`rewards_unstranding`).

    A CPU-light GPU pod on a node whose free CPU can no longer feed its free GPUs uses GPUs that
    would otherwise stay idle; rewarding that matters where CPU runs short (openb cpu300, seeds
    42–44: 13.87% → 13.22% unallocated; cpu235: 5.02% → 4.87%). Rewarded on every node, it pulls
    pods onto CPU-poor models from the start (gpuspec25 at a quarter of the weight: 5.27% → 6.44%)
    and onto models that model-constrained pods need (excluding only CPU-poor nodes: 5.48%);
    `rewards_unstranding` leaves both out.
    """
    removed = before[1] - after[1]
    return (before[0] - after[0]) + weight * (removed if reward else min(0, removed))


def _score_inputs(node: Node, pod: PodRequest) -> tuple[int | None, int, int, str]:
    """What a share's score depends on besides the node's GPU views (its NodeFrag) and the
    policy's tables: the node's free and allocatable CPU, the pod's CPU and class. A kept score
    (Fit.score_memo) serves only where these are the ones it was worked out with."""
    return (node.free_cpu if node.cpu_milli else None, node.cpu_milli, pod.cpu_milli, pod.pod_class)


def _take(v: GpuView, mem: int, milli: int, cls: str) -> GpuView:
    return (v[0] - milli, v[1] - mem, v[2], cls, v[4])
