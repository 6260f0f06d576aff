"""Benchmark the scheduler extender over real HTTP: the extender process against a real
Kubernetes control plane (etcd + kube-apiserver v1.28.7, tests/realk8s.py; the binaries come from
$GPUPACK_K8S_ASSETS or ../shared/k8s), nodeCacheCapable: true.

Per cluster size (nodes x 8 GPUs of 80 GiB): a stream of GPU pods of mixed shapes is scheduled
like the kube-scheduler does it: filter, prioritize (one pod at a time, the scheduling cycle),
then bind asynchronously (a pool of binding goroutines -> threads). A "kubelet" thread completes
each pod's GPU handoff right after its bind, as a real kubelet admitting the pod would.

Reported (after a warm-up of --warmup pods): client-side latency p50/p99 of filter, prioritize, filter+prioritize and bind; the
first filter of a new pod shape over every node (cold, no equivalence cache); sustained pods/s.
Memory: extender RSS and resync time with N GPU pods already assigned in the cluster.

    python benchmarks/bench_extender.py                  # 100, 1000, 5000 nodes; 50,000 pods
    python benchmarks/bench_extender.py --nodes 1000 --pods 500 --json
    python benchmarks/bench_extender.py --nodes 1000 --pods 500 --inproc   # one process, no HTTP
    python benchmarks/bench_extender.py --nodes 1000 --pods 500 --extender-cpus 1  # CPUs of its own

With --keep-best N (default 1, as deploy/ runs the extender: --filter-keep-best=1) filter passes the
policy's best node only and, as kube-scheduler does with one feasible node, no prioritize follows:
"filter+prioritize" is then the filter alone. --keep-best 0: every fitting node, then prioritize.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import realk8s  # noqa: E402
from processes import ExtenderProcess, descendants, give_extender_cpus  # noqa: E402

from gpupack.contract import (  # noqa: E402
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    LABEL_CLASS,
    LABEL_GPU_COUNT,
    LABEL_GPU_MODEL,
    LABEL_GPU_NODE,
    LABEL_MANAGED,
    RES_GPU,
    SLOTS_PER_GPU,
    Assignment,
    GPUInfo,
    GPUShare,
    NodeInventory,
)

GPU_MIB = 81559
SHAPES = [  # (class, gpus, mem MiB or None, sm % or None)
    ("online", 1, 8192, 20),
    ("online", 1, 16384, 30),
    ("online", 1, 24576, 40),
    ("online", 1, 40960, 50),
    ("offline", 1, 20000, 50),
    ("offline", 1, 10240, 25),
    ("offline", 1, None, None),
    ("offline", 2, None, None),
]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def node_obj(name: str) -> dict[str, Any]:
    """A GPU node as the device plugin publishes it (labels, inventory) and its kubelet's allocatable,
    without conditions (nothing of gpupack's reads them)."""
    model = "NVIDIA-H100-80GB-HBM3"
    inv = NodeInventory(gpus=tuple(GPUInfo(f"GPU-{name}-{i}", i, model, GPU_MIB, 132) for i in range(8)))
    labels = {
        "kubernetes.io/hostname": name,
        LABEL_GPU_NODE: "true",
        LABEL_GPU_MODEL: model,
        LABEL_GPU_COUNT: "8",
    }
    # what a kubelet of an 8-GPU server reports, with the `gpupack.io/gpu` slots: the extender
    # places no pod beyond any of them (it checks what kube-scheduler's NodeResourcesFit would)
    res = {
        "cpu": "224",
        "memory": "2Ti",
        "ephemeral-storage": "7Ti",
        "pods": "250",
        RES_GPU: str(SLOTS_PER_GPU * 8),
    }
    status = {"allocatable": res, "capacity": dict(res)}
    return {"metadata": {"name": name, "labels": labels, "annotations": {ANN_INVENTORY: inv.to_json()}}, "spec": {},
            "status": status}  # fmt: skip


class Cluster:
    """One real control plane (etcd + kube-apiserver, no controller manager: nothing here needs
    one) for the whole run, emptied between measurements."""

    def __init__(self, workdir: Path) -> None:
        self.cp = realk8s.ControlPlane(workdir).start(controller_manager=False)
        self.cp.ensure_namespace("default")  # its ServiceAccount: pods need it
        self.core = self.cp.core
        self.pool = ThreadPoolExecutor(16)

    def create_nodes(self, names: list[str]) -> None:
        def create(n: str) -> None:
            obj = node_obj(n)
            self.core.create_node(obj, _preload_content=False)  # status is ignored on create
            self.core.patch_node_status(n, {"status": obj["status"]}, _preload_content=False)

        list(self.pool.map(create, names))

    def create_pods(self, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        def create(p: dict[str, Any]) -> dict[str, Any]:
            return json.loads(self.core.create_namespaced_pod("default", p, _preload_content=False).data)

        return list(self.pool.map(create, pods))

    def empty(self) -> None:
        self.core.delete_collection_namespaced_pod("default", grace_period_seconds=0)
        self.core.delete_collection_node()

    def stop(self) -> None:
        self.pool.shutdown()
        self.cp.stop()


def pod_obj(name: str, shape: tuple) -> dict[str, Any]:
    cls, gpus, mem, sm = shape
    limits = {RES_GPU: str(gpus)}
    if mem:
        limits["gpupack.io/gpu-mem"] = str(mem)
    if sm:
        limits["gpupack.io/gpu-sm"] = str(sm)
    return {
        "metadata": {"name": name, "namespace": "default", "labels": {LABEL_CLASS: cls}},
        "spec": {
            "schedulerName": "gpupack-scheduler",
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
        },
    }


class Extender(ExtenderProcess):
    """The shared launcher with more request threads, a benchmark's patience and RSS readings."""

    def __init__(self, kubeconfig: Path, log: Path, *extra: str) -> None:
        super().__init__(kubeconfig, log, "--threads", "32", *extra)

    def wait_ready(self, timeout: float = 900) -> float:
        return super().wait_ready(timeout)

    def worker_rss_mib(self) -> float:
        """The extender's RSS: its one process (the verbs' server and the state) and any child."""
        total = 0.0
        for pid in descendants(self.proc.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
            except OSError:
                pass
        return total


def kubeconfig_in(tmp: Path, cluster: Cluster) -> Path:
    return cluster.cp.write_kubeconfig(tmp / "kubeconfig")


def bench_scheduling(
    cluster: Cluster,
    n_nodes: int,
    n_pods: int,
    seed: int,
    tmp: Path,
    warmup: int,
    keep_best: int = 1,
    extender_cpus: int = 0,
) -> dict[str, Any]:
    rng = random.Random(seed)
    cluster.empty()
    names = [f"node-{i:05d}" for i in range(n_nodes)]
    cluster.create_nodes(names)
    pods = cluster.create_pods([pod_obj(f"p{i:06d}", rng.choice(SHAPES)) for i in range(n_pods)])
    ext = Extender(
        kubeconfig_in(tmp, cluster), tmp / f"extender-{n_nodes}.log", f"--filter-keep-best={keep_best}"
    )
    try:
        ready_s = ext.wait_ready()
        pinned = give_extender_cpus(ext, extender_cpus) if extender_cpus else None
        http = requests.Session()

        server: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}

        def server_time(verb: str, r: requests.Response) -> None:
            st = r.headers.get("Server-Timing", "")
            if "dur=" in st:
                server[verb].append(float(st.split("dur=")[1]) / 1000)

        def post(verb: str, body: dict) -> tuple[float, Any]:
            data = json.dumps(body)
            t0 = time.perf_counter()
            r = http.post(f"{ext.url}/{verb}", data=data, headers={"Content-Type": "application/json"})
            dt = time.perf_counter() - t0
            r.raise_for_status()
            server_time(verb, r)
            return dt, r.json()

        # cold: first filter of each shape over every node (the equivalence cache is empty)
        cold = []
        for j, shape in enumerate(SHAPES):
            probe = pod_obj(f"cold{j}", shape)
            probe["metadata"]["uid"] = f"cold-{j}"
            cold.append(post("filter", {"Pod": probe, "NodeNames": names, "Nodes": None})[0])

        filt, prio, both, binds = [], [], [], []
        bind_err = []
        lock = threading.Lock()
        bind_http = threading.local()

        def kubelet(name: str) -> None:
            body = {"metadata": {"annotations": {ANN_HANDOFF: HANDOFF_DONE}}}
            cluster.core.patch_namespaced_pod(name, "default", body, _preload_content=False)

        def bind(p: dict, node: str) -> None:
            s = getattr(bind_http, "s", None) or requests.Session()
            bind_http.s = s
            body = {
                "PodName": p["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": p["metadata"]["uid"],
                "Node": node,
            }
            t0 = time.perf_counter()
            r = s.post(f"{ext.url}/bind", data=json.dumps(body), headers={"Content-Type": "application/json"})
            dt = time.perf_counter() - t0
            err = r.json().get("Error") if r.status_code == 200 else r.text
            with lock:
                server_time("bind", r)
                binds.append(dt)
                if err:
                    bind_err.append(err)
            if not err:
                kubelet(p["metadata"]["name"])

        unschedulable = 0
        warm = {k: 0 for k in server}
        warm_n = (0, 0, 0)
        t_all = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            for i, p in enumerate(pods):
                if i == warmup:
                    # steady state from here: the policy has learned the mix, caches are warm
                    warm = {k: len(v) for k, v in server.items()}
                    warm_n = (len(filt), len(prio), len(both))
                    t_all = time.perf_counter()
                body = {"Pod": p, "NodeNames": names, "Nodes": None}
                df, out = post("filter", body)
                ok = out["NodeNames"]
                if not ok:
                    unschedulable += 1
                    filt.append(df)
                    continue
                if len(ok) == 1 and keep_best:
                    # kube-scheduler calls no prioritize for a single feasible node
                    filt.append(df)
                    both.append(df)
                    pool.submit(bind, p, ok[0])
                    continue
                dp, scores = post("prioritize", {"Pod": p, "NodeNames": ok, "Nodes": None})
                filt.append(df)
                prio.append(dp)
                both.append(df + dp)
                best = max(scores, key=lambda s: (s["Score"], rng.random()))["Host"]
                pool.submit(bind, p, best)
        wall = time.perf_counter() - t_all
        ms = lambda v: round(v * 1000, 2)  # noqa: E731
        warmup_fp_max = max(both[: warm_n[2]], default=0.0)
        filt, prio, both = filt[warm_n[0] :], prio[warm_n[1] :], both[warm_n[2] :]
        for k in ("filter", "prioritize"):
            server[k] = server[k][warm[k] :]
        if keep_best:  # (nearly) every pod had one feasible node and no prioritize
            sv_both = list(server["filter"])
        else:
            n_sv = min(len(server["filter"]), len(server["prioritize"]))
            sv_both = [
                a + b for a, b in zip(server["filter"][-n_sv:], server["prioritize"][-n_sv:], strict=True)
            ]
        return {
            "server_ms": {v: {"p50": ms(pct(server[v], 50)), "p99": ms(pct(server[v], 99))} for v in server}
            | {"filter_plus_prioritize": {"p50": ms(pct(sv_both, 50)), "p99": ms(pct(sv_both, 99))}},
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "keep_best": keep_best,
            "pinned_cpus": pinned,
            "nodes": n_nodes,
            "gpus": n_nodes * 8,
            "pods": n_pods,
            "ready_s": round(ready_s, 2),
            "filter_cold_ms": {"p50": ms(statistics.median(cold)), "max": ms(max(cold))},
            "filter_ms": {"p50": ms(pct(filt, 50)), "p99": ms(pct(filt, 99))},
            "prioritize_ms": {"p50": ms(pct(prio, 50)), "p99": ms(pct(prio, 99))},
            "filter_plus_prioritize_ms": {"p50": ms(pct(both, 50)), "p99": ms(pct(both, 99))},
            "bind_ms": {"p50": ms(pct(binds, 50)), "p99": ms(pct(binds, 99))},
            "bound": len(binds) - len(bind_err),
            "bind_errors": len(bind_err),
            "bind_error_sample": bind_err[:3],
            "unschedulable": unschedulable,
            "pods_per_s": round((n_pods - warmup) / wall, 1),
            "warmup_pods": warmup,
            "warmup_filter_plus_prioritize_max_ms": ms(warmup_fp_max),
            "extender_rss_mib": round(ext.worker_rss_mib(), 1),
        }
    finally:
        ext.stop()


def bench_inproc(
    n_nodes: int, n_pods: int, seed: int, warmup: int, keep_best: int = 1, drop: int = 0
) -> dict[str, Any]:
    """The same stream in one process without HTTP or API server: JSON decode + parse, filter,
    prioritize, encode, then an immediate bind into the view (assume). Shows the extender's own
    cost apart from the GIL contention with bind and watch threads that the HTTP run includes.
    `drop`: each filter is asked about every node but `drop` random ones, as when kube-scheduler's
    own filters leave out nodes (their CPU taken, say) that change from pod to pod."""
    from extender.api.wire import parse_extender_args
    from extender.serve.app import _encode
    from extender.state.view import ClusterView
    from extender.verbs.binding import assignment_from_fit
    from extender.verbs.config import ExtenderConfig
    from extender.verbs.framework import Extender as Ext
    from gpupack.core.policies import get_policy

    rng = random.Random(seed)
    view = ClusterView()
    view.replace_nodes([node_obj(f"node-{i:05d}") for i in range(n_nodes)])
    view.synced.set()
    ext = Ext(view, get_policy("gpupack"), None, ExtenderConfig(keep_best=keep_best))
    names = list(view.nodes)
    t: dict[str, list[float]] = {"filter": [], "prioritize": [], "filter_plus_prioritize": []}
    for i in range(n_pods):
        p = pod_obj(f"p{i:06d}", rng.choice(SHAPES))
        p["metadata"]["uid"] = f"uid-{i}"
        asked = names
        if drop:
            left_out = set(rng.sample(names, drop))
            asked = [n for n in names if n not in left_out]
        body = json.dumps({"Pod": p, "NodeNames": asked, "Nodes": None}).encode()
        t0 = time.perf_counter()
        out = ext.filter(parse_extender_args(json.loads(body)))
        _encode(out)
        df = time.perf_counter() - t0
        ok = out["NodeNames"]
        if not ok:
            continue
        if len(ok) == 1 and keep_best:
            hosts, scores, dp = ok, [1], 0.0
        else:
            hosts, scores, dp = prioritized(ext, p, ok)
        if i >= warmup:
            t["filter"].append(df)
            if dp:
                t["prioritize"].append(dp)
            t["filter_plus_prioritize"].append(df + dp)
        top = max(scores)
        best = min((h for h, s in zip(hosts, scores, strict=True) if s == top), key=lambda _: rng.random())
        req = ext.pod_request(p)
        with view.lock:
            f, _ = ext.placements.node_fit(best, req, ext.clock(), None)
            a = assignment_from_fit(
                view.state.nodes[best], req, f, ext.clock(), "", view.nodes[best].gpu_indexes
            )
            view.assume(req.key, req.uid, a, frozenset())
        view.locks.expect(req.uid, req.key, (), 0.0)  # its bind has come (BindLocks.claim drops it so)
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    return {"nodes": n_nodes, "pods": n_pods, "warmup_pods": warmup, "keep_best": keep_best, "drop": drop} | {
        k: {"p50": ms(pct(v, 50)), "p99": ms(pct(v, 99))} for k, v in t.items()
    }


def prioritized(ext: Any, p: dict[str, Any], ok: list[str]) -> tuple[list[str], list[int], float]:
    """Prioritize over the nodes that passed: (hosts, scores, seconds it took, encoding included)."""
    from extender.api.wire import parse_extender_args
    from extender.serve.app import _encode_scores

    body = json.dumps({"Pod": p, "NodeNames": ok, "Nodes": None}).encode()
    t0 = time.perf_counter()
    hosts, scores = ext.scores_for(parse_extender_args(json.loads(body)))
    _encode_scores(hosts, scores)
    return hosts, scores, time.perf_counter() - t0


def bench_memory(cluster: Cluster, n_nodes: int, n_pods: int, seed: int, tmp: Path) -> dict[str, Any]:
    """Extender worker RSS and resync time with n_pods GPU pods already assigned and bound."""
    rng = random.Random(seed)
    cluster.empty()
    names = [f"node-{i:05d}" for i in range(n_nodes)]
    cluster.create_nodes(names)
    t0 = time.monotonic()
    todo = []
    for i in range(n_pods):
        node = names[i % n_nodes]
        gpu = (i // n_nodes) % 8
        mem = rng.choice([4096, 8192, 10240])
        a = Assignment(f"uid-{i}", node, "online", {"main": (GPUShare(f"GPU-{node}-{gpu}", gpu, mem, 10),)})
        p = pod_obj(f"m{i:06d}", ("online", 1, mem, 10))
        p["metadata"]["labels"][LABEL_MANAGED] = "true"
        p["metadata"]["annotations"] = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
        p["spec"]["nodeName"] = node
        todo.append(p)
    cluster.create_pods(todo)
    build_s = time.monotonic() - t0
    base = Extender(kubeconfig_in(tmp, cluster), tmp / "extender-empty.log")
    # then the baseline: an extender on the same nodes once the pods are gone
    try:
        ready_s = base.wait_ready()
        time.sleep(1.0)
        rss = base.worker_rss_mib()
        metrics = requests.get(base.url + "/metrics", timeout=30).text
        pods_line = next(ln for ln in metrics.splitlines() if ln.startswith("gpupack_cluster_pods "))
    finally:
        base.stop()
    cluster.core.delete_collection_namespaced_pod("default", grace_period_seconds=0)
    empty = Extender(kubeconfig_in(tmp, cluster), tmp / "extender-nopods.log")
    try:
        empty.wait_ready()
        time.sleep(1.0)
        rss_nodes_only = empty.worker_rss_mib()
    finally:
        empty.stop()
    return {
        "nodes": n_nodes,
        "gpu_pods": n_pods,
        "pods_in_view": int(float(pods_line.split()[1])),
        "resync_s": round(ready_s, 2),
        "extender_rss_mib": round(rss, 1),
        "extender_rss_nodes_only_mib": round(rss_nodes_only, 1),
        "kib_per_pod": round((rss - rss_nodes_only) * 1024 / n_pods, 2),
        "cluster_build_s": round(build_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, action="append", help="cluster sizes (default 100, 1000, 5000)")
    ap.add_argument(
        "--pods", type=int, default=0, help="pods scheduled per size (default: 3 x nodes, 300..3000)"
    )
    ap.add_argument("--memory-pods", type=int, default=50_000, help="GPU pods for the memory run; 0 skips it")
    ap.add_argument("--memory-nodes", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--warmup",
        type=int,
        default=200,
        help="pods scheduled before measuring (the learning policy's first batches, cold shapes)",
    )
    ap.add_argument("--inproc", action="store_true", help="one process without HTTP (no memory run)")
    ap.add_argument(
        "--drop-nodes",
        type=int,
        default=0,
        help="--inproc: each filter leaves out this many random nodes (kube-scheduler's own filters)",
    )
    ap.add_argument(
        "--keep-best",
        type=int,
        default=1,
        help="the extender's --filter-keep-best (default 1, as deployed; 0: filter then prioritize)",
    )
    ap.add_argument(
        "--extender-cpus",
        type=int,
        default=0,
        help="give the extender this many CPUs of its own (Linux; everything else gets the others)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "scheduling": [], "memory": None}
    if args.inproc:
        results = {"cpus": os.cpu_count(), "inproc": []}
        for n in args.nodes or [100, 1000, 5000]:
            pods = args.pods or min(3000, max(300, 3 * n))
            r = bench_inproc(n, pods + args.warmup, args.seed, args.warmup, args.keep_best, args.drop_nodes)
            results["inproc"].append(r)
            if not args.json:
                print(
                    f"{n:>5} nodes, in-process{f', {args.drop_nodes} left out each time' if args.drop_nodes else ''}: "
                    + ", ".join(
                        f"{k} {r[k]['p50']}/{r[k]['p99']} ms"
                        for k in ("filter", "prioritize", "filter_plus_prioritize")
                    ),
                    flush=True,
                )
        if args.json:
            print(json.dumps(results, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cluster = Cluster(tmp / "k8s")
        try:
            run_http(args, results, cluster, tmp)
        finally:
            cluster.stop()
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def run_http(args: argparse.Namespace, results: dict[str, Any], cluster: Cluster, tmp: Path) -> None:
    for n in args.nodes or [100, 1000, 5000]:
        pods = args.pods or min(3000, max(300, 3 * n))
        r = bench_scheduling(
            cluster, n, pods + args.warmup, args.seed, tmp, args.warmup, args.keep_best, args.extender_cpus
        )
        results["scheduling"].append(r)
        if not args.json:
            print(
                f"{n:>5} nodes x 8 GPUs, {pods} pods after {args.warmup} warm-up: filter p50/p99 {r['filter_ms']['p50']}/{r['filter_ms']['p99']} ms"
                f" (cold {r['filter_cold_ms']['p50']} ms), prioritize {r['prioritize_ms']['p50']}/"
                f"{r['prioritize_ms']['p99']} ms, filter+prioritize {r['filter_plus_prioritize_ms']['p50']}/"
                f"{r['filter_plus_prioritize_ms']['p99']} ms, bind {r['bind_ms']['p50']}/{r['bind_ms']['p99']} ms,"
                f" {r['pods_per_s']} pods/s, bound {r['bound']}, unschedulable {r['unschedulable']},"
                f" RSS {r['extender_rss_mib']} MiB; warm-up filter+prioritize max"
                f" {r['warmup_filter_plus_prioritize_max_ms']} ms",
                flush=True,
            )
            sv = r["server_ms"]
            print(
                f"       server side: filter {sv['filter']['p50']}/{sv['filter']['p99']} ms, prioritize "
                f"{sv['prioritize']['p50']}/{sv['prioritize']['p99']} ms, filter+prioritize "
                f"{sv['filter_plus_prioritize']['p50']}/{sv['filter_plus_prioritize']['p99']} ms, bind "
                f"{sv['bind']['p50']}/{sv['bind']['p99']} ms (load average {r['load_avg_1m']} on {os.cpu_count()} CPUs"
                + (f"; extender on CPUs {r['pinned_cpus']['extender']}" if r["pinned_cpus"] else "")
                + ")",
                flush=True,
            )
    if args.memory_pods:
        m = bench_memory(cluster, args.memory_nodes, args.memory_pods, args.seed, tmp)
        results["memory"] = m
        if not args.json:
            print(
                f"memory: {m['gpu_pods']} GPU pods on {m['nodes']} nodes: extender RSS {m['extender_rss_mib']} MiB"
                f" ({m['extender_rss_nodes_only_mib']} MiB with nodes only, {m['kib_per_pod']} KiB/pod),"
                f" resync {m['resync_s']} s",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
