"""The extender's cluster view at a fleet's size, in one process (issue 29): what each kind of watch
event costs with N nodes and M running pods, to find work proportional to the cluster's size.

The pods are bench_scale.py's (60 % CPU-only, 30 % GPU shares, 10 % whole GPUs, bound round-robin),
as the API server would list them. Measured: the initial lists (nodes, then every assigned pod, as
the extender's start reads them), the memory they take (this process's RSS before and after), a pod-status update (a
MODIFIED event changing nothing gpupack counts), a node whose GPU inventory changes (a device
plugin restarting), a node deleted and added back (the autoscaler), and a filter (keep_best 1);
then per pod shape (bench_scheduler.py's burst draws, 40 shapes): the first filter of each (every
node fitted), the memory a kept shape's answers take, each shape's next filter after the policy
learned (every node scored again); the same with the shape warmer (extender/verbs/warming.py): its CPU
per shape, the filter after it, the filter after the policy learned (the old order serving) and
the warmer's rescoring per shape; each shape's first filter with the shipped --new-shape-budget-ms
(extender/verbs/sampling.py), the nodes it looked at, and how the node it answered scores against the
whole answer's; and a /metrics scrape (the per-GPU gauges), then the next one with no node
changed (again_cpu_s). Times are this process's CPU time (on a shared machine wall time measures
the neighbours).

    python benchmarks/bench_view.py [--nodes 5000 --pods 100000] [--json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "extender"))

from bench_scale import running_pods, with_uid  # noqa: E402
from bench_scheduler import gpu_pod, shipped_extender_args  # noqa: E402
from ext_helpers import container, node_obj, pod_obj  # noqa: E402

from extender.api.wire import ExtenderArgs  # noqa: E402
from extender.state.gpu_gauges import render  # noqa: E402
from extender.state.placement_index import shape_of  # noqa: E402
from extender.state.view import ClusterView  # noqa: E402
from extender.verbs.config import ExtenderConfig  # noqa: E402
from extender.verbs.framework import Extender  # noqa: E402
from gpupack.contract import ANN_INVENTORY  # noqa: E402
from gpupack.core.learning import OBSERVE_FLUSH_S  # noqa: E402
from gpupack.core.policies import get_policy  # noqa: E402

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def timed(fn: Any, n: int) -> dict[str, float]:
    t = []
    for i in range(n):
        t0 = time.process_time()
        fn(i)
        t.append(time.process_time() - t0)
    t.sort()
    return {
        "mean_ms": round(1000 * statistics.fmean(t), 4),
        "p99_ms": round(1000 * t[int(0.99 * (len(t) - 1))], 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--pods", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    names = [f"n{i:05d}" for i in range(args.nodes)]
    nodes = [node_obj(n) for n in names]
    pods = running_pods(rng, names, args.pods)
    for i, p in enumerate(pods):  # as listed: with a uid, Running
        p["metadata"]["uid"] = f"uid-{i}"
        if p["metadata"]["annotations"]:
            p["metadata"]["annotations"] = with_uid(p, f"uid-{i}")
        p["metadata"]["resourceVersion"] = str(i + 1)
        p["status"] = {"phase": "Running"}
    res: dict[str, Any] = {"bench": "view", "nodes": args.nodes, "pods": args.pods}

    gc.collect()
    rss0 = rss_bytes()
    t0 = time.process_time()
    view = ClusterView(track_host=True)
    view.replace_nodes(nodes)
    t1 = time.process_time()
    view.replace_assigned_pages([pods[i : i + 500] for i in range(0, len(pods), 500)])
    view.synced.set()
    t2 = time.process_time()
    gc.collect()
    mem = rss_bytes() - rss0
    res["list_nodes_s"], res["list_pods_s"] = round(t1 - t0, 2), round(t2 - t1, 2)
    res["view_mib"] = round(mem / 2**20, 1)
    res["view_bytes_per_pod"] = round(mem / max(args.pods, 1))
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))

    gpu_pods = [p for p in pods if p["metadata"]["annotations"]]
    cpu_pods = [p for p in pods if not p["metadata"]["annotations"]]

    def status(sample: list[dict[str, Any]]) -> Any:
        def one(i: int) -> None:
            p = copy.copy(sample[i % len(sample)])
            p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(i % 2 == 0)}]}
            view.apply_assigned(p)

        return one

    res["status_update_gpu_pod"] = timed(status(gpu_pods), 5000)
    res["status_update_cpu_pod"] = timed(status(cpu_pods), 5000)

    def inventory_change(i: int) -> None:
        n = copy.deepcopy(nodes[i % len(nodes)])
        inv = json.loads(n["metadata"]["annotations"][ANN_INVENTORY])
        inv["driver"] = f"bench-{i}"  # a field the decoder ignores or keeps: the raw text differs
        n["metadata"]["annotations"][ANN_INVENTORY] = json.dumps(inv)
        view.apply_node(n)

    res["node_inventory_change"] = timed(inventory_change, 200)

    def node_cycle(i: int) -> None:
        n = nodes[(i * 7) % len(nodes)]
        view.delete_node(n["metadata"]["name"])
        view.apply_node(n)

    res["node_delete_and_add"] = timed(node_cycle, 100)
    names_all = list(view.nodes)
    share = lambda i: pod_obj(f"asked-{i}", [container("main", 1, 20000, 30)], uid=f"uid-a{i}")  # noqa: E731
    ext.filter(ExtenderArgs(share(-1), names_all, None))
    res["filter"] = timed(lambda i: ext.filter(ExtenderArgs(share(i), names_all, None)), 200)
    res.update(shape_costs(ext, view, names_all, args.seed))
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return 0


def shape_costs(ext: Extender, view: ClusterView, names: list[str], seed: int) -> dict[str, Any]:
    """What pod shapes cost: see the module's doc."""
    draws = random.Random(seed)
    shapes: dict[str, dict[str, Any]] = {}
    for i in range(4000):
        p = gpu_pod(draws, i, "gpu")
        spec = json.dumps(
            [p["metadata"].get("labels"), p["spec"]["containers"][0]["resources"]], sort_keys=True
        )
        shapes.setdefault(spec, p)
    pods = list(shapes.values())
    for i, p in enumerate(pods):
        p["metadata"]["uid"] = f"uid-s{i}"
    gc.collect()
    rss0 = rss_bytes()
    first = timed(lambda i: ext.filter(ExtenderArgs(pods[i], names, None)), len(pods))
    gc.collect()
    kept_mib = (rss_bytes() - rss0) / 2**20 / len(pods)
    # the policy learns (its batch is due once OBSERVE_FLUSH_S have passed): every shape's scores go
    later = ext.learner.batcher.clock() + OBSERVE_FLUSH_S + 1
    ext.learner.batcher.clock = lambda: later
    learnt = ext.learner.epoch
    again = [
        {**p, "metadata": {**p["metadata"], "uid": p["metadata"]["uid"] + "-again"}} for p in pods
    ]  # new pods
    after = timed(lambda i: ext.filter(ExtenderArgs(again[i], names, None)), len(pods))
    assert ext.learner.epoch > learnt, "the policy did not learn"
    warmed = warmer_costs(view, names, pods)
    sampled = sampled_costs(view, names, pods, ext.policy)
    ext.metrics.attach_view(view)
    t0 = time.process_time()
    text = render(ext.metrics.registry)
    t1 = time.process_time()
    # the next scrape with no node changed since: every node's lines are kept
    render(ext.metrics.registry)
    t2 = time.process_time()
    return {
        "shapes": len(pods),
        "shape_first_filter": first,
        "shape_kept_mib": round(kept_mib, 2),
        "shape_filter_after_learning": after,
        **warmed,
        **sampled,
        "metrics_scrape": {"bytes": len(text), "cpu_s": round(t1 - t0, 2), "again_cpu_s": round(t2 - t1, 3)},
    }


def warmer_costs(view: ClusterView, names: list[str], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The same shapes through the shape warmer (extender/verbs/warming.py) of another extender on the
    same view (its caches empty): the warmer's CPU per shape, the filter after it, and after the
    policy learnt: the filter while the old order serves, then the warmer's rescoring per shape."""
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    ext.warmer.attach()
    reqs = [ext.pod_request(p) for p in pods]
    warm = timed(lambda i: ext.warmer.warm(reqs[i]), len(pods))
    warmed = [{**p, "metadata": {**p["metadata"], "uid": p["metadata"]["uid"] + "-w"}} for p in pods]
    filter_warmed = timed(lambda i: ext.filter(ExtenderArgs(warmed[i], names, None)), len(pods))
    later = ext.learner.batcher.clock() + OBSERVE_FLUSH_S + 1
    ext.learner.batcher.clock = lambda: later
    learnt = ext.learner.epoch
    again = [{**p, "metadata": {**p["metadata"], "uid": p["metadata"]["uid"] + "-wa"}} for p in pods]
    stale = timed(lambda i: ext.filter(ExtenderArgs(again[i], names, None)), len(pods))
    assert ext.learner.epoch > learnt, "the policy did not learn"
    queued = []
    while (item := ext.warmer._next(0)) is not None:
        queued.append(item)
    rescore = timed(lambda i: ext.warmer.warm(*queued[i]), len(queued))
    return {
        "warmer_per_shape": warm,
        "shape_filter_warmed": filter_warmed,
        "shape_filter_after_learning_warmer": stale,
        "warmer_rescore_per_shape": rescore,
    }


def sampled_costs(
    view: ClusterView, names: list[str], pods: list[dict[str, Any]], learnt: Any
) -> dict[str, Any]:
    """Each shape's first filter with the shipped --new-shape-budget-ms (extender/verbs/sampling.py) in
    an extender of its own (caches empty), and what the sample cost the pod: the node it answered
    against the whole answer's (another extender, no budget, same pods in the same order), and the
    policy's raw score of each (0..99; how much lower the sampled node scores). Both policies are
    given the workload `learnt` (a policy) has learnt, and learn nothing more: a learning policy
    flushes by the clock too, so the two would score by different workloads."""
    budget = shipped_budget_s()

    def policy() -> Any:
        return get_policy("gpupack", workload=copy.deepcopy(learnt.workload))

    sampler = Extender(
        view, policy(), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1, new_shape_budget_s=budget)
    )
    whole = Extender(view, policy(), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    asked = [{**p, "metadata": {**p["metadata"], "uid": p["metadata"]["uid"] + "-s"}} for p in pods]
    picks: list[str] = []
    looked: list[int] = []

    def unexpect(p: dict[str, Any]) -> None:
        # no bind follows: the node answered is not kept from the next filters (BindLocks.expected)
        m = p["metadata"]
        view.locks.expect(m["uid"], f"{m.get('namespace', 'default')}/{m['name']}", (), 0.0)

    def sampled(i: int) -> None:
        picks.append(sampler.filter(ExtenderArgs(asked[i], names, None))["NodeNames"][0])
        unexpect(asked[i])
        got = sampler.filtering.cost.sampled
        looked.append(got[0] if got is not None else len(names))

    first = timed(sampled, len(pods))
    same, gaps = 0, []
    for i, p in enumerate(asked):
        best = whole.filter(ExtenderArgs(p, names, None))["NodeNames"][0]
        unexpect(p)
        req = whole.pod_request(p)
        table = whole.scorer.scores.table((shape_of(req), whole.learner.epoch))
        gap = (table[best][1] or 0.0) - (table[picks[i]][1] or 0.0)
        same += gap == 0
        gaps.append(gap)
    return {
        "new_shape_budget_ms": budget * 1000,
        "shape_first_filter_sampled": first,
        "sampled_nodes_looked_at": {"p50": statistics.median(looked), "min": min(looked), "max": max(looked)},
        "sampled_best_scored": f"{same} of {len(pods)}",
        "sampled_score_gap": {"mean": round(statistics.fmean(gaps), 2), "max": max(gaps)},
    }


def shipped_budget_s() -> float:
    """deploy/scheduler/deployment.yaml's --new-shape-budget-ms, in seconds."""
    for a in shipped_extender_args():
        if a.startswith("--new-shape-budget-ms="):
            return float(a.split("=", 1)[1]) / 1000
    raise SystemExit("deploy/scheduler/deployment.yaml sets no --new-shape-budget-ms")


if __name__ == "__main__":
    sys.exit(main())
