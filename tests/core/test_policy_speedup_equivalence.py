"""The incremental fragmentation of the gpupack and fgd policies decides exactly as the straightforward
per-state computation they replaced.

`RefGpupack` and `RefFGD` below are the policies' algorithms as they were before the speed-up
(every GPU trial rebuilt the node's view list and recomputed the fragmentation over all GPUs x all
typical shapes, memoised on the whole view tuple). The properties drive both with the same random
nodes, pods and workloads, in the same order (a policy's waste table refreshes with its workload's
history, so the call sequence matters), and require the same Fit and the same score.
benchmarks/bench_policy.py times the two against each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpupack.core.fit import Fit, FitFailure, fit
from gpupack.core.frag import FragCache, sigmoid_score
from gpupack.core.gpupack_policy import (
    GpupackPolicy,
    cpu_gpu_ratio,
    gain,
    price_loss,
    reserved_models,
    rewards_unstranding,
    share_counts,
    waste_gain,
    waste_table,
)
from gpupack.core.model import FULL, GPU, ContainerRequest, Node, PodRequest
from gpupack.core.policies import get_policy
from gpupack.core.policy_base import Policy
from gpupack.core.share_prices import SharePrices, share_prices
from gpupack.core.workload import Shape, Workload, shape_of

# --- the reference: the algorithms as they were ------------------------------------------------

RefView = tuple[int, int, int, "str | None", bool]


def ref_views(node: Node) -> list[RefView]:
    return [
        (g.free_milli, g.free_mem, g.mem_mib, g.pod_class, g.healthy and not g.exclusive) for g in node.gpus
    ]


def ref_amount(v: RefView) -> int:
    milli, mem, size, _, ok = v
    if not ok:
        return 0
    return min(milli, mem * FULL // size) if size > 0 else milli


def ref_serves(v: RefView, s: Shape) -> bool:
    milli, mem, _, cls, ok = v
    return (
        ok
        and milli >= s.milli
        and mem >= s.mem_mib
        and (cls is None or s.pod_class is None or cls == s.pod_class)
    )


def ref_fragmentation(
    views: Sequence[RefView],
    cpu_left: int | None,
    model: str,
    shapes: Sequence[Shape],
    weights: Sequence[int],
) -> int:
    amounts = [ref_amount(v) for v in views]
    total = sum(amounts)
    out = 0
    for s, w in zip(shapes, weights, strict=True):
        if (
            s.gpus
            and (s.models is None or model in s.models)
            and (cpu_left is None or cpu_left >= s.cpu_milli)
        ):
            fits = 0
            part = 0
            for v, a in zip(views, amounts, strict=True):
                if ref_serves(v, s):
                    fits += 1
                else:
                    part += a
            if fits >= s.gpus:
                out += w * part
                continue
        out += w * total
    return out


def ref_stranded(total_free: int, cpu_left: int | None, ratio: tuple[int, int]) -> int:
    cpu_sum, gpu_sum = ratio
    if cpu_left is None or cpu_sum <= 0:
        return 0
    return max(0, total_free - cpu_left * gpu_sum // cpu_sum)


def ref_total(wl: Workload) -> int:
    """Workload.total as it was: summed on every read (it is cached per version now)."""
    return sum(wl.weight(s, n) for s, n in wl.counts.items())


def ref_kept(wl: Workload) -> int:
    return sum(wl.typical()[1])


def ref_take(v: RefView, mem: int, milli: int, cls: str) -> RefView:
    return (v[0] - milli, v[1] - mem, v[2], cls, v[4])


class RefGpupack(Policy):
    """GpupackPolicy's fit and node_score before the speed-up."""

    name = "gpupack-reference"

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed)
        self._memo: dict[tuple[object, ...], tuple[int, int]] = {}
        self.learn = workload is None
        self.workload = workload if workload is not None else Workload()
        self._waste_at: tuple[int, int] | None = None
        self._waste: tuple[float, ...] = ()
        self._ratio_key: tuple[int, int] | None = None
        self._ratio = (0, 0)
        self._reserved_key: tuple[int, int] | None = None
        self._reserved: frozenset[str] = frozenset()
        self._prices_at: tuple[int, int] | None = None
        self._prices: dict[tuple[str | None, int], SharePrices] = {}
        self._prices_counts: dict[Shape, int] = {}

    def observe(self, pod: PodRequest) -> None:
        if self.learn:
            self.workload.add(shape_of(pod))

    def prices(self, cls: str | None, gpu_mem: int) -> SharePrices:
        wl = self.workload
        last = self._prices_at
        if last is None or last[0] != id(wl) or wl._version - last[1] > max(16, ref_total(wl) // 16):
            self._prices_at, self._prices, self._prices_counts = (id(wl), wl._version), {}, dict(wl.counts)
        if (cls, gpu_mem) not in self._prices:  # solved once per GPU size, not shared between sizes
            self._prices[(cls, gpu_mem)] = share_prices(share_counts(self._prices_counts, cls, gpu_mem))
        return self._prices[(cls, gpu_mem)]

    @property
    def ratio(self) -> tuple[int, int]:
        key = (id(self.workload), self.workload._version)
        if self._ratio_key != key:
            self._ratio_key, self._ratio = key, cpu_gpu_ratio(self.workload)
        return self._ratio

    @property
    def reserved(self) -> frozenset[str]:
        key = (id(self.workload), self.workload._version)
        if self._reserved_key != key:
            self._reserved_key, self._reserved = key, reserved_models(self.workload.typical()[0])
        return self._reserved

    def _rewards(self, node: Node, cpu: int | None) -> bool:
        return cpu is not None and rewards_unstranding(
            node.cpu_milli, len(node.gpus) * FULL, node.model, self.ratio, self.reserved
        )

    @property
    def waste(self) -> tuple[float, ...]:
        wl = self.workload
        last = self._waste_at
        if last is None or last[0] != id(wl) or wl._version - last[1] > max(16, ref_total(wl) // 64):
            self._waste_at, self._waste = (id(wl), wl._version), waste_table(*wl.typical())
        return self._waste

    def _state(self, views: Sequence[RefView], cpu_left: int | None, model: str) -> tuple[int, int]:
        key = (tuple(views), cpu_left, model, self.workload._version, id(self.workload))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        shapes, weights = self.workload.typical()
        out = (
            ref_fragmentation(views, cpu_left, model, shapes, weights),
            ref_stranded(sum(ref_amount(v) for v in views), cpu_left, self.ratio),
        )
        self._memo[key] = out
        return out

    def _score(
        self,
        before: tuple[int, int],
        after: tuple[int, int],
        shares: list[tuple[int, int, SharePrices]],
        reward: bool,
    ) -> int:
        w = ref_total(self.workload)
        dec = gain(before, after, w, reward)
        for a0, a1, prices in shares:
            dec += int(waste_gain(self.waste, w, a0, a1)) - price_loss(w, prices.cost(a0, a1))
        return sigmoid_score(dec, w)

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        views = ref_views(node)
        cpu = node.free_cpu if node.cpu_milli else None
        before = self._state(views, cpu, node.model)
        cpu_after = None if cpu is None else cpu - pod.cpu_milli
        reward = self._rewards(node, cpu)

        def rank(n: Node, g: GPU, mem: int, milli: int) -> float:
            if milli >= FULL:
                return g.index
            trial = list(views)
            trial[g.index] = ref_take(views[g.index], mem, milli, pod.pod_class)
            share = (
                ref_amount(views[g.index]),
                ref_amount(trial[g.index]),
                self.prices(pod.pod_class, views[g.index][2]),
            )
            return -self._score(before, self._state(trial, cpu_after, n.model), [share], reward)

        return fit(node, pod, rank)

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        views = ref_views(node)
        cpu = node.free_cpu if node.cpu_milli else None
        before = self._state(views, cpu, node.model)
        aft = list(views)
        shares = []
        for idx, (mem, milli, ex) in f.charged.items():
            v = aft[idx]
            aft[idx] = (0, 0, v[2], pod.pod_class, v[4]) if ex else ref_take(v, mem, milli, pod.pod_class)
            if not ex:
                shares.append((ref_amount(v), ref_amount(aft[idx]), self.prices(pod.pod_class, v[2])))
        cpu_after = None if cpu is None else cpu - pod.cpu_milli
        return self._score(before, self._state(aft, cpu_after, node.model), shares, self._rewards(node, cpu))


def ref_node_state(node: Node) -> tuple[list[int], int | None]:
    frees = [g.free_milli if g.healthy else 0 for g in node.gpus]
    return frees, (node.free_cpu if node.cpu_milli else None)


def ref_frag(
    frees: Sequence[int], cpu_left: int | None, model: str, shapes: Sequence[Shape], weights: Sequence[int]
) -> int:
    total = sum(frees)
    out = 0
    for s, w in zip(shapes, weights, strict=True):
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


def ref_after(
    frees: Sequence[int], cpu_left: int | None, pod: PodRequest, charged: dict[int, tuple[int, int, bool]]
) -> tuple[list[int], int | None]:
    out = list(frees)
    for idx, (_, milli, ex) in charged.items():
        out[idx] -= FULL if ex else milli
    return out, (None if cpu_left is None else cpu_left - pod.cpu_milli)


class RefFGD(Policy):
    """The fgd policy's fit and node_score before the speed-up."""

    name = "fgd-reference"

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed)
        self._memo: dict[tuple[object, ...], int] = {}
        self.learn = workload is None
        self.workload = workload if workload is not None else Workload()

    def observe(self, pod: PodRequest) -> None:
        if self.learn:
            self.workload.add(shape_of(pod))

    def _frag(self, frees: list[int], cpu: int | None, model: str) -> int:
        key = (tuple(frees), cpu, model, self.workload._version, id(self.workload))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = ref_frag(frees, cpu, model, *self.workload.typical())
        return hit

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        total = ref_kept(self.workload)
        frees, cpu = ref_node_state(node)
        model = node.model
        before = self._frag(frees, cpu, model)
        cpu_after = None if cpu is None else cpu - pod.cpu_milli

        def rank(n: Node, g: GPU, mem: int, milli: int) -> float:
            if milli >= FULL:
                return g.index
            trial = list(frees)
            trial[g.index] -= milli
            return -sigmoid_score(before - self._frag(trial, cpu_after, model), total)

        return fit(node, pod, rank)

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        frees, cpu = ref_node_state(node)
        before = self._frag(frees, cpu, node.model)
        a_frees, a_cpu = ref_after(frees, cpu, pod, f.charged)
        return sigmoid_score(before - self._frag(a_frees, a_cpu, node.model), ref_kept(self.workload))


REFERENCE = {"gpupack": RefGpupack, "fgd": RefFGD}


# --- random clusters, pods and workloads ------------------------------------------------------------

MODELS = ("A100", "V100", "T4")
CLASSES = ("online", "offline")
MEM_SIZES = (0, 16384, 81920)

model_sets = st.one_of(st.none(), st.frozensets(st.sampled_from(MODELS), min_size=1))
shapes = st.builds(
    Shape,
    cpu_milli=st.sampled_from((0, 1000, 4000, 16000, 64000)),
    gpus=st.integers(0, 3),
    milli=st.sampled_from((0, 100, 250, 500, 700, 1000)),
    mem_mib=st.sampled_from((0, 0, 4096, 20000)),
    models=model_sets,
    pod_class=st.sampled_from((None, "online", "offline")),
)


WorkloadSpec = tuple[list[tuple[Shape, int]], float, bool]


@st.composite
def workloads(draw: st.DrawFn) -> WorkloadSpec:
    counts = draw(st.lists(st.tuples(shapes, st.integers(1, 40)), min_size=1, max_size=12))
    coverage = draw(st.sampled_from((0.5, 0.95, 1.0)))
    return counts, coverage, draw(st.booleans())


def make_workload(spec: WorkloadSpec) -> Workload:
    counts, coverage, by_demand = spec
    c: Counter[Shape] = Counter()
    for s, n in counts:
        c[s] += n
    return Workload(c, coverage, by_demand)


@st.composite
def gpus(draw: st.DrawFn, name: str, i: int, model: str) -> GPU:
    mem = draw(st.sampled_from(MEM_SIZES))
    g = GPU(f"{name}-{i}", i, model, mem, healthy=draw(st.booleans() | st.just(True)))
    kind = draw(st.sampled_from(("idle", "idle", "shared", "shared", "whole")))
    if kind == "whole":
        g.exclusive, g.mem_used, g.milli_used = True, mem, FULL
    elif kind == "shared":
        g.milli_used = draw(st.integers(0, FULL))
        g.mem_used = draw(st.integers(0, mem))
    if kind != "idle":
        g.pod_class = draw(st.sampled_from(CLASSES))
        g.holders["other/pod"] = (g.mem_used, g.milli_used)
    return g


@st.composite
def nodes(draw: st.DrawFn, name: str) -> Node:
    model = draw(st.sampled_from(MODELS))
    n = draw(st.integers(1, 8))
    cpu = draw(st.sampled_from((0, 8000, 32000, 96000)))
    return Node(
        name,
        [draw(gpus(name, i, model)) for i in range(n)],
        cpu_milli=cpu,
        ram_mib=10**6 if cpu else 0,
        # Round figures too: a free CPU equal to a shape's request is a boundary of the rule.
        cpu_used=draw(st.integers(0, cpu) | st.sampled_from((0, 1000, 4000)).filter(lambda u: u <= cpu)),
    )


@st.composite
def containers(draw: st.DrawFn, name: str) -> ContainerRequest:
    kind = draw(st.sampled_from(("milli", "mem", "both", "both", "whole")))
    n = draw(st.integers(1, 3)) if kind == "whole" else draw(st.sampled_from((1, 1, 1, 2)))
    milli = draw(st.sampled_from((50, 100, 300, 500, 999, 1000)))
    mem = draw(st.sampled_from((1000, 4096, 20000)))
    if kind == "whole":
        return ContainerRequest(name, n)
    return ContainerRequest(
        name, n, mem_mib=mem if kind != "milli" else None, milli=milli if kind != "mem" else None
    )


@st.composite
def pods(draw: st.DrawFn, key: str) -> PodRequest:
    cs = tuple(draw(containers(f"c{i}")) for i in range(draw(st.sampled_from((1, 1, 1, 2)))))
    init = tuple(draw(containers(f"i{i}")) for i in range(draw(st.sampled_from((0, 0, 0, 1)))))
    return PodRequest(
        key,
        draw(st.sampled_from(CLASSES)),
        cs,
        init,
        cpu_milli=draw(st.sampled_from((0, 1000, 8000, 40000))),
        gpu_models=draw(model_sets),
    )


Scenario = tuple[list[Node], list[PodRequest], list[int], WorkloadSpec, bool, int]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    cluster = [draw(nodes(f"n{i}")) for i in range(draw(st.integers(1, 5)))]
    # Node copies: equal states on several nodes go through the memoised paths.
    cluster += [n.copy() for n in cluster[: draw(st.integers(0, 2))]]
    arriving = [draw(pods(f"default/p{i}")) for i in range(draw(st.integers(1, 6)))]
    # How many times each pod is observed first (a learning policy: the waste table rebuilds
    # once its workload grows past a threshold, so the call sequence matters).
    repeats = [draw(st.integers(0, 30)) for _ in arriving]
    # A tiny memo bound empties the memo in the middle of a node's trials.
    limit = draw(st.sampled_from((2, 5, FragCache.LIMIT)))
    return cluster, arriving, repeats, draw(workloads()), draw(st.booleans()), limit


def answers(policy: Policy, cluster: list[Node], pod: PodRequest) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for node in cluster:
        f = policy.fit(node, pod)
        out.append((f, policy.node_score(node, pod, f)) if isinstance(f, Fit) else (f,))
    return out


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(("gpupack", "fgd")))
def test_fit_and_score_equal_the_reference(scenario: Scenario, name: str) -> None:
    cluster, arriving, repeats, spec, learning, limit = scenario
    ref: Any = REFERENCE[name](seed=1, workload=None if learning else make_workload(spec))
    new: Any = get_policy(name, seed=1, workload=None if learning else make_workload(spec))
    if learning:  # each learns into its own copy of the same starting workload
        ref.workload, new.workload = make_workload(spec), make_workload(spec)
    default_limit = FragCache.LIMIT
    FragCache.LIMIT = limit
    try:
        for pod, n in zip(arriving, repeats, strict=True):
            for _ in range(n):
                ref.observe(pod)
                new.observe(pod)
            want = answers(ref, cluster, pod)
            assert answers(new, cluster, pod) == want
            event(f"{name}: {'some' if any(isinstance(a[0], Fit) for a in want) else 'no'} node fits")
            # The waste table the policy holds (read without rebuilding it): rebuilt at the same calls.
            assert getattr(new, "_waste", ()) == getattr(ref, "_waste", ())
            # Place it on the first node that takes it, so later pods meet changed states.
            for node, a in zip(cluster, want, strict=True):
                if isinstance(a[0], Fit):
                    place(node, pod, a[0])
                    break
    finally:
        FragCache.LIMIT = default_limit


def place(node: Node, pod: PodRequest, f: Fit) -> None:
    for idx, (mem, milli, ex) in f.charged.items():
        g = node.gpus[idx]
        if ex:
            g.exclusive, g.mem_used, g.milli_used = True, g.mem_mib, FULL
        else:
            g.mem_used += mem
            g.milli_used += milli
        g.pod_class = pod.pod_class
        g.holders[pod.key] = (mem, milli)
    node.cpu_used += pod.cpu_milli


views = st.tuples(
    st.integers(-200, FULL),
    st.integers(-1000, 81920),
    st.sampled_from(MEM_SIZES),
    st.sampled_from((None, "online", "offline")),
    st.booleans(),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    st.lists(views, min_size=1, max_size=8),
    st.lists(st.tuples(st.integers(0, 7), views), max_size=3, unique_by=lambda t: t[0]),
    st.one_of(st.none(), st.integers(-5000, 100000), st.sampled_from((0, 1000, 4000, 16000, 64000))),
    st.sampled_from(MODELS),
    workloads(),
)
def test_incremental_fragmentation_equals_the_sum_over_gpus(
    state: list[RefView],
    changes: list[tuple[int, RefView]],
    cpu: int | None,
    model: str,
    spec: WorkloadSpec,
) -> None:
    """Any state, any GPUs changed to anything (views no policy builds included): the cache's
    fragmentation is the per-state sum's, for gpupack's views and fgd's free milli."""
    wl = make_workload(spec)
    policy = get_policy("gpupack", workload=wl)
    assert isinstance(policy, GpupackPolicy)
    changes = [(i % len(state), v) for i, v in changes]
    changes = list({i: (i, v) for i, v in changes}.values())
    after_views = list(state)
    for i, v in changes:
        after_views[i] = v
    shapes_, weights = wl.typical()
    ratio = cpu_gpu_ratio(wl)
    assert policy._state(state, cpu, model) == (
        ref_fragmentation(state, cpu, model, shapes_, weights),
        ref_stranded(sum(ref_amount(v) for v in state), cpu, ratio),
    )
    prep = policy._prepared()
    nf = prep.frags.node(state, model)
    assert prep.trial(nf, tuple((state[i], v) for i, v in changes), cpu) == (
        ref_fragmentation(after_views, cpu, model, shapes_, weights),
        ref_stranded(sum(ref_amount(v) for v in after_views), cpu, ratio),
    )
    frees = [v[0] for v in state]
    after_frees = [v[0] for v in after_views]
    fc = FragCache(shapes_, weights, lambda f: f, lambda f, s: f >= s.milli)
    fnf = fc.node(frees, model)
    assert fc.frag(fnf, cpu) == ref_frag(frees, cpu, model, shapes_, weights)
    assert fc.trial(fnf, tuple((frees[i], v[0]) for i, v in changes), cpu)[0] == ref_frag(
        after_frees, cpu, model, shapes_, weights
    )


def fitted_shares(scenario: Scenario) -> Iterator[tuple[Any, Node, PodRequest, Fit]]:
    """The scenario's gpupack policy (its workload given or learnt), and each arriving pod's Fit on
    each node it fits, in order, with FragCache bounded at the scenario's limit meanwhile."""
    cluster, arriving, _repeats, spec, learning, limit = scenario
    policy: Any = get_policy("gpupack", seed=1, workload=None if learning else make_workload(spec))
    if learning:
        policy.workload = make_workload(spec)
    default_limit = FragCache.LIMIT
    FragCache.LIMIT = limit
    try:
        for pod in arriving:
            for node in cluster:
                f = policy.fit(node, pod)
                if isinstance(f, Fit):
                    yield policy, node, pod, f
    finally:
        FragCache.LIMIT = default_limit


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 3), st.integers(0, 40))
def test_a_fits_own_score_is_the_full_computation_whatever_changed_since(
    scenario: Scenario, change: int, learnt: int
) -> None:
    """GpupackPolicy's fit keeps the score it worked out choosing a shared GPU (Fit.score_memo);
    node_score must answer exactly as without it, when asked right away and when the node, the
    pod's CPU or the policy's workload changed between the fit and the score (the extender scores a
    reservation's fit on the node itself; a learning flush rebuilds the tables)."""
    arriving = scenario[1]
    for policy, node, pod, f in fitted_shares(scenario):
        bare = Fit(f.placement, f.charged)
        if change == 1:  # the node took another pod meanwhile
            place(node, arriving[0], bare)
        elif change == 2 and node.cpu_milli:  # its free CPU changed
            node.cpu_used = 0 if node.cpu_used > node.cpu_milli // 2 else node.cpu_milli
        elif change == 3:  # the policy learnt meanwhile
            for _ in range(learnt):
                policy.observe(arriving[-1])
        got = policy.node_score(node, pod, f)
        assert got == policy.node_score(node, pod, bare)
        if f.score_memo is not None and change == 0:
            event("a kept score served")


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2), st.integers(1, 40))
def test_a_kept_score_is_the_full_computation_or_none(scenario: Scenario, change: int, learnt: int) -> None:
    """kept_score (the extender's, for a fit made on the node as it is now): the score node_score
    gives, or None. None when the pod asked about is not the one fitted (another CPU request or
    class); after the policy learnt meanwhile, the score only while its tables are the same."""
    arriving = scenario[1]
    for policy, node, pod, f in fitted_shares(scenario):
        bare = Fit(f.placement, f.charged)
        asked = pod
        if change == 1:  # another pod of the same GPU request
            other = "offline" if pod.pod_class == "online" else "online"
            asked = (
                replace(pod, cpu_milli=pod.cpu_milli + 500) if learnt % 2 else replace(pod, pod_class=other)
            )
        elif change == 2:  # the policy learnt meanwhile
            for _ in range(learnt):
                policy.observe(arriving[-1])
        kept = policy.kept_score(asked, f)
        if change == 1:
            assert kept is None
        elif kept is not None:
            assert kept == policy.node_score(node, asked, bare)
            event(f"kept score served (change {change})")
        else:
            assert f.score_memo is None or change == 2
