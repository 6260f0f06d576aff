"""Replay with departures, with and without periodic defragmentation (`gpupack simulate --churn`).

The openb replay (docs/simulate.md, "Replay rules") has no departures, so it never fragments the
way a long-running cluster does. This one keeps the cluster in steady state:

- Time advances one tick per arriving pod. Pods are drawn uniformly (seeded) from the trace and
  placed with the chosen policy through :func:`gpupack.core.policies.schedule` (the same code the
  extender runs); a pod that does not fit is dropped and counted.
- Every placed pod leaves after an exponentially distributed lifetime whose mean makes the
  offered load `--load` times the cluster's GPU capacity, so the cluster stays full and churns.
- Every `--defrag-every` ticks, :func:`gpupack.core.defrag.plan_defrag` plans at most
  `--max-evictions` moves over the GPU-sharing pods, and the plan's verified target state
  replaces the cluster (an evicted pod keeps its remaining lifetime).
- The same seed drives both runs, so they see the same arrivals and lifetimes; they differ only
  in defrag. After `--warmup` ticks, the allocation ratio (allocated GPU milli / capacity) is
  sampled every tick, and arrivals that found no place are counted.

Pods: the trace's GPU pods (CPU-only pods are skipped); a node sample of `--sample-nodes` rows
of the openb node list (seeded) keeps a run to seconds. Results cite the trace's paper:
Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC 2023.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpupack.core.defrag import Limits, plan_defrag, verify_plan
from gpupack.core.model import FULL, ClusterState
from gpupack.core.policies import POLICIES, UnknownPolicy, policy_spec, schedule
from gpupack.simulate.openb import NodeList, PodList, TraceError, read_nodes, read_pods
from gpupack.simulate.replay import build_state, pod_request, trace_workload
from gpupack.simulate.usage import OneLineParser


@dataclass
class ChurnResult:
    defrag: bool
    ticks: int
    allocation_ratio_pct: float  # mean after warm-up
    arrivals: int  # after warm-up
    failed: int  # arrivals after warm-up that found no place
    failed_whole_gpu: int  # ... of which asked for whole GPUs
    failed_gpu_milli: int  # GPU request of the failed arrivals
    evictions: int
    gpus_freed: int
    defrag_runs: int
    plan_seconds: float

    @property
    def failed_pct(self) -> float:
        return 100.0 * self.failed / self.arrivals if self.arrivals else 0.0


def allocated_milli(state: ClusterState) -> int:
    return sum(g.milli_used for n in state.nodes.values() for g in n.gpus)


def run_churn(
    nodes: NodeList,
    pods: PodList,
    *,
    policy: str = "bestfit",
    seed: int = 42,
    ticks: int = 3000,
    warmup: int = 1000,
    load: float = 1.0,
    defrag_every: int = 0,
    limits: Limits | None = None,
) -> ChurnResult:
    rng = random.Random(seed)
    gpu_pods = [i for i in range(len(pods)) if pods.num_gpu[i] > 0]
    if not gpu_pods:
        raise TraceError("the trace has no GPU pods")
    mean_req = float(np.mean([pods.num_gpu[i] * pods.gpu_milli[i] for i in gpu_pods]))
    capacity = nodes.gpu_capacity
    lifetime = load * capacity / mean_req  # ticks; Little's law: load = rate * lifetime * mean_req
    spec = policy_spec(policy)
    pol = spec.make(seed, trace_workload(pods) if spec.learns else None)
    state = build_state(nodes)
    departures: list[tuple[float, str]] = []
    limits = limits or Limits(max_evictions=10, max_per_node=0, max_per_namespace=0, max_workload_share=0)
    samples = 0.0
    arrivals = failed = failed_whole = failed_milli = evictions = freed = runs = 0
    plan_s = 0.0
    for t in range(ticks):
        while departures and departures[0][0] <= t:
            _, key = heapq.heappop(departures)
            state.release(key)
        i = gpu_pods[rng.randrange(len(gpu_pods))]
        stay = rng.expovariate(1.0 / lifetime)
        pod = pod_request(pods, i, f"default/p{t}")
        d = schedule(state, pod, pol)
        if d.placed:
            heapq.heappush(departures, (t + stay, pod.key))
        if t >= warmup:
            arrivals += 1
            if not d.placed:
                failed += 1
                failed_whole += int(pods.gpu_milli[i] >= FULL)
                failed_milli += int(pods.num_gpu[i] * pods.gpu_milli[i])
        if defrag_every and t % defrag_every == defrag_every - 1:
            t0 = time.perf_counter()
            plan = plan_defrag(state, None, limits)
            plan_s += time.perf_counter() - t0
            runs += 1
            if plan.moves:
                state = verify_plan(state, plan)
                evictions += plan.evictions
                freed += plan.gpus_freed
        if t >= warmup:
            samples += allocated_milli(state) / capacity
    measured = max(1, ticks - warmup)
    return ChurnResult(
        defrag=bool(defrag_every),
        ticks=ticks,
        allocation_ratio_pct=round(100.0 * samples / measured, 3),
        arrivals=arrivals,
        failed=failed,
        failed_whole_gpu=failed_whole,
        failed_gpu_milli=failed_milli,
        evictions=evictions,
        gpus_freed=freed,
        defrag_runs=runs,
        plan_seconds=round(plan_s, 3),
    )


def sample_nodes(nodes: NodeList, count: int, seed: int) -> NodeList:
    if count <= 0 or count >= len(nodes):
        return nodes
    idx = sorted(random.Random(seed).sample(range(len(nodes)), count))
    return NodeList(
        [nodes.names[i] for i in idx],
        nodes.cpu[idx],
        nodes.ram[idx],
        nodes.gpus[idx],
        [nodes.model[i] for i in idx],
    )


def _default_data() -> Path | None:
    env = os.environ.get("GPUPACK_SHARED")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared"
    d = d / "data" / "openb"
    return d if d.is_dir() else None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="gpupack simulate --churn", description="Replay with departures, with and without defrag."
    )
    p.add_argument("--churn", action="store_true", help=argparse.SUPPRESS)  # accepted from the dispatcher
    p.add_argument("--trace", help="openb pod list CSV (default: the shared default trace)")
    p.add_argument("--nodes", help="openb node list CSV (default: the shared node list)")
    p.add_argument(
        "--sample-nodes", type=int, default=120, help="nodes drawn from the node list (0 = all; default 120)"
    )
    p.add_argument("--policy", default="bestfit", help=f"placement policy ({', '.join(sorted(POLICIES))})")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--ticks", type=int, default=3000, help="arrivals simulated (default 3000)")
    p.add_argument("--warmup", type=int, default=1000, help="arrivals before measuring (default 1000)")
    p.add_argument(
        "--load", type=float, default=1.0, help="offered GPU load as a share of capacity (default 1.0)"
    )
    p.add_argument("--defrag-every", type=int, default=100, help="ticks between defrag runs (default 100)")
    p.add_argument("--max-evictions", type=int, default=10, help="evictions per defrag run (default 10)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ticks <= 0 or not 0 <= args.warmup < args.ticks or args.load <= 0 or args.defrag_every <= 0:
        print(
            "gpupack simulate --churn: need ticks > warmup >= 0, load > 0, defrag-every > 0", file=sys.stderr
        )
        return 2
    data = _default_data()
    trace = args.trace or (data / "openb_pod_list_default.csv" if data else None)
    node_csv = args.nodes or (data / "openb_node_list_gpu_node.csv" if data else None)
    if trace is None or node_csv is None:
        print(
            "gpupack simulate --churn: no trace found; give --trace and --nodes (or set GPUPACK_SHARED)",
            file=sys.stderr,
        )
        return 2
    try:
        nodes = sample_nodes(read_nodes(node_csv), args.sample_nodes, args.seed)
        pods = read_pods(trace)
        limits = Limits(
            max_evictions=args.max_evictions, max_per_node=0, max_per_namespace=0, max_workload_share=0
        )
        common = dict(
            policy=args.policy, seed=args.seed, ticks=args.ticks, warmup=args.warmup, load=args.load
        )
        without = run_churn(nodes, pods, defrag_every=0, **common)
        with_ = run_churn(nodes, pods, defrag_every=args.defrag_every, limits=limits, **common)
    except (TraceError, UnknownPolicy, OSError) as e:
        print(f"gpupack simulate --churn: {e}", file=sys.stderr)
        return 2
    out = {
        "nodes": len(nodes),
        "gpus": int(nodes.gpus.sum()),
        "trace": Path(trace).name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "churn", "trace", "nodes")},
        "without_defrag": asdict(without) | {"failed_pct": round(without.failed_pct, 3)},
        "with_defrag": asdict(with_) | {"failed_pct": round(with_.failed_pct, 3)},
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"churn replay: {out['nodes']} nodes, {out['gpus']} GPUs, {out['trace']}, policy {args.policy}, "
        f"seed {args.seed}, {args.ticks} arrivals ({args.warmup} warm-up), load {args.load:g}"
    )
    print(
        f"{'':16}{'alloc ratio %':>14}{'failed %':>10}{'failed whole-GPU':>18}{'evictions':>11}{'GPUs freed':>12}"
    )
    for label, r in (("without defrag", without), (f"defrag /{args.defrag_every}", with_)):
        print(
            f"{label:16}{r.allocation_ratio_pct:>14.2f}{r.failed_pct:>10.2f}{r.failed_whole_gpu:>18}"
            f"{r.evictions:>11}{r.gpus_freed:>12}"
        )
    per = with_.evictions / max(1, with_.arrivals) * 1000
    print(
        f"defrag spent {with_.evictions} evictions ({per:.1f} per 1000 arrivals) in {with_.defrag_runs} runs; "
        f"planning took {with_.plan_seconds:.2f}s in all"
    )
    if math.isfinite(with_.allocation_ratio_pct - without.allocation_ratio_pct):
        print(
            f"allocation ratio {with_.allocation_ratio_pct - without.allocation_ratio_pct:+.2f} points with defrag"
        )
    return 0
