"""Per-node cost of the fragmentation policies' filter and score (`fit` + `node_score`), against the
straightforward implementation they replaced, on a partly filled openb cluster.

    python benchmarks/bench_policy.py [--policy gpupack --policy fgd] [--trace default] [--fill 0.5]
                                      [--probes 100] [--seed 42] [--json]

The openb node list is filled by replaying the first `--fill` of a trace's arrivals (the replay's
own decisions for the gpupack policy), then the next `--probes` arriving pods are each filtered and
scored on every node, as the extender's filter and prioritize verbs do, by the policy and by its
reference (tests/core/test_policy_speedup_equivalence.py: the algorithm before the speed-up). Both
get the same pods in the same order and must return the same Fit and score on every node (checked
here too). Two workload modes:

- `given`: the trace's workload, as the replay and `gpupack extender --workload-file` use it;
  states memoised for one pod help the next.
- `learning`: the policy learns the workload and sees every probe pod first, so its workload
  changes before each pod and no memoised state survives from one pod to the next (the extender
  batches what it learns, so this is its worst case).

Times are CPU seconds per node and pod, split by share pods (one container, part of one GPU) and
whole-GPU pods. Reads the trace from ../shared/data/openb (or $GPUPACK_SHARED/data/openb); skips
with a message when it is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "core")]


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    return (Path(base) if base else ROOT / ".." / "shared") / "data" / "openb"


def filled_cluster(trace: str, fill: float, seed: int):  # type: ignore[no-untyped-def]
    """The openb cluster after the first `fill` of the trace's arrivals, the pods that arrive next,
    and the trace's workload."""
    from gpupack.core.model import FULL, Placement, Share
    from gpupack.simulate.openb import read_nodes, read_pods
    from gpupack.simulate.replay import arrival_order, build_state, pod_request, replay, trace_workload

    d = openb_dir()
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    pods = read_pods(d / f"openb_pod_list_{trace}.csv")
    order = arrival_order(pods, nodes.gpu_capacity, seed)
    workload = trace_workload(pods)
    k = int(len(order) * fill)
    r = replay(nodes, pods, "gpupack", seed, order[:k], workload, keep_decisions=True)
    st = build_state(nodes)
    for step, (n, gpus) in enumerate(r.decisions):
        if n < 0:
            continue
        p = int(order[step])
        pod = pod_request(pods, p, f"default/fill{step}")
        node = st.nodes[nodes.names[n]]
        milli = int(pods.gpu_milli[p])
        if gpus and milli < FULL:
            shares = tuple(Share(g, 0, milli, False) for g in gpus)
            charged = {g: (0, milli, False) for g in gpus}
        else:
            shares = tuple(Share(g, node.gpus[g].mem_mib, FULL, True) for g in gpus)
            charged = {g: (node.gpus[g].mem_mib, FULL, True) for g in gpus}
        st.place(pod, Placement(node.name, {"main": shares} if shares else {}), charged)
    probes = [pod_request(pods, int(p), f"default/probe{i}") for i, p in enumerate(order[k:])]
    return st, probes, workload


def run(policy_cls, st, probes, workload, learning: bool, seed: int):  # type: ignore[no-untyped-def]
    """CPU seconds per pod kind, and every answer (fit's charge and the score, per node and pod)."""
    from gpupack.core.fgd import Workload
    from gpupack.core.fit import Fit

    if learning:
        policy = policy_cls(seed=seed)
        policy.workload = Workload(Counter(workload.counts))
    else:
        policy = policy_cls(seed=seed, workload=workload)
    nodes = list(st.nodes.values())
    spent = {"share": 0.0, "whole": 0.0}
    count = {"share": 0, "whole": 0}
    answers = []
    for pod in probes:
        kind = (
            "share" if any(c.milli is not None or c.mem_mib is not None for c in pod.containers) else "whole"
        )
        if learning:
            policy.observe(pod)
        out = []
        t0 = time.process_time()
        for node in nodes:
            f = policy.fit(node, pod)
            if isinstance(f, Fit):
                out.append((f.charged, f.placement, policy.node_score(node, pod, f)))
            else:
                out.append(f.code)
        spent[kind] += time.process_time() - t0
        count[kind] += len(nodes)
        answers.append(out)
    return spent, count, answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", action="append", choices=["gpupack", "fgd"])
    ap.add_argument("--trace", default="default", help="openb trace variant (openb_pod_list_NAME.csv)")
    ap.add_argument("--fill", type=float, default=0.5, help="fraction of arrivals placed first")
    ap.add_argument("--probes", type=int, default=100, help="GPU pods filtered and scored on every node")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (openb_dir() / "openb_node_list_gpu_node.csv").exists():
        print(f"skipped: no openb trace under {openb_dir()}")
        return 0

    from test_policy_speedup_equivalence import REFERENCE

    from gpupack.core.policies import get_policy

    st, arriving, workload = filled_cluster(args.trace, args.fill, args.seed)
    probes = [p for p in arriving if p.containers][: args.probes]
    result: dict[str, object] = {
        "trace": args.trace,
        "nodes": len(st.nodes),
        "fill": args.fill,
        "probes": len(probes),
        "share_probes": sum(1 for p in probes if p.containers[0].milli is not None),
        "seed": args.seed,
        "runs": [],
    }
    runs: list[dict[str, object]] = []
    for name in args.policy or ["gpupack", "fgd"]:
        for mode in ("given", "learning"):
            row: dict[str, object] = {"policy": name, "mode": mode}
            answers = {}
            for impl, cls in (("reference", REFERENCE[name]), ("shipped", type(get_policy(name)))):
                spent, count, answers[impl] = run(cls, st, probes, workload, mode == "learning", args.seed)
                for kind in spent:
                    if count[kind]:
                        row[f"{impl}_{kind}_us_per_node"] = round(spent[kind] / count[kind] * 1e6, 2)
            if answers["reference"] != answers["shipped"]:
                raise SystemExit(
                    f"{name} ({mode}): the shipped policy answered differently from the reference"
                )
            for kind in ("share", "whole"):
                ref, new = row.get(f"reference_{kind}_us_per_node"), row.get(f"shipped_{kind}_us_per_node")
                if isinstance(ref, float) and isinstance(new, float) and new > 0:
                    row[f"{kind}_speedup"] = round(ref / new, 2)
            runs.append(row)
    result["runs"] = runs
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"openb {args.trace}: {result['nodes']} nodes filled with {args.fill:.0%} of the arrivals; "
        f"{result['probes']} arriving GPU pods ({result['share_probes']} share), every node each"
    )
    print(
        f"{'policy':8} {'mode':9} {'kind':6} {'reference µs/node':>18} {'shipped µs/node':>16} {'speed-up':>9}"
    )
    for row in runs:
        for kind in ("share", "whole"):
            if f"reference_{kind}_us_per_node" in row:
                print(
                    f"{row['policy']:8} {row['mode']:9} {kind:6} {row[f'reference_{kind}_us_per_node']:>18} "
                    f"{row[f'shipped_{kind}_us_per_node']:>16} {row.get(f'{kind}_speedup', '-'):>9}"
                )
    print("every Fit and score identical to the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
