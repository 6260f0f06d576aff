"""Fidelity and generalisation on the openb trace family: ours vs the published simulator.

    python benchmarks/fidelity_openb.py [--seeds 42-51] [--jobs 2] [--traces default,gpuspec20]
                                        [--policy fgd --policy bestfit --policy gpupack] [--json]

For every trace with published results (`expected_allocation_ratio.csv`: default, cpu050/100/200,
gpushare40/60/80, gpuspec10/20/25, multigpu20/30/40) it prints the mean unallocated GPUs at 100%
arrival (bin 100, mean of the seeds) for our FGD and BestFit against the published ones, and the
gpupack policy against the published FGD (% fewer unallocated GPUs). The other variants in the
folder (no published results) are compared with our FGD instead.

Reads ../shared/data/openb (or $GPUPACK_SHARED/data/openb); skips with a message when absent.
Trace: Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC 2023 (alibaba/clusterdata cluster-trace-gpu-v2023).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PUBLISHED_NAMES = {"fgd": "06-FGD", "bestfit": "05-BestFit", "random": "01-Random"}


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    return (Path(base) if base else ROOT / ".." / "shared") / "data" / "openb"


def published(d: Path, seeds: list[int]) -> dict[tuple[str, str], float]:
    """(trace, policy) -> mean unallocated % at bin 100 over `seeds`, from the published results."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(list)
    with (d / "expected_allocation_ratio.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            if int(row["seed"]) in seeds:
                trace = row["workload"].removeprefix("openb_pod_list_")
                acc[(trace, row["sc_policy"])].append(100.0 - float(row["100"]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _one(task: tuple[str, str, str, int]) -> tuple[str, str, int, float]:
    d, trace, policy, seed = task
    from gpupack.simulate.openb import read_nodes, read_pods
    from gpupack.simulate.replay import replay

    nodes = read_nodes(Path(d) / "openb_node_list_gpu_node.csv")
    pods = read_pods(Path(d) / f"openb_pod_list_{trace}.csv")
    return trace, policy, seed, replay(nodes, pods, policy, seed).unallocated_pct_at_100


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--traces", default="", help="comma-separated trace names (default: all in the folder)")
    ap.add_argument("--policy", action="append", choices=["fgd", "bestfit", "gpupack", "random"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    d = openb_dir()
    if not (d / "expected_allocation_ratio.csv").exists():
        print(f"skipped: no openb trace at {d}", file=sys.stderr)
        return 0
    seeds = parse_seeds(args.seeds)
    policies = args.policy or ["fgd", "bestfit", "gpupack"]
    pub = published(d, seeds)
    with_pub = sorted({t for t, _ in pub})
    found = sorted(
        p.name.removeprefix("openb_pod_list_").removesuffix(".csv") for p in d.glob("openb_pod_list_*.csv")
    )
    traces = args.traces.split(",") if args.traces else with_pub + [t for t in found if t not in with_pub]
    tasks = [(str(d), t, p, s) for t in traces for p in policies for s in seeds]
    t0 = time.perf_counter()
    res: dict[tuple[str, str], list[float]] = defaultdict(list)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for trace, policy, _, v in ex.map(_one, tasks):
            res[(trace, policy)].append(v)
    rows = []
    for t in traces:
        row: dict = {"trace": t, "published": t in with_pub}
        for p in policies:
            row[p] = round(sum(res[(t, p)]) / len(res[(t, p)]), 3)
            if p in PUBLISHED_NAMES and (t, PUBLISHED_NAMES[p]) in pub:
                row[f"{p}_published"] = round(pub[(t, PUBLISHED_NAMES[p])], 3)
                row[f"{p}_diff"] = round(row[p] - row[f"{p}_published"], 3)
        if "gpupack" in policies:
            pub_fgd = pub.get((t, PUBLISHED_NAMES["fgd"]))
            ref = pub_fgd if pub_fgd is not None else row.get("fgd")
            if ref:
                row["gpupack_vs_fgd_pct"] = round(100 * (row["gpupack"] - ref) / ref, 1)
                row["gpupack_vs"] = "published FGD" if pub_fgd is not None else "our FGD"
        rows.append(row)
    out = {"seeds": seeds, "wall_seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"unallocated GPUs % at 100% arrival, mean of seeds {args.seeds} ({out['wall_seconds']} s)")
    head = f"{'trace':12s}"
    for p in policies:
        head += f" {p + ' ours':>12s}" + (f" {'published':>9s} {'diff':>6s}" if p in PUBLISHED_NAMES else "")
    print(head + f" {'gpupack vs FGD':>16s}")
    for r in rows:
        line = f"{r['trace']:12s}"
        for p in policies:
            line += f" {r[p]:12.2f}"
            if p in PUBLISHED_NAMES:
                pv = r.get(f"{p}_published")
                line += f" {pv:9.2f} {r[f'{p}_diff']:+6.2f}" if pv is not None else f" {'—':>9s} {'':>6s}"
        if "gpupack_vs_fgd_pct" in r:
            line += f" {r['gpupack_vs_fgd_pct']:+7.1f}% ({'pub' if r['gpupack_vs'] == 'published FGD' else 'ours'})"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
