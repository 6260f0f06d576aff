"""The trace replay's vectorised scorers, one per policy, named by the policy's registry entry
(:attr:`gpupack.core.policies.PolicySpec.fast_scorer`): the same integers as the policy's
`node_score` for openb pods (milli only, one class), computed for every candidate node at once.
Simulator-only: the extender scores a node at a time and needs no numpy
(tests/simulate/test_replay_paths.py checks both paths decide alike).

A scorer is called as ``scorer(policy, cl, idx, f, milli, whole, cpu)``: the policy, the replay's
cluster (:class:`gpupack.simulate.replay.FastCluster`), the candidate nodes `idx`, and the pod: for
a share, `f` holds each candidate GPU's free milli and `milli` the share; for whole GPUs `f` is None
and `whole` the count; `cpu` its CPU. It returns one score per candidate (higher first), or
(scores, in-node preference among equal scores)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from gpupack.core.frag import SIGMOID_STEPS
from gpupack.core.gpupack_policy import PRICE_WEIGHT, WASTE_WEIGHT, GpupackPolicy, rewards_unstranding
from gpupack.core.model import FULL, PodRequest
from gpupack.core.policies import MAX_SPEC_CPU, MAX_SPEC_GPU, Policy
from gpupack.core.share_prices import SharePrices
from gpupack.simulate.openb import DEFAULT_GPU_MEM_MIB

NO_FIT = np.iinfo(np.int64).min  # a node a scorer refuses (the replay's infeasible score)

# policy -> ((cluster, workload, version), `rewards_unstranding` per node of the replay's cluster)
_REWARD_MASKS: weakref.WeakKeyDictionary[GpupackPolicy, tuple[tuple[int, int, int], np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
# policy -> (its waste table, as an array for fancy indexing)
_WASTE: weakref.WeakKeyDictionary[GpupackPolicy, tuple[tuple[float, ...], np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
# policy -> (its share prices, their value table as an array)
_PRICES: weakref.WeakKeyDictionary[GpupackPolicy, tuple[SharePrices, np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
# The class the replay's pods have (gpupack.simulate.replay.pod_request leaves the default).
_OPENB_CLASS = PodRequest("openb").pod_class


def random_draw(policy: Policy, cl: Any, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int,
                cpu: int) -> np.ndarray:  # fmt: skip
    """`random`: every feasible node alike. The replay knows this scorer and skips scoring, then
    draws a feasible node and GPU(s) with the policy's RNG."""
    return np.zeros(len(idx), np.int64)


def fgd_scores(
    policy: Policy, cl: Any, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int, cpu: int
) -> np.ndarray:
    """:meth:`gpupack.core.fgd.FGDPolicy.node_score`, over the replay's per-node aggregates."""
    dec = cl.frag[idx] - cl.frag_after(idx, f, milli, whole, cpu)
    if cl.kept_w <= 0:
        return np.full(len(idx), 50, np.int64)
    return np.searchsorted(SIGMOID_STEPS, dec / (cl.kept_w * 1000), side="right").astype(np.int64)


def bestfit_scores(
    policy: Policy, cl: Any, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int, cpu: int
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:meth:`gpupack.core.policies.BestFitPolicy.node_score`, and inside a node its GPU rank."""
    req = milli if f is not None else whole * FULL
    gpu_left = np.maximum(0, cl.tot[idx] - req) / MAX_SPEC_GPU
    cpu_left = (cl.cpu[idx] - cpu) / MAX_SPEC_CPU
    # The same float expression, in the same order, as gpupack.core.policies.bestfit_score.
    score = ((1.0 - (cpu_left * 0.5 + gpu_left * 0.5)) * 100).astype(np.int64)
    # Inside a node: the tightest GPU that fits (least free milli), as the generic `tightest` rank.
    return (score, -f) if f is not None else score


def _waste(policy: GpupackPolicy) -> np.ndarray:
    table = policy.waste
    hit = _WASTE.get(policy)
    if hit is None or hit[0] is not table:
        hit = _WASTE[policy] = (table, np.array(table, np.float64))
    return hit[1]


def _prices(policy: GpupackPolicy) -> tuple[SharePrices, np.ndarray]:
    # openb shapes ask for no GPU memory, so every GPU size gives these prices (share_counts)
    prices = policy.prices(_OPENB_CLASS, DEFAULT_GPU_MEM_MIB)
    hit = _PRICES.get(policy)
    if hit is None or hit[0] is not prices:
        hit = _PRICES[policy] = (prices, np.array(prices.value, np.int64))
    return hit


def gpupack_scores(
    policy: GpupackPolicy, cl: Any, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int, cpu: int
) -> np.ndarray:
    """The replay's vectorised form of :meth:`GpupackPolicy.node_score` for openb pods (milli only,
    one class): same integers, same table lookup, so the same scores."""
    req = milli if f is not None else whole * FULL
    cpu_sum, gpu_sum = policy.ratio
    tot = cl.tot[idx]
    left = cl.cpu[idx]
    if cpu_sum > 0:
        s_before = np.maximum(0, tot - left * gpu_sum // cpu_sum)
        s_after = np.maximum(0, tot - req - (left - cpu) * gpu_sum // cpu_sum)
    else:
        s_before = s_after = np.zeros(len(idx), np.int64)
    w = cl.total_w
    # As `gain`: fragmentation removed, minus the stranding added, plus the stranding removed on
    # the nodes `rewards_unstranding` allows.
    removed = s_before - s_after
    dec = (cl.frag[idx] - cl.frag_after(idx, f, milli, whole, cpu)) + w * np.where(
        _reward_mask(policy, cl)[idx], removed, np.minimum(0, removed)
    )
    if f is not None:  # a sharing pod: the eventual waste of the GPU it takes a share of
        dec = dec + (WASTE_WEIGHT * w * (_waste(policy)[f] - _waste(policy)[f - milli])).astype(np.int64)
        # and its packing cost, as SharePrices.cost and price_loss
        prices, value = _prices(policy)
        cost = value[f] - value[np.minimum(f, f - milli + 1)] - prices.of(milli)
        dec = dec - PRICE_WEIGHT * w * np.where(cost > 2, cost, 0) // 1000
    if w <= 0:
        out = np.full(len(idx), 50, np.int64)
    else:
        out = np.searchsorted(SIGMOID_STEPS, dec / (w * 1000), side="right").astype(np.int64)
    if f is None and whole == 0 and policy.keep_cpu_for_gpus and cpu_sum > 0 and gpu_sum > 0:
        # a pod asking for no GPU: refused where it strands GPUs (GpupackPolicy.refuses)
        out = np.where(s_after > s_before, NO_FIT, out)
    return out


def _reward_mask(policy: GpupackPolicy, cl: Any) -> np.ndarray:
    """Per node of the replay's cluster: `rewards_unstranding`. Node capacities never change; the
    mask follows the policy's workload version."""
    key = (id(cl), id(policy.workload), policy.workload._version)
    cached = _REWARD_MASKS.get(policy)
    if cached is None or cached[0] != key:
        ratio, reserved = policy.ratio, policy.reserved
        mask = np.array(
            [
                rewards_unstranding(int(c), int(g), cl.models[m], ratio, reserved)
                for c, g, m in zip(cl.cpu_cap, cl.gpu_cap, cl.model, strict=True)
            ],
            bool,
        )
        _REWARD_MASKS[policy] = cached = (key, mask)
    return cached[1]
