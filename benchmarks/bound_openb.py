"""How low can unallocated GPUs at 100% arrival go on the openb traces? The bound against the policies.

    python benchmarks/bound_openb.py [--trace default --trace ...] [--seeds 42-51] [--jobs 2]
                                     [--rows FILE] [--cpu-rule-windows K] [--json]
    python benchmarks/bound_openb.py --table-from FILE [--json]

Per trace (default: every pod list in the openb folder) and seed, at bin 100 (the replay's
events whose arrived GPU request is 100-101% of capacity, docs/simulate.md "Replay rules"):

- `bound`: gpupack.simulate.bound.bin_bound, a lower bound on the bin-100 figure for any
  placement of the same arrivals, offline included (the `gpupack simulate --bound` figure).
- `gpupack`, `fgd`, `bestfit`: the replay's figures; `gap`: gpupack - bound (points).
- `offline_reordered`, `offline_ffd`: what offline packers achieve knowing every pod of the prefix
  up to the middle of bin 100 (arrived = 100.5% of capacity), CPU-only pods left out.
  `offline_reordered` replays the prefix through the `gpupack` policy with multi-GPU pods first,
  then whole GPUs, then the sharing pods in arrival order; `offline_ffd` is first-fit decreasing
  into the tightest GPU / node. (Placing the prefix's CPU-only pods after all GPU pods, each left
  out only if no node has room then, would give the reordered packing's figure again: they come
  after every GPU decision.)
- with --cpu-rule-windows K, `bound_cpu_rule`: the bound with the replay's rule for CPU-only pods
  put back (bound.max_allocated, cpu_only="replay") over K arrival windows, a mixed-integer program.

Every figure is checked on every seed: the bound <= each policy's figure, and the bound at the
100.5% prefix <= each offline packing. A violation is printed and makes the exit status 1.
--rows FILE appends each trace and seed's figures as a JSON line as soon as they are known; the
tasks run seed by seed, so a run cut short still has whole seeds, and --table-from FILE makes the
table (and the checks) of the seeds that FILE has for every trace in it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpupack.core.model import FULL  # noqa: E402
from gpupack.simulate.bound import bin_bound, max_allocated, node_types, pod_classes  # noqa: E402
from gpupack.simulate.openb import NodeList, PodList, read_nodes, read_pods  # noqa: E402
from gpupack.simulate.replay import arrival_order, replay  # noqa: E402

POLICIES = ("gpupack", "fgd", "bestfit")


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    return (Path(base) if base else ROOT / ".." / "shared") / "data" / "openb"


def traces(d: Path) -> list[str]:
    return sorted(p.name[len("openb_pod_list_") : -4] for p in d.glob("openb_pod_list_*.csv"))


def prefix_at(pods: PodList, order: np.ndarray, capacity: int) -> np.ndarray:
    """The arrivals up to the middle of bin 100 (arrived = 100.5% of capacity)."""
    arrived = np.cumsum(pods.gpu_request[order])
    return order[: int(np.searchsorted(arrived, capacity * 1.005, side="right"))]


def offline_ffd(nodes: NodeList, pods: PodList, order: np.ndarray, capacity: int) -> float:
    """Unallocated % after first-fit-decreasing the GPU pods arrived up to 100.5% of capacity."""
    prefix = prefix_at(pods, order, capacity)
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
    prefix = prefix_at(pods, order, capacity)
    gpu_pods = prefix[pods.num_gpu[prefix] > 0]
    num, milli = pods.num_gpu[gpu_pods], pods.gpu_milli[gpu_pods]
    group = np.where(num > 1, 0, np.where(milli >= FULL, 1, 2))
    r = replay(nodes, pods, "gpupack", seed, order=gpu_pods[np.argsort(group, kind="stable")])
    allocated = int(pods.gpu_request[gpu_pods].sum()) - r.failed_gpu_milli
    return 100 - allocated * 100 / capacity


def one(task: tuple[str, int, int]) -> dict:
    """Every figure for one trace and seed."""
    t, seed, windows = task
    d = openb_dir()
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    pods = read_pods(d / f"openb_pod_list_{t}.csv")
    capacity = nodes.gpu_capacity
    order = arrival_order(pods, capacity, seed)
    row: dict = {"trace": t, "seed": seed}
    for p in POLICIES:
        row[p] = replay(nodes, pods, p, seed, order=order).unallocated_pct_at_100
    b = bin_bound(nodes, pods, order, samples=SAMPLES)
    row["bound"] = _val(b.unallocated_pct)
    row["gap"] = row["gpupack"] - row["bound"]
    row["offline_reordered"] = offline_reordered(nodes, pods, order, capacity, seed)
    row["offline_ffd"] = offline_ffd(nodes, pods, order, capacity)
    # The bound at the offline packings' own prefix, to check them against.
    row["bound_prefix"] = (
        100
        - max_allocated(node_types(nodes), pod_classes(pods, prefix_at(pods, order, capacity)))
        * 100
        / capacity
    )
    if windows:
        rule = bin_bound(nodes, pods, order, cpu_only="replay", samples=SAMPLES, windows=windows)
        row["bound_cpu_rule"] = _val(rule.unallocated_pct)
    return row


def _val(v: float | None) -> float:
    return float("nan") if v is None else v


TOL = 1e-6  # points: the solver's tolerance on a 6,212-GPU objective is far below this


def violations(row: dict) -> list[str]:
    checks = [(row["bound"], p) for p in POLICIES]
    checks += [(row["bound_prefix"], k) for k in ("offline_reordered", "offline_ffd")]
    if "bound_cpu_rule" in row:
        checks += [(row["bound"], "bound_cpu_rule")] + [(row["bound_cpu_rule"], p) for p in POLICIES]
    return [
        f"{row['trace']} seed {row['seed']}: bound {b:.4f} > {k} {row[k]:.4f}"
        for b, k in checks
        if b > row[k] + TOL
    ]


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


COLUMNS = (
    "bound",
    "gpupack",
    "fgd",
    "bestfit",
    "gap",
    "offline_reordered",
    "offline_ffd",
)
SAMPLES = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rows", help="append each trace and seed's figures here as JSON lines")
    ap.add_argument("--cpu-rule-windows", type=int, default=0, help="also the bound with the CPU-only rule")
    ap.add_argument("--table-from", help="the table of the whole seeds in a --rows file; runs nothing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.table_from:
        rows = [json.loads(line) for line in Path(args.table_from).read_text().splitlines() if line.strip()]
        names = sorted({r["trace"] for r in rows})
        have = {s: {r["trace"] for r in rows if r["seed"] == s} for s in {r["seed"] for r in rows}}
        seeds = sorted(s for s, ts in have.items() if len(ts) == len(names))
        rows = [r for r in rows if r["seed"] in seeds]
        windows = int(all("bound_cpu_rule" in r for r in rows) and bool(rows))
        return report(rows, names, seeds, ",".join(map(str, seeds)), windows, args.json)
    d = openb_dir()
    if not (d / "openb_node_list_gpu_node.csv").is_file():
        print(f"skipped: openb trace not found at {d} (set GPUPACK_SHARED)")
        return 0
    names = args.trace or traces(d)
    seeds = parse_seeds(args.seeds)
    tasks = [(t, s, args.cpu_rule_windows) for s in seeds for t in names]
    rows: list[dict] = []
    sink = open(args.rows, "a") if args.rows else None  # noqa: SIM115  (open for the whole run)
    try:
        with mp.get_context("fork").Pool(max(1, args.jobs)) as pool:
            for row in pool.imap(one, tasks, chunksize=1):
                rows.append(row)
                if sink:
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
    finally:
        if sink:
            sink.close()
    return report(rows, names, seeds, args.seeds, args.cpu_rule_windows, args.json)


def report(
    rows: list[dict], names: list[str], seeds: list[int], label: str, windows: int, as_json: bool
) -> int:
    bad = [v for r in rows for v in violations(r)]
    cols = COLUMNS + (("bound_cpu_rule",) if windows else ())
    out: dict[str, dict] = {}
    for t in names:
        rs = [r for r in rows if r["trace"] == t]
        out[t] = {k: round(float(np.mean([r[k] for r in rs])), 2) for k in cols}
        out[t]["per_seed"] = {str(r["seed"]): {k: round(r[k], 4) for k in cols} for r in rs}
    if as_json:
        print(json.dumps({"seeds": seeds, "traces": out, "violations": bad}))
    else:
        print(f"unallocated GPUs % at 100% arrival, mean of seeds {label}; gap = gpupack - bound")
        print("| trace | " + " | ".join(cols) + " |")
        print("| --- " * (len(cols) + 1) + "|")
        for t, r in out.items():
            print(f"| {t} | " + " | ".join(f"{r[k]:.2f}" for k in cols) + " |")
        for v in bad:
            print("VIOLATION:", v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
