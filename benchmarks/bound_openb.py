"""How low can unallocated GPUs at 100% arrival go on the openb traces? A bound and an offline packing.

    python benchmarks/bound_openb.py [--trace default --trace ...] [--seeds 42-51] [--json]

Under the replay rules (docs/simulate.md, "Replay rules") pods never leave and a pod that does not
fit is dropped, so after any arrival allocated = arrived − dropped, and the unallocated share at an
event is 100% − (arrived − dropped) / capacity. Bin 100 averages the events whose arrived request
is 100–101% of capacity. For each seed's arrival order this script reports, at those events:

- `hole_floor`: the previous argument. A sharing pod asking for more than half a GPU has a GPU to
  itself among sharing pods; one of 810 milli (13% of the default trace's pods) leaves a 190-milli
  hole that only pods of ≤ 190 milli can use. If every arrived 810 pod is placed, at least
  190 × (810 pods) − (milli of ≤ 190 pods) stays free: a floor for any policy that places every
  810 pod it is shown.
- `lp_bound`: a true lower bound for ANY placement, offline included, which may also leave 810
  pods out. With x of the N arrived 810 pods placed, O the other arrived GPU request, S the arrived
  milli of pods ≤ 190 and G the GPU count: allocated ≤ 810·x + min(O, 1000·(G − x) + min(S, 190·x)).
  The bound takes the best x; it ignores CPU, RAM, models and nodes, so the truth is higher.
- `offline_ffd` and `offline_reordered`: what an offline packer achieves knowing every pod of the
  prefix up to the middle of bin 100 (arrived = 100.5% of capacity), with the CPU, RAM and model
  constraints; CPU-only pods are left out (an offline packer may drop them at no GPU cost).
  `offline_ffd` is first-fit decreasing by GPU request (multi-GPU pods, then whole GPUs, then
  sharing pods largest first) into the tightest GPU / node that fits. `offline_reordered` replays
  the prefix through the `gpupack` policy with multi-GPU pods first, then whole GPUs, then the
  sharing pods in arrival order. Both are achievable packings, so the offline optimum is at most
  the smaller one. (Decreasing order is the worse of the two: it places every 810 pod and so pays
  the whole hole floor, while the best packing leaves some 810 pods out for pods that fill a GPU.)

An online policy that must place every pod that fits sits above `lp_bound` and, while it places
every 810 pod, above `hole_floor`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpupack.core.model import FULL  # noqa: E402
from gpupack.simulate.openb import NodeList, PodList, read_nodes, read_pods  # noqa: E402
from gpupack.simulate.replay import arrival_order, replay  # noqa: E402

TRACES = (
    "default",
    "gpushare40",
    "gpuspec10",
    "cpu050",
    "multigpu20",
    "gpushare60",
    "gpushare80",
    "gpuspec25",
    "multigpu40",
)
BIG, HOLE = 810, FULL - 810


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    return (Path(base) if base else ROOT / ".." / "shared") / "data" / "openb"


def bin100_events(pods: PodList, order: np.ndarray, capacity: int) -> np.ndarray:
    arrived = np.cumsum(pods.gpu_request[order])
    return np.nonzero(arrived * 100 // capacity == 100)[0]


def floors(pods: PodList, order: np.ndarray, capacity: int) -> tuple[float, float]:
    """Mean over bin-100 events of the hole floor and the LP bound, % of capacity."""
    gpus = capacity // FULL
    req = pods.gpu_request[order]
    sharing = (pods.num_gpu[order] == 1) & (pods.gpu_milli[order] < FULL)
    big = sharing & (pods.gpu_milli[order] == BIG)
    small = sharing & (pods.gpu_milli[order] <= HOLE)
    arrived, n_big = np.cumsum(req), np.cumsum(big)
    s_small = np.cumsum(np.where(small, req, 0))
    hole, lp = [], []
    for e in bin100_events(pods, order, capacity):
        n, s, a = int(n_big[e]), int(s_small[e]), int(arrived[e])
        other = a - BIG * n
        hole.append(max(0, HOLE * n - s) / capacity * 100)
        x = np.arange(n + 1)
        alloc = BIG * x + np.minimum(other, FULL * (gpus - x) + np.minimum(s, HOLE * x))
        lp.append(max(0.0, 100 - int(alloc.max()) * 100 / capacity))
    return float(np.mean(hole)), float(np.mean(lp))


def offline_ffd(nodes: NodeList, pods: PodList, order: np.ndarray, capacity: int) -> float:
    """Unallocated % after first-fit-decreasing the GPU pods arrived up to 100.5% of capacity."""
    arrived = np.cumsum(pods.gpu_request[order])
    prefix = order[: int(np.searchsorted(arrived, capacity * 1.005, side="right"))]
    prefix = prefix[pods.num_gpu[prefix] > 0]
    n, g = len(nodes), int(nodes.gpus.max())
    free = np.full((n, g), -1, np.int64)  # missing GPUs never fit
    for i, k in enumerate(nodes.gpus):
        free[i, :k] = FULL
    cpu, ram = nodes.cpu.astype(np.int64).copy(), nodes.ram.astype(np.int64).copy()
    models = sorted(set(nodes.model))
    model = np.array([models.index(m) for m in nodes.model])
    # Decreasing: GPU count, then per-GPU milli; stable within a shape (arrival order).
    ranked = prefix[np.lexsort((-pods.gpu_milli[prefix], -pods.num_gpu[prefix]))]
    allocated = 0
    for p in ranked:
        num, milli = int(pods.num_gpu[p]), int(pods.gpu_milli[p])
        spec = pods.spec[p]
        ok = (cpu >= pods.cpu[p]) & (ram >= pods.ram[p])
        if spec is not None:
            ok &= np.isin(model, [models.index(m) for m in spec if m in models])
        if milli >= FULL:
            idle = (free == FULL).sum(1)
            ok &= idle >= num
            if not ok.any():
                continue
            node = int(np.argmin(np.where(ok, idle, 1 << 30)))  # fewest idle GPUs that still fit
            gpus = np.nonzero(free[node] == FULL)[0][:num]
        else:
            fits = (free >= milli) & ok[:, None]
            if not fits.any():
                continue
            flat = int(np.argmin(np.where(fits, free, 1 << 30)))  # tightest GPU
            node, gpus = divmod(flat, g)
            gpus = np.array([gpus])
        free[node, gpus] -= milli
        cpu[node] -= pods.cpu[p]
        ram[node] -= pods.ram[p]
        allocated += num * milli
    return 100 - allocated * 100 / capacity


def offline_reordered(nodes: NodeList, pods: PodList, order: np.ndarray, capacity: int, seed: int) -> float:
    """Unallocated % after the gpupack policy places the GPU pods arrived up to 100.5% of capacity,
    multi-GPU pods first, then whole GPUs, then sharing pods, each group in arrival order."""
    arrived = np.cumsum(pods.gpu_request[order])
    prefix = order[: int(np.searchsorted(arrived, capacity * 1.005, side="right"))]
    gpu_pods = prefix[pods.num_gpu[prefix] > 0]
    num, milli = pods.num_gpu[gpu_pods], pods.gpu_milli[gpu_pods]
    group = np.where(num > 1, 0, np.where(milli >= FULL, 1, 2))
    r = replay(nodes, pods, "gpupack", seed, order=gpu_pods[np.argsort(group, kind="stable")])
    allocated = int(pods.gpu_request[gpu_pods].sum()) - r.failed_gpu_milli
    return 100 - allocated * 100 / capacity


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", choices=TRACES)
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    d = openb_dir()
    if not (d / "openb_node_list_gpu_node.csv").is_file():
        print(f"skipped: openb trace not found at {d} (set GPUPACK_SHARED)")
        return 0
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    capacity = nodes.gpu_capacity
    seeds = parse_seeds(args.seeds)
    out: dict[str, dict[str, float]] = {}
    for t in args.trace or TRACES:
        pods = read_pods(d / f"openb_pod_list_{t}.csv")
        rows = []
        for s in seeds:
            order = arrival_order(pods, capacity, s)
            rows.append(
                (
                    *floors(pods, order, capacity),
                    offline_ffd(nodes, pods, order, capacity),
                    offline_reordered(nodes, pods, order, capacity, s),
                )
            )
        m = np.mean(rows, axis=0)
        out[t] = {
            k: round(float(v), 2)
            for k, v in zip(("hole_floor", "lp_bound", "offline_ffd", "offline_reordered"), m, strict=True)
        }
    if args.json:
        print(json.dumps({"seeds": seeds, "traces": out}))
    else:
        print(f"unallocated GPUs % at 100% arrival, mean of seeds {args.seeds}")
        print(f"{'trace':<12}{'hole floor':>12}{'LP bound':>10}{'offline FFD':>13}{'offline reordered':>19}")
        for t, r in out.items():
            print(
                f"{t:<12}{r['hole_floor']:>12.2f}{r['lp_bound']:>10.2f}"
                f"{r['offline_ffd']:>13.2f}{r['offline_reordered']:>19.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
