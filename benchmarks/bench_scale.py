"""The extender at a fleet's size (issue 29): N nodes x 8 H100 and M running pods in the API server
before the extender starts, then steady pod-status updates, then a burst of GPU pods.

One real control plane (tests/realk8s.py, $GPUPACK_K8S_ASSETS or ../shared/k8s). The running pods
are created bound to the fake nodes (spec.nodeName set, from several processes, see
pod_creator.py), as an inference fleet has them: 60 % CPU-only, 30 % GPU shares and 10 % whole
GPUs, the GPU pods with their assignment and handoff done, every pod with CPU and memory requests.
Then, measured:

- cold start: `gpupack extender` (the shipped scheduling flags) from process start to ready, its
  initial lists included; its RSS (master + worker) then;
- CPU per watch event: the extender's CPU seconds while --updates-per-s pod-status updates a second
  are made for --updates-s seconds, less its idle CPU over as long just before (the baseline);
  the rate the harness reached, and the CPU share that rate cost (and at 1,000/s, from the per-event
  cost when the harness could not reach it);
- a burst of --burst GPU pods through the real kube-scheduler with the shipped profile, beside the
  plain scheduler given the same number of CPU/memory pods (bench_scheduler.py's phases): rates,
  ratio, and the extender's filter p50/p99 during the burst;
- at the end, the extender's full garbage collections over its life (`gc_full`: count, seconds)
  and its CPU seconds.

    python benchmarks/bench_scale.py                                  # 500 nodes, 10,000 pods
    python benchmarks/bench_scale.py --nodes 5000 --pods 100000 --burst 2000 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
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
from bench_scheduler import (  # noqa: E402
    HOST,
    Scheduler,
    counter,
    gpu_pod,
    plain_pod,
    run_phase,
    shipped_extender_args,
)
from ext_helpers import DevicePluginEmulator, gpu_node  # noqa: E402
from pod_creator import PodCreator  # noqa: E402
from processes import ExtenderProcess, descendants, give_extender_cpus  # noqa: E402

from gpupack.contract import (  # noqa: E402
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    Assignment,
    GPUShare,
    decode_assignment,
)

GPUS = 8
# an 8 x H100 server as inference fleets run them (2 x 56 cores, 2 TiB): ~20 pods a node leave room
# for the burst's 16-CPU pods, which the tests' 64-CPU default node would not
NODE_HOST = {"cpu": "224", "memory": "2Ti"}
SHARE = (20000, 30)  # MiB, SM % of a running share; two fit a GPU


def running_pods(rng: random.Random, nodes: list[str], n: int) -> list[dict[str, Any]]:
    """`n` pods bound round-robin over `nodes`; the GPU ones take GPUs in order, two shares a GPU."""
    gpu_next = {node: 0 for node in nodes}  # node -> GPU slot (two shares or one whole per GPU)
    out = []
    for i in range(n):
        node = nodes[i % len(nodes)]
        kind = rng.choices(["cpu", "share", "whole"], weights=[60, 30, 10])[0]
        cpu, mem = rng.choice(HOST["share"])
        c: dict[str, Any] = {"name": "c", "image": "registry.invalid/x:1",
                             "resources": {"requests": {"cpu": cpu, "memory": mem}}}  # fmt: skip
        ann: dict[str, str] = {}
        slot = gpu_next[node]
        if kind != "cpu" and slot < 2 * GPUS:
            gpu = slot // 2
            if kind == "whole" and slot % 2 == 0:
                share, gpu_next[node] = (
                    GPUShare(f"GPU-{node}-{gpu}", gpu, 81559, 100, exclusive=True),
                    slot + 2,
                )
                lim = {"gpupack.io/gpu": "1"}
            else:
                share, gpu_next[node] = GPUShare(f"GPU-{node}-{gpu}", gpu, SHARE[0], SHARE[1]), slot + 1
                lim = {
                    "gpupack.io/gpu": "1",
                    "gpupack.io/gpu-mem": str(SHARE[0]),
                    "gpupack.io/gpu-sm": str(SHARE[1]),
                }
            c["resources"]["limits"] = lim
            c["resources"]["requests"].update(lim)
            a = Assignment("", node, "online", {"c": (share,)})  # its UID once created: with_uid
            ann = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
        out.append({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"run-{i}", "namespace": "running", "annotations": ann,
                                 "labels": {"gpupack.io/class": "online"}},
                    "spec": {"nodeName": node, "schedulerName": "gpupack-scheduler", "containers": [c]}})  # fmt: skip
    return out


def with_uid(pod: dict[str, Any], uid: str) -> dict[str, str]:
    """The pod's gpupack annotations, its assignment written for `uid` (the extender charges an
    assignment only to the pod UID it names; the API server gives the UID at creation)."""
    ann = dict(pod["metadata"]["annotations"])
    ann[ANN_ASSIGNMENT] = dataclasses.replace(decode_assignment(ann[ANN_ASSIGNMENT]), pod_uid=uid).to_json()
    return ann


def create_running(creator: PodCreator, pods: list[dict[str, Any]]) -> None:
    """Create `pods` (from running_pods) bound to their nodes; the GPU pods get their annotations,
    with their UID, once created."""
    bare = [{**p, "metadata": {k: v for k, v in p["metadata"].items() if k != "annotations"}} for p in pods]
    uids = creator.create_uids("running", bare)
    creator.annotate("running", [(p["metadata"]["name"], with_uid(p, uids[p["metadata"]["name"]]))
                                 for p in pods if p["metadata"]["annotations"]])  # fmt: skip


def cpu_of(pid: int) -> float:
    """CPU seconds of a process and its descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_mib(pid: int) -> float:
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return round(total, 1)


def gc_full(metrics: str) -> dict[str, float]:
    """Count and seconds of the extender's full collections, from its /metrics text."""
    name = "gpupack_extender_gc_full_seconds"
    return {
        "count": int(counter(metrics, name + "_count")),
        "seconds": round(counter(metrics, name + "_sum"), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--pods", type=int, default=10000, help="running pods before the extender starts")
    ap.add_argument("--burst", type=int, default=500, help="GPU pods (and plain pods) in the burst")
    ap.add_argument("--updates-per-s", type=float, default=1000.0)
    ap.add_argument("--updates-s", type=float, default=10.0)
    ap.add_argument("--admit-ms", type=float, default=100.0)
    ap.add_argument("--creator-procs", type=int, default=4)
    ap.add_argument("--extender-cpus", type=int, default=0, help="the extender on this many CPUs of its own")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    res: dict[str, Any] = {"bench": "scale", "nodes": args.nodes, "gpus": args.nodes * GPUS, "pods": args.pods,
                           "burst": args.burst, "cpus": os.cpu_count()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
        tmp = Path(d)
        cp = realk8s.ControlPlane(tmp).start()
        ext: ExtenderProcess | None = None
        creator: PodCreator | None = None
        scheds: list[Scheduler] = []
        try:
            creator = PodCreator(cp.url, str(cp.ca_file), cp.token, args.creator_procs)
            names = [f"n{i:05d}" for i in range(args.nodes)]
            t = time.monotonic()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda n: gpu_node(cp, n, **NODE_HOST), names))
            res["setup_nodes_s"] = round(time.monotonic() - t, 1)
            for ns in ("running", "plain", "gpu", "gpupack-system"):
                cp.ensure_namespace(ns)
            pods = running_pods(rng, names, args.pods)
            t = time.monotonic()
            create_running(creator, pods)
            res["setup_pods_s"] = round(time.monotonic() - t, 1)
            res["running_gpu_pods"] = sum(1 for p in pods if p["metadata"]["annotations"])

            fence = ["--lease-namespace", "gpupack-system", "--lease-name", "gpupack-scheduler"]
            ext = ExtenderProcess(cp.write_kubeconfig(tmp / "ext.kubeconfig"), tmp / "extender.log",
                                  *fence, *shipped_extender_args())  # fmt: skip
            res["cold_start_s"] = round(ext.wait_ready(600), 2)
            res["rss_mib_ready"] = rss_mib(ext.proc.pid)
            if args.extender_cpus:
                res["pinned_cpus"] = give_extender_cpus(ext, args.extender_cpus)

            # CPU per watch event: idle first (the baseline), then the status updates
            c0 = cpu_of(ext.proc.pid)
            time.sleep(args.updates_s)
            idle = cpu_of(ext.proc.pid) - c0
            run_names = [p["metadata"]["name"] for p in pods]
            c0, t = cpu_of(ext.proc.pid), time.monotonic()
            made = creator.patch_status("running", run_names, args.updates_per_s, args.updates_s)
            wall = time.monotonic() - t
            busy = cpu_of(ext.proc.pid) - c0 - idle * wall / args.updates_s
            rate = made / wall
            per_event_ms = 1000 * busy / max(made, 1)
            res["updates"] = {"asked_per_s": args.updates_per_s, "made": made, "per_s": round(rate, 1),
                              "extender_idle_cpu": round(idle / args.updates_s, 3),
                              "extender_cpu_at_rate": round(busy / wall, 3),
                              "cpu_ms_per_event": round(per_event_ms, 3),
                              "cpu_at_1000_per_s": round(per_event_ms, 3)}  # fmt: skip
            res["rss_mib_after_updates"] = rss_mib(ext.proc.pid)

            scheds.append(Scheduler(cp, {"apiVersion": "kubescheduler.config.k8s.io/v1",
                                         "kind": "KubeSchedulerConfiguration"}, "plain-scheduler", 500, 1000))  # fmt: skip
            gcfg = realk8s.gpupack_scheduler_config(ext.url)
            le = dict(gcfg.get("leaderElection") or {}, leaderElect=True, resourceLock="leases")
            scheds.append(Scheduler(cp, gcfg, "gpupack-scheduler", 500, 1000, leader_election=le))
            plugin = DevicePluginEmulator(cp, static_inventory=True)
            delay = args.admit_ms / 1000
            with realk8s.KubeletEmulator(cp, "plain", admit_delay=delay), \
                    realk8s.KubeletEmulator(cp, "gpu", admit_delay=delay, on_admit=plugin):  # fmt: skip
                prng = random.Random(args.seed)
                plain = run_phase(cp, "plain", [plain_pod(prng, i, "plain") for i in range(args.burst)],
                                  scheds[0], None, args.timeout, creator)  # fmt: skip
                gp = run_phase(cp, "gpu", [gpu_pod(rng, i, "gpu") for i in range(args.burst)],
                               scheds[1], ext, args.timeout, creator)  # fmt: skip
            lat = gp["extender"]["latency"]
            res["burst"] = {
                "plain_pods_per_s": plain["pods_per_s"], "gpupack_pods_per_s": gp["pods_per_s"],
                "ratio": round(gp["pods_per_s"] / max(plain["pods_per_s"], 1e-9), 3),
                "created_per_s": gp["created_per_s"], "bound": gp["bound"],
                "bound_p99_s": gp["bound_p99_s"], "admit_p50_s": gp["admit_p50_s"], "admit_p99_s": gp["admit_p99_s"],
                "filter_p50_ms": lat["filter"]["p50_ms"], "filter_p99_ms": lat["filter"]["p99_ms"],
                "filter_from_body_p99_ms": lat["filter_from_body"]["p99_ms"],
                "correctness": gp["correctness"], "cpu_s": gp["cpu_s"],
            }  # fmt: skip
            res["rss_mib_end"] = rss_mib(ext.proc.pid)
            # GPU pods the extender charges: every running one and the burst's, or its view is not the
            # cluster's (its cluster gauges come from the replica whose scheduler holds the Lease)
            text = ext.http.get(ext.url + "/metrics", timeout=60).text
            m = re.search(r"^gpupack_cluster_pods (\S+)$", text, re.M)
            res["charged_gpu_pods"] = int(float(m.group(1))) if m else None
            # the extender's full garbage collections over its whole life (extender/verbs/collector.py)
            # and its CPU seconds: a collection holds the GIL for as long as it walks the heap
            res["gc_full"] = gc_full(text)
            res["extender_cpu_s"] = round(cpu_of(ext.proc.pid), 1)
            res["gpu_pods_expected"] = res["running_gpu_pods"] + gp["bound"]
            res["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        finally:
            if creator is not None:
                creator.close()
            for s in scheds:
                s.proc.stop()
            if ext is not None:
                ext.stop()
            cp.stop()
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
