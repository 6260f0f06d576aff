"""The extender's filter while a queue of GPU pods is bound, in one process: its CPU a pod
and the nodes it fits again, without an API server, kube-scheduler or kubelets sharing the cores.

bench_scheduler.py's `--arrival queued` phase, reduced to the extender's own work: `--nodes` idle
nodes of 8 H100, `--pods` GPU pods drawn as bench_scheduler.py draws them (40 shapes), every one
learnt first and every shape's answer warmed (as the pending-pod watch and the shape warmer do
before kube-scheduler resumes). Then each pod in turn is filtered with the shipped keep_best 1 and
bound where the filter answered, as the bind verb charges it (fit, assume), and its Binding is seen
by the assigned-pod watch; its handoff ends (the kubelet admitted it) `--pending` pods later, so
that many nodes wait for their kubelet at once, as at ~65 pods/s with 1 s admission. A node with a
pending handoff takes no other GPU pod, so the pods spread over many nodes and each filter fits
again the nodes changed since its shape's last filter.

Reported: the filter's CPU a pod (mean, p99), the nodes each filter fitted again, the nodes used,
and the CPU a pod of the bind's fit and assume. CPU time of this process (on a shared machine wall
time measures the neighbours). The placements' digest is the same from run to run: the process
runs with PYTHONHASHSEED 0 (it starts itself again with it when it is not set), as the order of
sets of node names decides ties, and with `time.monotonic` stopped at its value at the start, as
a pod's expected bind (scoring.EXPECT_S) and the learner's batches end by it, and a loaded machine
would stretch the run past them at different pods each time.

    python benchmarks/bench_queue.py [--nodes 1000] [--pods 500] [--pending 65] [--json]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "extender")]

from bench_scheduler import gpu_pod  # noqa: E402
from ext_helpers import node_obj  # noqa: E402

from extender.api.wire import ExtenderArgs  # noqa: E402
from extender.state.placement_index import shape_of  # noqa: E402
from extender.state.records import pod_slots  # noqa: E402
from extender.state.view import ClusterView  # noqa: E402
from extender.verbs.binding import assignment_from_fit  # noqa: E402
from extender.verbs.config import ExtenderConfig  # noqa: E402
from extender.verbs.framework import Extender  # noqa: E402
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, HANDOFF_DONE, HANDOFF_PENDING  # noqa: E402
from gpupack.core.learning import OBSERVE_FLUSH_S  # noqa: E402
from gpupack.core.policies import get_policy  # noqa: E402

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def bind(ext: Extender, pod: dict[str, Any], node: str) -> dict[str, Any]:
    """Charge `pod` on `node` as the bind verb does (fit, assume with its host use), and return the
    pod as the assigned-pod watch then shows it (bound, handoff pending)."""
    view = ext.view
    req = ext.pod_request(pod)
    view.locks.claim(node, req.key, req.uid)  # the bind has arrived: no longer only expected
    with view.lock:
        f, res = ext.placements.node_fit(node, req, NOW, None)
        assert f, f"the filter answered {node}, where the pod no longer fits: {f}"
        a = assignment_from_fit(
            view.state.nodes[node], req, f, NOW, res.id if res else "", view.nodes[node].gpu_indexes
        )
        view.assume(req.key, req.uid, a, frozenset(), pod_slots(pod), req.host)
    bound = copy.deepcopy(pod)
    bound["metadata"]["annotations"] = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_PENDING}
    bound["spec"]["nodeName"] = node
    view.mark_bound(req.key, node)
    view.locks.unclaim(node, req.key)
    return bound


def run(nodes: int, pods: int, pending: int, seed: int) -> dict[str, Any]:
    names = [f"n{i:05d}" for i in range(nodes)]
    view = ClusterView(track_host=True)
    view.replace_nodes([node_obj(n) for n in names])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    draws = random.Random(seed)
    queue = [gpu_pod(draws, i, "bench") for i in range(pods)]
    for i, p in enumerate(queue):
        p["metadata"]["uid"] = f"uid-{i}"
    # every queued pod learnt (the pending-pod watch), in one batch: the batch is due
    clock = ext.learner.batcher.clock
    with view.lock:
        for p in queue:
            ext.learner.observe(ext.pod_request(p))
        ext.learner.batcher.clock = lambda: clock() + OBSERVE_FLUSH_S + 1
        probe = copy.deepcopy(queue[0])
        probe["metadata"]["uid"] = "uid-probe"
        ext.learner.observe(ext.pod_request(probe))
    shapes: dict[Any, dict[str, Any]] = {}
    for p in queue:
        shapes.setdefault(shape_of(ext.pod_request(p)), p)
    for i, p in enumerate(shapes.values()):  # every shape's answer warmed (the shape warmer's work)
        w = copy.deepcopy(p)
        w["metadata"]["uid"] = f"uid-warm-{i}"
        ext.filter(ExtenderArgs(w, names, None))
    waiting: deque[dict[str, Any]] = deque()
    filter_s: list[float] = []
    fitted: list[int] = []
    bind_s = 0.0
    chosen: list[str] = []
    for p in queue:
        t0 = time.process_time()
        out = ext.filter(ExtenderArgs(p, names, None))
        filter_s.append(time.process_time() - t0)
        fitted.append(ext.filtering.cost.fitted)
        assert out["NodeNames"], f"pod {p['metadata']['name']} fits nowhere: {out.get('Error')}"
        chosen.append(out["NodeNames"][0])
        t1 = time.process_time()
        bound = bind(ext, p, out["NodeNames"][0])
        view.apply_assigned(bound)  # the Binding's watch event
        bind_s += time.process_time() - t1
        waiting.append(bound)
        if len(waiting) > pending:  # its kubelet admitted the pod `pending` pods ago
            done = waiting.popleft()
            done["metadata"]["annotations"][ANN_HANDOFF] = HANDOFF_DONE
            done["status"] = {"phase": "Running"}
            view.apply_assigned(done)
    filter_s.sort()
    return {
        "bench": "queue",
        "nodes": nodes,
        "pods": pods,
        "pending": pending,
        "shapes": len(shapes),
        "filter_cpu_ms": {
            "mean": round(1000 * statistics.fmean(filter_s), 3),
            "p99": round(1000 * filter_s[int(0.99 * (len(filter_s) - 1))], 3),
        },
        "nodes_fitted_per_filter": round(statistics.fmean(fitted), 1),
        "bind_cpu_ms": round(1000 * bind_s / pods, 3),
        "nodes_used": len({p.node for p in view.pods.values()}),
        # which node each pod got, in order: equal digests, equal decisions (a change that only
        # makes the filter cheaper must leave it as it was)
        "placements_digest": hashlib.sha256("\n".join(chosen).encode()).hexdigest()[:16],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--pending", type=int, default=65, help="handoffs pending at once (kubelets admitting)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0" and argv is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    stopped = time.monotonic()
    time.monotonic = lambda: stopped  # the extender's clocks, not the CPU time measured
    res = run(args.nodes, args.pods, args.pending, args.seed)
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
