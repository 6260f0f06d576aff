"""Defrag planner benchmark: plan time at 1,000 nodes x 8 GPUs, and whole GPUs freed per eviction
against a simple baseline (evict from the emptiest GPUs first; same targets, same caps).

How the fragmented state is produced (seeded, deterministic):
1. 1,000 nodes x 8 GPUs of 81,920 MiB.
2. Pods arrive until 200 in a row find no place: 10 % whole-GPU (exclusive) pods, 5 % shared pods
   on two GPUs, the rest one shared GPU; memory 4-40 GiB, compute 10-50 %; half online, half
   offline; owned by ReplicaSets of 4 replicas in 7 namespaces. Each goes to the first of up to
   20 random nodes where it fits, on a random fitting GPU (no packing: what a cluster looks like
   after many uncoordinated schedulers and restarts).
3. Half of the pods leave, chosen uniformly at random: the holes of a long-running cluster.

Usage: python benchmarks/bench_defrag.py [--nodes 1000] [--gpus 8] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpupack.core.defrag import Limits, plan_baseline, plan_defrag, used_gpus  # noqa: E402
from gpupack.core.fit import Fit, fit  # noqa: E402
from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest  # noqa: E402

MEMS = [4096, 8192, 10240, 16384, 20480, 40960]
MILLIS = [100, 200, 250, 300, 500]


def fragmented_state(nodes: int, gpus: int, seed: int) -> ClusterState:
    rng = random.Random(seed)
    s = ClusterState()
    names = [f"node-{n:04d}" for n in range(nodes)]
    for n, name in enumerate(names):
        s.add_node(Node(name, [GPU(f"GPU-{n}-{i}", i, "A100-80GB", 81920) for i in range(gpus)]))
    i = fails = 0

    def rank(_node, _g, _mem, _milli) -> float:
        return rng.random()

    while fails < 200:
        i += 1
        r = rng.random()
        if r < 0.10:
            c = ContainerRequest("main", 1)
        else:
            c = ContainerRequest("main", 2 if r < 0.15 else 1, rng.choice(MEMS), rng.choice(MILLIS))
        ns = f"ns{i % 7}"
        pod = PodRequest(
            f"{ns}/p{i}",
            "offline" if rng.random() < 0.5 else "online",
            (c,),
            namespace=ns,
            owner=("ReplicaSet", f"rs{i // 4}"),
        )
        for _ in range(20):
            f = fit(s.nodes[rng.choice(names)], pod, rank)
            if isinstance(f, Fit):
                s.place(pod, f.placement, f.charged)
                break
        else:
            fails += 1
    keys = sorted(s.pods)
    rng.shuffle(keys)
    for k in keys[: len(keys) // 2]:
        s.release(k)
    return s


def measure(state: ClusterState, budget: int) -> dict:
    limits = Limits(max_evictions=budget, max_per_node=0, max_per_namespace=0, max_workload_share=0)
    out = {}
    for name, fn in (("defrag", plan_defrag), ("baseline", plan_baseline)):
        t0 = time.perf_counter()
        plan = fn(state, None, limits)
        dt = time.perf_counter() - t0
        out[name] = {
            "plan_seconds": round(dt, 3),
            "evictions": plan.evictions,
            "gpus_freed": plan.gpus_freed,
            "gpus_per_eviction": round(plan.gpus_per_eviction, 3),
            "nodes_freed": len(plan.nodes_freed),
            "groups_tried": plan.attempts,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budgets", default="10,100,1000", help="evictions per plan to compare (comma list)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    state = fragmented_state(args.nodes, args.gpus, args.seed)
    gen = time.perf_counter() - t0
    total = sum(len(n.gpus) for n in state.nodes.values())
    shared = sum(1 for n in state.nodes.values() for g in n.gpus if g.holders and not g.exclusive)
    result = {
        "nodes": args.nodes,
        "gpus": total,
        "seed": args.seed,
        "pods": len(state.pods),
        "used_gpus": used_gpus(state),
        "used_shared_gpus": shared,
        "state_seconds": round(gen, 2),
        "budgets": {},
    }
    for b in (int(x) for x in args.budgets.split(",") if x.strip()):
        result["budgets"][str(b)] = measure(state, b)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"fragmented state: {args.nodes} nodes x {args.gpus} GPUs, {result['pods']} pods, "
        f"{result['used_gpus']}/{total} GPUs in use ({shared} shared), built in {gen:.1f}s (seed {args.seed})"
    )
    print(
        f"{'budget':>7} {'planner':>9} {'plan s':>8} {'evictions':>10} {'GPUs freed':>11} "
        f"{'GPUs/evict':>11} {'nodes freed':>12}"
    )
    for b, r in result["budgets"].items():
        for name in ("defrag", "baseline"):
            x = r[name]
            print(
                f"{b:>7} {name:>9} {x['plan_seconds']:>8.2f} {x['evictions']:>10} {x['gpus_freed']:>11} "
                f"{x['gpus_per_eviction']:>11.2f} {x['nodes_freed']:>12}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
