"""The extender's filter with many GPU handoffs pending (slow kubelets, issue 29), in one process.

N nodes x 8 H100 in a ClusterView (no API server, no HTTP); P pods bound with their handoff
pending (the kubelet has not admitted them), then --filters filters of GPU-share pods with the
shipped --filter-keep-best=1, each timed in this process's CPU time (on a shared machine wall time
measures the neighbours). The baseline is the same run with no pending handoff.
Where the pending pods are:

- `full`: each on a node of its own that it fills (8 whole GPUs): those nodes never pass, so
  nothing about them should cost the filter anything;
- `best`: 1 GPU share each, placed where the policy puts them one after another (a burst: the
  packing policy prefers exactly these nodes, and every filter has to step over them).

    python benchmarks/bench_pending.py [--nodes 1000] [--pending 500] [--filters 400] [--json]
"""

from __future__ import annotations

import argparse
import json
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

from ext_helpers import container, node_obj, pod_obj  # noqa: E402

from extender.api.wire import ExtenderArgs  # noqa: E402
from extender.state.view import ClusterView  # noqa: E402
from extender.verbs.binding import assignment_from_fit  # noqa: E402
from extender.verbs.config import ExtenderConfig  # noqa: E402
from extender.verbs.framework import Extender  # noqa: E402
from gpupack.core.policies import get_policy  # noqa: E402

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def fleet(n: int) -> tuple[ClusterView, Extender, list[str]]:
    view = ClusterView()
    view.replace_nodes([node_obj(f"node-{i:05d}") for i in range(n)])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    return view, ext, list(view.nodes)


def bind_pending(view: ClusterView, ext: Extender, pod: dict[str, Any], node: str) -> None:
    req = ext.pod_request(pod)
    with view.lock:
        f, _ = ext.placements.node_fit(node, req, NOW, None)
        assert f, f"{req.key} does not fit {node}"
        a = assignment_from_fit(view.state.nodes[node], req, f, NOW, "", view.nodes[node].gpu_indexes)  # type: ignore[arg-type]
        view.assume(req.key, req.uid, a, frozenset())
    view.mark_bound(req.key, node)
    view.locks.expect(req.uid, req.key, (), 0.0)  # its bind has come


def share(name: str) -> dict[str, Any]:
    return pod_obj(name, [container("main", 1, 20000, 30)], uid=f"uid-{name}")


def one(nodes: int, pending: int, where: str, filters: int) -> dict[str, Any]:
    view, ext, names = fleet(nodes)
    for i in range(pending):
        if where == "full":
            bind_pending(view, ext, pod_obj(f"whole-{i}", [container("main", 8)], uid=f"uid-w{i}"), names[i])
        else:
            p = share(f"early-{i}")
            out = ext.filter(ExtenderArgs(p, names, None))["NodeNames"]
            bind_pending(view, ext, p, out[0])
    ext.filter(ExtenderArgs(share("warm"), names, None))
    times = []
    for i in range(filters):
        args = ExtenderArgs(share(f"asked-{i}"), names, None)
        t0 = time.process_time()
        ext.filter(args)
        times.append(time.process_time() - t0)
        view.locks.expect(f"uid-asked-{i}", f"default/asked-{i}", (), 0.0)  # its bind has come
    # the lock question alone, both ways in this run: the walk over every pending handoff that each
    # filter made before issue 29 (locked_nodes), and lock_check asked of one node as filter now
    # asks of the node it keeps
    walk, ask = [], []
    for i in range(filters):
        t0 = time.process_time()
        view.locks.locked_nodes(f"uid-asked-{i}", time.monotonic())
        t1 = time.process_time()
        with view.lock:
            if hasattr(view.locks, "lock_check"):  # (the script also runs against the code before it)
                view.locks.lock_check(f"uid-asked-{i}", time.monotonic())(names[-1])
        walk.append(t1 - t0)
        ask.append(time.process_time() - t1)
    ms = lambda v: round(v * 1000, 3)  # noqa: E731
    return {"nodes": nodes, "pending": len(view.locks.pending), "where": where,
            "filter_p50_ms": ms(pct(times, 50)), "filter_p99_ms": ms(pct(times, 99)),
            "filter_mean_ms": ms(statistics.fmean(times)),
            "walk_all_pending_mean_ms": ms(statistics.fmean(walk)), "ask_one_node_mean_ms": ms(statistics.fmean(ask))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=500)
    ap.add_argument("--filters", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = []
    for where in ("full", "best"):
        base = one(args.nodes, 0, where, args.filters)
        loaded = one(args.nodes, args.pending, where, args.filters)
        runs.append({"where": where, "baseline": base, "pending": loaded,
                     "p50_ratio": round(loaded["filter_p50_ms"] / base["filter_p50_ms"], 2),
                     "p99_ratio": round(loaded["filter_p99_ms"] / base["filter_p99_ms"], 2)})  # fmt: skip
    if args.json:
        print(json.dumps({"bench": "pending", "runs": runs}))
    else:
        for r in runs:
            b, p = r["baseline"], r["pending"]
            print(f"{r['where']:5s} 0 pending: p50/p99 {b['filter_p50_ms']}/{b['filter_p99_ms']} ms   "
                  f"{p['pending']} pending: {p['filter_p50_ms']}/{p['filter_p99_ms']} ms   "
                  f"ratio p50 {r['p50_ratio']} p99 {r['p99_ratio']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
