"""Replay throughput and peak memory on the openb default trace; optionally, other workload mixes.

    python benchmarks/bench_replay.py [--policy fgd --policy gpupack] [--seeds 42] [--json]
    python benchmarks/bench_replay.py --mixes [--seeds 42-46] [--json]

Throughput is arrivals (pods offered) and pods placed per second of CPU time and of wall time, for
one replay of the default trace (1,213 nodes, ~10,800 arrivals). Peak memory is the replay's peak
traced allocation (Python + numpy, tracemalloc, from an extra untimed replay) and the process's peak RSS, each policy measured in
a fresh process. `--mixes` resamples the default trace with other proportions of GPU-sharing and
multi-GPU pods (gpupack.simulate.mixes) and compares fgd with gpupack on each; four more mixes
also draw every share size anew (`reshape_shares`: shapes the policy was never tuned on).

Reads the trace from ../shared/data/openb (or $GPUPACK_SHARED/data/openb); skips with a message
when it is absent. Results on that trace: Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC 2023.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    return (Path(base) if base else ROOT / ".." / "shared") / "data" / "openb"


def one(policy: str, seeds: list[int]) -> dict:
    from gpupack.simulate.openb import read_nodes, read_pods
    from gpupack.simulate.replay import replay

    d = openb_dir()
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    pods = read_pods(d / "openb_pod_list_default.csv")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    arrived = placed = 0
    unalloc = []
    for s in seeds:
        r = replay(nodes, pods, policy, s)
        arrived += r.arrived
        placed += r.placed
        unalloc.append(r.unallocated_pct_at_100)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    # Peak traced allocation from one more replay: tracemalloc slows the loop, so it is not timed.
    tracemalloc.start()
    replay(nodes, pods, policy, seeds[0])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "policy": policy,
        "seeds": seeds,
        "replays": len(seeds),
        "arrivals": arrived,
        "placed": placed,
        "cpu_seconds": round(cpu, 2),
        "wall_seconds": round(wall, 2),
        "arrivals_per_cpu_second": round(arrived / cpu, 1),
        "placed_per_cpu_second": round(placed / cpu, 1),
        "placed_per_wall_second": round(placed / wall, 1),
        "seconds_per_replay_cpu": round(cpu / len(seeds), 2),
        "peak_traced_mib": round(peak / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "unallocated_pct_at_100": round(sum(unalloc) / len(unalloc), 3),
    }


def mixes(seeds: list[int]) -> dict:
    from gpupack.simulate.mixes import proportions, resample, reshape_shares
    from gpupack.simulate.openb import read_nodes, read_pods
    from gpupack.simulate.replay import replay

    d = openb_dir()
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    base = read_pods(d / "openb_pod_list_default.csv")
    prop = proportions(base)
    grid = [(0.10, 0.05), (0.30, 0.20), (0.50, 0.10), (0.60, 0.30), (0.20, 0.40)]
    out = {"default_proportions": {k: round(v, 3) for k, v in prop.items()}, "mixes": []}
    # The grid's mixes, then share-heavy mixes whose share sizes are drawn anew (reshape_shares)
    variants = [(share, multi, None) for share, multi in grid] + [(0.5, 0.1, 2000 + k) for k in range(4)]
    for i, (share, multi, reshaped) in enumerate(variants):
        pods = resample(base, share, multi, seed=1000 + i)
        if reshaped is not None:
            pods = reshape_shares(pods, reshaped)
        row = {"share": share, "multi": multi, "reshaped_seed": reshaped, "pods": len(pods)}
        for policy in ("fgd", "gpupack"):
            vals = [replay(nodes, pods, policy, s).unallocated_pct_at_100 for s in seeds]
            row[policy] = round(sum(vals) / len(vals), 3)
            row[f"{policy}_per_seed"] = [round(v, 3) for v in vals]
        row["gpupack_wins"] = row["gpupack"] < row["fgd"]
        out["mixes"].append(row)
        shapes = "" if reshaped is None else f" share sizes drawn anew (seed {reshaped})"
        print(
            f"mix share={share:.2f} multi={multi:.2f}{shapes}: fgd {row['fgd']:.2f}%  gpupack {row['gpupack']:.2f}%",
            file=sys.stderr,
        )
    return out


def parse_seeds(text: str) -> list[int]:
    from gpupack.simulate.cli import parse_seeds as p

    return p(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", action="append", help="policies to time (default: fgd, gpupack)")
    ap.add_argument("--seeds", default=None, help="seeds (default 42; with --mixes 42-46)")
    ap.add_argument("--mixes", action="store_true", help="compare fgd and gpupack on resampled mixes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one policy in this process
    args = ap.parse_args()
    if not (openb_dir() / "openb_node_list_gpu_node.csv").is_file():
        print(f"SKIP: openb trace not found at {openb_dir()} (set GPUPACK_SHARED to the shared/ folder)")
        return 0
    if args.one:
        print(json.dumps(one(args.one, parse_seeds(args.seeds or "42"))))
        return 0
    if args.mixes:
        res = mixes(parse_seeds(args.seeds or "42-46"))
        if args.json:
            print(json.dumps(res))
        else:
            print(f"default trace GPU request split: {res['default_proportions']}")
            print(f"{'sharing':>8} {'multi-GPU':>10} {'share sizes':>12} {'fgd':>8} {'gpupack':>8}")
            for r in res["mixes"]:
                sizes = "trace" if r["reshaped_seed"] is None else f"seed {r['reshaped_seed']}"
                print(
                    f"{r['share']:>8.2f} {r['multi']:>10.2f} {sizes:>12} {r['fgd']:>7.2f}% {r['gpupack']:>7.2f}%"
                )
        return 0
    results = []
    for policy in args.policy or ["fgd", "gpupack"]:
        cmd = [sys.executable, __file__, "--one", policy, "--seeds", args.seeds or "42"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps({"trace": "openb_pod_list_default", "results": results}))
    else:
        print("openb default trace, 1,213 nodes; one process per policy")
        print(
            f"{'policy':<9} {'replays':>7} {'arrivals/s':>11} {'placed/s':>9} {'s/replay':>9} {'peak traced':>12} {'peak RSS':>9} {'unalloc@100':>12}"
        )
        for r in results:
            print(
                f"{r['policy']:<9} {r['replays']:>7} {r['arrivals_per_cpu_second']:>11.0f} {r['placed_per_cpu_second']:>9.0f} "
                f"{r['seconds_per_replay_cpu']:>9.2f} {r['peak_traced_mib']:>9.1f} MiB {r['peak_rss_mib']:>5.0f} MiB "
                f"{r['unallocated_pct_at_100']:>11.2f}%"
            )
        print("(rates per CPU second of one core; wall figures in --json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
