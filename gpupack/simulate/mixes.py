"""Other workload mixes of the openb trace family, made by resampling a trace.

A policy tuned to five files could overfit them; these mixes keep the trace's pods (their CPU,
RAM and GPU shapes) but change how the GPU request splits between GPU-sharing pods, multi-GPU pods
and whole single-GPU pods, as the published trace variants do (gpushare40, multigpu20).
`reshape_shares` goes further from the trace: each share size becomes another, drawn at random,
so a policy cannot lean on openb's particular sizes (810, 470, 320 ...) either.
"""

from __future__ import annotations

import numpy as np

from gpupack.core.model import FULL
from gpupack.simulate.openb import PodList


def classes(pods: PodList) -> dict[str, np.ndarray]:
    num, milli = pods.num_gpu, pods.gpu_milli
    return {
        "cpu": np.nonzero(num == 0)[0],
        "share": np.nonzero((num == 1) & (milli < FULL))[0],
        "whole": np.nonzero((num == 1) & (milli >= FULL))[0],
        "multi": np.nonzero(num > 1)[0],
    }


def proportions(pods: PodList) -> dict[str, float]:
    """Share of the total GPU request held by sharing, whole single-GPU and multi-GPU pods."""
    req = pods.gpu_request
    total = req.sum()
    return {k: float(req[idx].sum() / total) for k, idx in classes(pods).items() if k != "cpu"}


def resample(pods: PodList, share: float, multi: float, seed: int) -> PodList:
    """Same total GPU request and CPU-only pods; `share` and `multi` of the GPU request from
    sharing and multi-GPU pods (drawn with replacement from those classes), the rest whole GPUs."""
    if not (share >= 0 and multi >= 0 and share + multi <= 1):
        raise ValueError("share and multi are fractions with share + multi <= 1")
    rng = np.random.default_rng(seed)
    cls = classes(pods)
    req = pods.gpu_request
    total = int(req.sum())
    picked = [cls["cpu"]]
    for name, frac in (("share", share), ("multi", multi), ("whole", 1 - share - multi)):
        pool = cls[name]
        if frac <= 0 or not len(pool):
            continue
        target = frac * total
        got = 0
        chosen = []
        while got < target:
            i = int(pool[rng.integers(len(pool))])
            chosen.append(i)
            got += int(req[i])
        picked.append(np.asarray(chosen, np.int64))
    idx = np.concatenate(picked)
    out = pods.take(idx)
    out.names = [f"mix-{i:05d}" for i in range(len(idx))]
    return out


def reshape_shares(pods: PodList, seed: int, step: int = 10) -> PodList:
    """Every share size (0 < milli < FULL) replaced by another drawn uniformly from multiples of
    `step` in [5 %, 95 %] of a GPU, the same for every pod of that size, so the sizes' popularity
    is kept and their values are not."""
    if not 0 < step <= FULL // 20:
        raise ValueError(f"step is milli between 1 and {FULL // 20}, not {step}")
    rng = np.random.default_rng(seed)
    milli = pods.gpu_milli.copy()
    share = (pods.num_gpu == 1) & (milli > 0) & (milli < FULL)
    sizes = np.unique(milli[share])
    lo, hi = FULL // 20 // step, FULL * 19 // 20 // step
    new = dict(zip(sizes.tolist(), (rng.integers(lo, hi + 1, len(sizes)) * step).tolist(), strict=True))
    milli[share] = [new[int(m)] for m in milli[share]]
    out = pods.take(np.arange(len(pods)))
    out.gpu_milli = milli
    return out
