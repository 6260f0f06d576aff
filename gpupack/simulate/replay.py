"""Replay the openb trace exactly as docs/simulate.md ("Replay rules") describes.

Two code paths take the same decisions:
- :func:`replay` — the fast path: the cluster as numpy arrays, per node cached fragmentation
  aggregates (per target shape: GPUs that fit it, free milli it cannot use), only the changed node
  recomputed after a placement, every candidate (node, distinct GPU free value) scored at once.
- :func:`replay_generic` — the same replay through :func:`gpupack.core.policies.schedule`, the
  per-node policy code the extender runs. Slow; tests check both agree on a reduced replay.

Both break score ties with the policy's seeded `random.Random` (one draw, only when tied).
"""

from __future__ import annotations

import importlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpupack.core.model import FULL, GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policies import Policy, policy_spec, schedule
from gpupack.core.workload import Shape, Workload
from gpupack.simulate.fast_policy import NO_FIT, random_draw
from gpupack.simulate.openb import DEFAULT_GPU_MEM_MIB, GPU_MEM_MIB, NodeList, PodList

INFLATE_TO = 1.30  # arrived GPU request, as a share of capacity
BINS = 131  # 0..130 % of capacity


def arrival_order(pods: PodList, capacity: int, seed: int) -> np.ndarray:
    """Seeded permutation, then uniform draws with replacement until 130% of capacity would pass."""
    rng = np.random.default_rng(seed)
    req = pods.gpu_request
    limit = INFLATE_TO * capacity
    order = list(rng.permutation(len(pods)))
    total = int(req.sum())
    if total > limit:
        # Remove random pods until the trace is within the limit.
        keep = np.ones(len(order), bool)
        for i in rng.permutation(len(order)):
            if total <= limit:
                break
            if req[order[i]]:
                keep[i] = False
                total -= int(req[order[i]])
        return np.asarray(order, np.int64)[keep]
    extra = []
    while True:
        i = int(rng.integers(len(pods)))
        if total + req[i] > limit:
            break
        total += int(req[i])
        extra.append(i)
    return np.asarray(order + extra, np.int64)


def trace_workload(pods: PodList, coverage: float = 0.95) -> Workload:
    """The target workload FGD uses: shapes of the ORIGINAL trace (before inflation).

    As the published simulator builds it: a shape is keyed by the `gpu_spec` text, and shapes of
    equal count rank by (CPU, per-GPU milli, GPU count, spec text), largest first.
    """
    text = pods.spec_text or ["|".join(sorted(s)) if s else "" for s in pods.spec]
    counts: Counter[Shape] = Counter(
        Shape(int(c), int(n), int(m), 0, s, None, t if n else "")
        for c, n, m, s, t in zip(pods.cpu, pods.num_gpu, pods.gpu_milli, pods.spec, text, strict=True)
    )
    ranked = sorted(
        counts.items(),
        key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].milli, kv[0].gpus, kv[0].spec),
        reverse=True,
    )
    return Workload(Counter(dict(ranked)), coverage)


@dataclass
class ReplayResult:
    policy: str
    seed: int
    curve: list[float | None]  # allocation ratio % per arrived-request bin 0..130 (None: no event)
    arrived: int
    placed: int
    failed_gpu_milli: int
    decisions: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (node, gpus) or (-1, ())
    # Steps where a random draw among equally scored nodes decided (pipeline mode: kube-scheduler's).
    tied: list[int] = field(default_factory=list)

    @property
    def unallocated_pct_at_100(self) -> float:
        v = self.curve[100]
        return float("nan") if v is None else 100.0 - v


class Curve:
    """Allocation ratio binned by arrived request. A bin the arrived load jumped over (a tiny
    cluster, a big pod) takes the state after the last arrival before it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sums = np.zeros(BINS)
        self.counts = np.zeros(BINS, np.int64)
        self.last = np.full(BINS, np.nan)

    def add(self, arrived: int, allocated: int) -> None:
        b = arrived * 100 // self.capacity
        if b < BINS:
            v = allocated * 100 / self.capacity
            self.sums[b] += v
            self.counts[b] += 1
            self.last[b] = v

    def values(self) -> list[float | None]:
        out: list[float | None] = []
        carry = 0.0
        top = int(np.nonzero(self.counts)[0].max()) if self.counts.any() else -1
        for b in range(BINS):
            if self.counts[b]:
                out.append(float(self.sums[b] / self.counts[b]))
                carry = float(self.last[b])
            else:
                out.append(carry if b < top else None)
        return out


class FastCluster:
    """The openb cluster as arrays, with per-shape fragmentation aggregates cached per node."""

    def __init__(self, nodes: NodeList, workload: Workload) -> None:
        self.n = len(nodes)
        self.g = max(1, int(nodes.gpus.max()))
        self.models = sorted(set(nodes.model))
        mindex = {m: i for i, m in enumerate(self.models)}
        self.model = np.array([mindex[m] for m in nodes.model], np.int64)
        self.ngpu = nodes.gpus.copy()
        self.cpu_cap = nodes.cpu.copy()
        self.cpu = nodes.cpu.copy()
        self.ram = nodes.ram.copy()
        self.free = np.zeros((self.n, self.g), np.int64)  # missing GPUs look fully used
        for i, k in enumerate(self.ngpu):
            self.free[i, :k] = FULL
        self.gpu_cap = self.ngpu * FULL
        shapes, weights = workload.typical()
        self.total_w = workload.total
        self.kept_w = sum(weights)  # FGD's score scale: the typical shapes' weights renormalised
        self.s_cpu = np.array([s.cpu_milli for s in shapes], np.int64)
        self.s_num = np.array([s.gpus for s in shapes], np.int64)
        # A CPU-only shape never "fits" in the fragmentation sense (all free GPU milli is fragment).
        self.s_milli = np.array([s.milli if s.gpus else FULL + 1 for s in shapes], np.int64)
        self.w = np.array(weights, np.int64)
        allowed = np.array([[s.models is None or m in s.models for s in shapes] for m in self.models], bool)
        allowed = allowed.reshape(len(self.models), len(shapes))
        gpu_shape = self.s_num > 0
        self.access = allowed & gpu_shape  # the shape can use this model's GPUs
        self.cnt = np.zeros((self.n, len(shapes)), np.int64)
        self.part = np.zeros((self.n, len(shapes)), np.int64)
        self.tot = np.zeros(self.n, np.int64)
        self.frag = np.zeros(self.n, np.int64)
        self._refresh(np.arange(self.n))
        # How many GPUs have each free milli value (0..FULL): global gap statistics for packing.
        self.gaps = np.bincount(self.free[self.free > 0].ravel(), minlength=FULL + 1).astype(np.int64)
        self.gaps[0] = 0

    def _refresh(self, idx: np.ndarray) -> None:
        f = self.free[idx]  # (k, G)
        ge = f[:, :, None] >= self.s_milli[None, None, :]  # (k, G, S)
        self.cnt[idx] = ge.sum(1)
        self.part[idx] = (f[:, :, None] * ~ge).sum(1)
        self.tot[idx] = f.sum(1)
        self.frag[idx] = self._frag(idx, self.cnt[idx], self.part[idx], self.tot[idx], self.cpu[idx])

    def _frag(self, idx, cnt, part, tot, cpu) -> np.ndarray:
        m = self.model[idx]
        q3 = self.access[m] & (cnt >= self.s_num) & (cpu[:, None] >= self.s_cpu)
        # A shape that may not use this model ("no access") counts all free milli, as published.
        return (np.where(q3, part, tot[:, None]) * self.w).sum(1)

    def frag_after(
        self, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int, cpu: int
    ) -> np.ndarray:
        """Fragmentation of nodes `idx` after taking `milli` from a GPU with `f` free, or `whole` idle GPUs."""
        cnt = self.cnt[idx]
        part = self.part[idx]
        tot = self.tot[idx]
        if f is not None:
            sm = self.s_milli
            r = f - milli
            fc, rc = f[:, None], r[:, None]
            cnt = cnt - (fc >= sm) + (rc >= sm)
            part = part - fc * (fc < sm) + rc * (rc < sm)
            tot = tot - milli
        elif whole:
            cnt = cnt - whole * (self.s_milli <= FULL)
            tot = tot - whole * FULL
        return self._frag(idx, cnt, part, tot, self.cpu[idx] - cpu)

    def take(self, n: int, gpus: tuple[int, ...], milli: int, cpu: int, ram: int) -> None:
        for j in gpus:
            f = self.free[n, j]
            self.gaps[f] -= 1
            self.free[n, j] = f - milli
            self.gaps[f - milli] += 1
        self.cpu[n] -= cpu
        self.ram[n] -= ram
        self._refresh(np.array([n]))


def _first_per_value(free: np.ndarray) -> np.ndarray:
    """Mask of GPUs that are the first on their node with their free value (equal GPUs are alike)."""
    g = free.shape[1]
    eq = free[:, :, None] == free[:, None, :]
    earlier = np.tril(np.ones((g, g), bool), -1)  # [j, j'] with j' < j
    return ~(eq & earlier[None]).any(2)


def _group_best(
    score: np.ndarray, inner: np.ndarray | None, groups: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per group (one node's candidates, consecutive): max score and the first candidate reaching it
    (among those, the highest `inner` in-node preference first)."""
    best = np.maximum.reduceat(score, starts)
    hit = score == best[groups]
    if inner is not None:
        masked = np.where(hit, inner, np.iinfo(np.int64).min)
        hit &= inner == np.maximum.reduceat(masked, starts)[groups]
    first = np.full(len(starts), -1)
    hit_idx = np.nonzero(hit)[0]
    g_of = groups[hit_idx]
    uniq, pos = np.unique(g_of, return_index=True)
    first[uniq] = hit_idx[pos]
    return best, first


# Scorers: given the cluster, the feasible candidates and the pod, return one score per candidate
# (higher first), optionally with a second array: the in-node GPU preference among equal scores.
# A policy's registry entry names its scorer (PolicySpec.fast_scorer; gpupack.simulate.fast_policy).
Scorer = Callable[..., "np.ndarray | tuple[np.ndarray, np.ndarray]"]


class NotReplayable(ValueError):
    """A policy the trace replay cannot run as itself: its registry entry names no vectorised
    scorer (PolicySpec.fast_scorer)."""


def _fast_scorer(name: str, policy: Policy) -> Scorer | None:
    """The replay's scorer for `policy`, from its registry entry; None for `random`, which the
    replay draws itself (every feasible node alike, then a uniform draw)."""
    ref = policy_spec(name).fast_scorer
    if ref is None:
        raise NotReplayable(
            f"policy {name!r} has no vectorised scorer for the trace replay (its PolicySpec.fast_scorer "
            "is None), so the replay would not be this policy's; give it one (docs/architecture.md, "
            '"Adding a policy"), or run it through the pipeline mode or the churn replay'
        )
    module, _, attr = ref.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if fn is random_draw:
        return None

    def scorer(cl, idx, f, milli, whole, cpu):
        return fn(policy, cl, idx, f, milli, whole, cpu)

    scorer.global_sharing = getattr(fn, "global_sharing", False)  # type: ignore[attr-defined]
    return scorer


class _ShapeCache:
    """Per pod shape: every node's best score and GPU, valid while the node's version is unchanged.

    A node's score depends only on its own state and the pod's shape, and one placement changes
    one node, so each arrival re-scores just the nodes changed since this shape was last seen.
    """

    __slots__ = ("score", "gpu", "ver")

    def __init__(self, n: int) -> None:
        self.score = np.full(n, NO_FIT, np.int64)
        self.gpu = np.zeros(n, np.int64)
        self.ver = np.full(n, -1, np.int64)


def _evaluate(
    cl: FastCluster, rows: np.ndarray, scorer: Scorer | None, model_ok: np.ndarray, pod: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """Best score (NO_FIT when infeasible) and chosen GPU of nodes `rows` for one pod shape."""
    cpu, ram, num, milli = pod
    score = np.full(len(rows), NO_FIT, np.int64)
    gpu = np.zeros(len(rows), np.int64)
    ok = (cl.cpu[rows] >= cpu) & (cl.ram[rows] >= ram) & model_ok[cl.model[rows]]
    if num == 1 and milli < FULL:
        fr = cl.free[rows]
        fits = (fr >= milli) & ok[:, None]
        if scorer is None:
            score[fits.any(1)] = 0
            return score, gpu
        rn, cj = np.nonzero(fits & _first_per_value(fr))
        if len(rn):
            out = scorer(cl, rows[rn], fr[rn, cj], milli, 0, cpu)
            sc, inner = out if isinstance(out, tuple) else (out, None)
            starts = np.r_[0, np.nonzero(np.diff(rn))[0] + 1]
            groups = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(rn)]))
            best, first = _group_best(sc, inner, groups, starts)
            score[rn[starts]] = best
            gpu[rn[starts]] = cj[first]
        return score, gpu
    if num:
        ok &= (cl.free[rows] == FULL).sum(1) >= num
    hit = np.nonzero(ok)[0]
    if len(hit):
        if scorer is None:
            score[hit] = 0
        else:
            out = scorer(cl, rows[hit], None, 0, num, cpu)
            score[hit] = out[0] if isinstance(out, tuple) else out
    return score, gpu


def _setup(
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    seed: int,
    order: np.ndarray | None,
    workload: Workload | None,
) -> tuple[np.ndarray, Workload, Policy]:
    """What both replay paths start from: the seeded arrival order and the policy, which for the
    fragmentation policies is given the trace's workload instead of learning it."""
    if order is None:
        order = arrival_order(pods, nodes.gpu_capacity, seed)
    if workload is None:
        workload = trace_workload(pods)
    return order, workload, policy_spec(policy_name).make(seed, workload)


def replay(
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    seed: int,
    order: np.ndarray | None = None,
    workload: Workload | None = None,
    keep_decisions: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """One fast replay of `pods` on `nodes` with one policy and seed."""
    capacity = nodes.gpu_capacity
    order, workload, policy = _setup(nodes, pods, policy_name, seed, order, workload)
    rng: random.Random = policy.rng
    policy.rank_nodes(nodes.names)
    tie_key = np.array([policy.tie_key[n] for n in nodes.names])
    scorer = _fast_scorer(policy_name, policy)
    cl = FastCluster(nodes, workload)
    spec_mask: dict[frozenset[str] | None, np.ndarray] = {}
    caches: dict[tuple, _ShapeCache] = {}
    ver = np.zeros(cl.n, np.int64)
    curve = Curve(capacity)
    arrived = allocated = placed = failed = 0
    decisions: list[tuple[int, tuple[int, ...]]] = []
    gidx = np.arange(cl.g)
    for step, p in enumerate(order):
        cpu, ram, num, milli = (
            int(pods.cpu[p]),
            int(pods.ram[p]),
            int(pods.num_gpu[p]),
            int(pods.gpu_milli[p]),
        )
        spec = pods.spec[p]
        req = num * milli
        arrived += req
        mm = spec_mask.get(spec)
        if mm is None:
            mm = spec_mask[spec] = np.array([spec is None or m in spec for m in cl.models], bool)
        key = (cpu, ram, num, milli, spec)
        cache = caches.get(key)
        if cache is None:
            cache = caches[key] = _ShapeCache(cl.n)
        if scorer is not None and getattr(scorer, "global_sharing", False) and num == 1 and milli < FULL:
            cache.ver[:] = -1  # the score depends on cluster-wide state: re-score every node
        dirty = np.nonzero(cache.ver != ver)[0]
        if len(dirty):
            cache.score[dirty], cache.gpu[dirty] = _evaluate(cl, dirty, scorer, mm, (cpu, ram, num, milli))
            cache.ver[dirty] = ver[dirty]
        sharing = num == 1 and milli < FULL
        top = cache.score.max()
        n = -1
        gpus: tuple[int, ...] = ()
        if top != NO_FIT:
            feasible = np.nonzero(cache.score == top)[0]
            if scorer is None:  # random: a uniformly random feasible node, then GPU(s)
                n = int(feasible[rng.randrange(len(feasible))])
                if sharing:
                    js = np.nonzero(cl.free[n] >= milli)[0]
                    gpus = (int(js[rng.randrange(len(js))]),)
                elif num:
                    gpus = tuple(sorted(int(j) for j in rng.sample(list(gidx[cl.free[n] == FULL]), num)))
            else:
                n = int(feasible[np.argmin(tie_key[feasible])])
                if sharing:
                    gpus = (int(cache.gpu[n]),)
                elif num:
                    gpus = tuple(int(j) for j in gidx[cl.free[n] == FULL][:num])
        if n >= 0:
            cl.take(n, gpus, milli if sharing else FULL, cpu, ram)
            ver[n] += 1
            allocated += req
            placed += 1
        else:
            failed += req
        if keep_decisions:
            decisions.append((n, gpus))
        curve.add(arrived, allocated)
        if progress is not None and step % 256 == 0:
            progress(step)
    return ReplayResult(policy_name, seed, curve.values(), len(order), placed, failed, decisions)


# --- the generic path ------------------------------------------------------------------------


def build_state(nodes: NodeList) -> ClusterState:
    st = ClusterState()
    for i, name in enumerate(nodes.names):
        model = nodes.model[i]
        mem = GPU_MEM_MIB.get(model, DEFAULT_GPU_MEM_MIB)
        gpus = [GPU(f"{name}-gpu{j}", j, model, mem) for j in range(int(nodes.gpus[i]))]
        st.add_node(Node(name, gpus, int(nodes.cpu[i]), int(nodes.ram[i])))
    return st


def pod_request(pods: PodList, i: int, key: str) -> PodRequest:
    num, milli = int(pods.num_gpu[i]), int(pods.gpu_milli[i])
    if num == 0:
        cs: tuple[ContainerRequest, ...] = ()
    elif milli >= FULL:
        cs = (ContainerRequest("main", num),)
    else:
        cs = (ContainerRequest("main", 1, mem_mib=None, milli=milli),)
    return PodRequest(
        key, containers=cs, cpu_milli=int(pods.cpu[i]), ram_mib=int(pods.ram[i]), gpu_models=pods.spec[i]
    )


def replay_generic(
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    seed: int,
    order: np.ndarray | None = None,
    workload: Workload | None = None,
) -> ReplayResult:
    capacity = nodes.gpu_capacity
    order, _, policy = _setup(nodes, pods, policy_name, seed, order, workload)
    st = build_state(nodes)
    index = {name: i for i, name in enumerate(nodes.names)}
    curve = Curve(capacity)
    arrived = allocated = placed = failed = 0
    decisions = []
    for step, p in enumerate(order):
        pod = pod_request(pods, int(p), f"default/p{step}")
        req = int(pods.num_gpu[p] * pods.gpu_milli[p])
        arrived += req
        d = schedule(st, pod, policy)
        if d.placed:
            assert d.fit is not None and d.node is not None
            gpus = tuple(sorted(d.fit.charged))
            decisions.append((index[d.node], gpus))
            allocated += req
            placed += 1
        else:
            decisions.append((-1, ()))
            failed += req
        curve.add(arrived, allocated)
    return ReplayResult(policy_name, seed, curve.values(), len(order), placed, failed, decisions)
