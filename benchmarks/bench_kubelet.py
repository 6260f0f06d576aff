"""The throughput benchmark's kubelet stand-in alone (issue 29): how long after its bind a GPU pod
is Running, against the admission latency the stand-in was asked for.

One real control plane (tests/realk8s.py) with --nodes fake nodes x 8 H100; --pods whole-GPU pods
are created (from worker processes, benchmarks/pod_creator.py) for a scheduler that does not run,
then bound by those workers at --rate Bindings a second, each carrying the assignment and
`handoff: pending` as the extender's Binding does. The stand-in under test (the kubelets and
gpupack's device plugin of bench_scheduler.py) admits them after --admit-ms; a watch records when
each pod was seen bound and Running. No kube-scheduler and no extender run, so what is left
between bind and Running is the stand-in's (and the API server's) own time.

    python benchmarks/bench_kubelet.py --admit-ms 1000 --rate 60 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "extender"))

import realk8s  # noqa: E402
from bench_scheduler import ROLES, Observer, check_gpus, cpu_seconds, cpu_used, pct  # noqa: E402
from ext_helpers import H100_MIB, container, gpu_node, pod_obj  # noqa: E402
from kubelet_procs import STAND_INS, start_stand_in  # noqa: E402
from pod_creator import PodCreator  # noqa: E402

from gpupack.contract import Assignment, GPUShare  # noqa: E402
from gpupack.handoff import binding_annotations  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--rate", type=float, default=60.0, help="Bindings a second")
    ap.add_argument("--admit-ms", type=float, default=1000.0, help="admission latency asked of the stand-in")
    ap.add_argument("--stand-in", choices=STAND_INS, default=STAND_INS[0], help="which kubelet stand-in")
    ap.add_argument("--procs", type=int, default=4, help="worker processes creating and binding")
    ap.add_argument("--stand-in-procs", type=int, default=1, help="processes of --stand-in procs")
    ap.add_argument("--admit-concurrency", type=int, default=0, help="admissions in flight (0: the default)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args(argv)
    if args.pods > args.nodes * 8:
        raise SystemExit("--pods: at most 8 a node (one whole GPU each)")
    ns = "gpu"
    out: dict[str, Any] = {"bench": "kubelet", **{k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-kubelet-") as d:
        cp = realk8s.ControlPlane(Path(d)).start()
        creator = None
        try:
            creator = PodCreator(cp.url, str(cp.ca_file), cp.token, args.procs)
            ROLES.update(dict.fromkeys(creator.pids(), "pod creators (binding here)"))
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: gpu_node(cp, f"n{i:05d}"), range(args.nodes)))
            cp.ensure_namespace(ns)
            pods = [pod_obj(f"p-{i}", [container("c", 1)], namespace=ns) for i in range(args.pods)]
            for p in pods:
                p["spec"]["schedulerName"] = "nobody"  # no scheduler binds them: the workers do
            creator.create(ns, pods)
            items = json.loads(cp.core.list_namespaced_pod(ns, _preload_content=False).data)["items"]
            uid = {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}
            binds = []
            for i in range(args.pods):
                name, node, gpu = f"p-{i}", f"n{i % args.nodes:05d}", i // args.nodes
                share = GPUShare(
                    uuid=f"GPU-{node}-{gpu}", index=gpu, mem_mib=H100_MIB, sm_pct=100, exclusive=True
                )
                a = Assignment(pod_uid=uid[name], node=node, pod_class="online", containers={"c": (share,)})
                binds.append((name, node, binding_annotations(a)))
            obs = Observer(cp, ns)
            with start_stand_in(
                args.stand_in, cp, None, args.admit_ms / 1000, args.stand_in_procs, args.admit_concurrency
            ) as stand_in:
                ROLES.update(dict.fromkeys(stand_in.pids(), "kubelet stand-in"))
                time.sleep(0.5)  # the observing watch is open
                c0 = cpu_seconds()
                t0 = time.monotonic()
                answered = creator.bind(ns, binds, args.rate)
                deadline = t0 + args.timeout
                while time.monotonic() < deadline and len(obs.running) < args.pods:
                    time.sleep(0.1)
                cpu = cpu_used(c0, cpu_seconds())
                errors = stand_in.errors()
            obs.stop.set()
            names = [b[0] for b in binds]
            admit = [obs.running[n] - obs.bound[n] for n in names if n in obs.running and n in obs.bound]
            from_bind = [obs.running[n] - answered[n] for n in names if n in obs.running and n in answered]
            lag = [obs.bound[n] - answered[n] for n in names if n in obs.bound and n in answered]
            span = max(answered.values()) - t0 if answered else float("nan")
            out.update({
                "bound": len(obs.bound), "running": len(obs.running),
                "bind_rate_reached": round(len(answered) / max(span, 1e-9), 1),
                # bound (as a watch saw it) -> Running: what bench_scheduler.py reports
                "admit_p50_s": round(pct(admit, 50), 3), "admit_p99_s": round(pct(admit, 99), 3),
                "admit_max_s": round(max(admit, default=float("nan")), 3),
                # the Binding's answer -> Running, and the observing watch's own lag
                "from_bind_p50_s": round(pct(from_bind, 50), 3), "from_bind_p99_s": round(pct(from_bind, 99), 3),
                "watch_lag_p99_s": round(pct(lag, 99), 3),
                "correctness": check_gpus(obs.pods),
                "stand_in_errors": errors[:5],
                "cpu_s": cpu,
                "load_avg": [round(x, 2) for x in os.getloadavg()],
            })  # fmt: skip
        finally:
            if creator is not None:
                creator.close()
            cp.stop()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
