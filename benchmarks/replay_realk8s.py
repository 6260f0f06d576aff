"""Replay a slice of an openb trace through the REAL kube-scheduler and extender, and through the
simulator with the same nodes and arrival order (issue 12).

The first --nodes rows of openb_node_list_gpu_node.csv become fake Ready nodes of a real control
plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler v1.28.7 from $GPUPACK_K8S_ASSETS
or ../shared/k8s; tests/realk8s.py) with the row's CPU, memory, GPU count and model, published as
gpupack's device plugin does (inventory annotation, labels, `gpupack.io/gpu` slots). kube-scheduler
runs the shipped profile (deploy/scheduler/config.yaml, leader election off) in front of the real
`gpupack extender`; the flags it supports among --filter-keep-best and --workload-file are passed
(see `gpupack extender --help`) and reported. A KubeletEmulator admits bound pods and plays the
device plugin's side of the GPU handoff, so the next GPU pod on a node is not held back by it.

Pods: a seeded random subset of the trace in proportion to the slice's GPU capacity (the full list
would starve the slice of CPU), in the simulator's arrival order (gpupack.simulate.replay.
arrival_order), submitted one at a time: each is bound (and its handoff done) or reported
unschedulable (PodScheduled=False; it is then deleted, as the simulator drops it) before the next.
Shares are written as the simulator's `pod_request` reads them: a whole-GPU pod `gpupack.io/gpu: N`;
a share `gpupack.io/gpu: 1` + `gpupack.io/gpu-sm: milli/10` (no gpu-mem: the simulator's shares have
no memory), so the extender parses the same PodRequest; CPU and memory as requests; the allowed
models as the `gpupack.io/gpu-models` annotation. By default submission stops once arrivals pass
101 % of the slice's capacity (--stop-at): the figure is read at 100 %.

Printed: unallocated GPUs at 100 % arrival (the simulator's definition: 100 - the mean allocation
ratio over the arrivals in that bin) for the simulator (its default mode, for gpupack, FGD and
BestFit), the simulator's pipeline mode (gpupack.simulate.pipeline, configured from the shipped
profile and the extender flags in effect) and the real cluster, computed from the pods' assignment
annotations; and how many placements (node, GPUs) differ from each simulation.

`--mode dra`: the same nodes and arrival order through DRA with kube-scheduler's own allocator and
no extender (benchmarks/replay_dra.py; needs v1.36 assets); `--mode both` runs the device-plugin
replay and then that one, each on a control plane of its own. `--mode dra-gpupack`: gpupack's DRA
allocator chooses node and GPU (benchmarks/replay_dra_gpupack.py); `--mode dra-node`: it chooses
only the node (the pod is pinned there), kube-scheduler's in-tree allocator the GPU on it.

    nice -n 10 python benchmarks/replay_realk8s.py                       # 150 nodes, default, seed 42
    python benchmarks/replay_realk8s.py --nodes 20 --seed 1 --policy fgd --json
    GPUPACK_K8S_ASSETS=../shared/k8s-1.36 python benchmarks/replay_realk8s.py --mode dra --seed 43
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "extender"))

import realk8s  # noqa: E402
from ext_helpers import DevicePluginEmulator, container, get_pod, pod_obj  # noqa: E402
from ext_helpers import annotations as pod_annotations  # noqa: E402
from kubernetes import client  # noqa: E402
from processes import ExtenderProcess  # noqa: E402

from gpupack.contract import (  # noqa: E402
    ANN_ASSIGNMENT,
    ANN_GPU_MODELS,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    LABEL_GPU_COUNT,
    LABEL_GPU_MODEL,
    LABEL_GPU_NODE,
    RES_GPU,
    SLOTS_PER_GPU,
    GPUInfo,
    NodeInventory,
    decode_assignment,
)
from gpupack.core.model import FULL  # noqa: E402
from gpupack.simulate.modes import replay_mode  # noqa: E402
from gpupack.simulate.openb import DEFAULT_GPU_MEM_MIB, GPU_MEM_MIB, NodeList, PodList, read_nodes, read_pods  # noqa: E402
from gpupack.simulate.pipeline import PipelineConfig, follow_pipeline, replay_pipeline  # noqa: E402
from gpupack.simulate.replay import Curve, ReplayResult, arrival_order  # noqa: E402

NAMESPACE = "replay"


def data_dir() -> Path:
    env = os.environ.get("GPUPACK_SHARED")
    base = Path(env) if env else ROOT.parent / "shared"
    return base / "data" / "openb"


def node_slice(nodes: NodeList, n: int) -> NodeList:
    return NodeList(nodes.names[:n], nodes.cpu[:n], nodes.ram[:n], nodes.gpus[:n], nodes.model[:n])


def sample_pods(pods: PodList, share: float, seed: int) -> PodList:
    """A seeded random subset of `share` of the pods, in trace order."""
    k = max(1, round(len(pods) * share))
    idx = np.sort(np.random.default_rng(seed).choice(len(pods), k, replace=False))
    return pods.take(idx)


def stop_index(pods: PodList, order: np.ndarray, capacity: int, stop_at: float) -> int:
    """How many arrivals it takes until the arrived GPU request passes `stop_at` % of capacity."""
    if stop_at <= 0:
        return len(order)
    arrived = np.cumsum(pods.gpu_request[order])
    past = np.nonzero(arrived * 100 >= stop_at * capacity)[0]
    return int(past[0]) + 1 if len(past) else len(order)


# --- what is in effect -------------------------------------------------------------------------


@dataclass
class Setup:
    extender_flags: list[str] = field(default_factory=list)
    pipeline: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def extender_help() -> str:
    out = subprocess.run([sys.executable, "-m", "gpupack", "extender", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return out.stdout


def shipped_flag(flag: str) -> str | None:
    """The value deploy/ passes for an extender flag (`--flag=V` or `--flag`, `V`), if any."""
    for f in sorted((ROOT / "deploy").rglob("*.yaml")):
        words = f.read_text().replace('"', " ").replace("'", " ").replace(",", " ").split()
        for i, w in enumerate(words):
            if w.startswith(flag + "="):
                return w.split("=", 1)[1]
            if w == flag and i + 1 < len(words):
                return words[i + 1]
    return None


def decide_setup(args: argparse.Namespace, sub_csv: Path, workdir: Path) -> Setup:
    st = Setup()
    cfg = realk8s.gpupack_scheduler_config("http://127.0.0.1:1")
    (ext,) = cfg["extenders"]
    st.pipeline["extender_weight"] = int(ext.get("weight", 1))
    st.pipeline["cpu_pods_via_extender"] = not ext.get("managedResources")
    st.pipeline["percentage_of_nodes_to_score"] = int(cfg.get("percentageOfNodesToScore") or 0)
    for prof in cfg.get("profiles") or []:
        st.pipeline["percentage_of_nodes_to_score"] = int(
            prof.get("percentageOfNodesToScore") or st.pipeline["percentage_of_nodes_to_score"]
        )
        for pc in prof.get("pluginConfig") or []:
            if pc.get("name") == "NodeResourcesFit":
                strategy = ((pc.get("args") or {}).get("scoringStrategy") or {}).get("type")
                if strategy:
                    st.pipeline["fit_strategy"] = strategy
    help_text = extender_help()
    if "--filter-keep-best" in help_text and args.keep_best != 0:
        n = args.keep_best if args.keep_best > 0 else int(shipped_flag("--filter-keep-best") or 1)
        st.extender_flags += ["--filter-keep-best", str(n)]
        st.pipeline["filter_keep_best"] = n
    if "--policy-seed" in help_text:
        # the simulator's policy breaks ties in its seeded node order: the same seed, the same order
        st.extender_flags += ["--policy-seed", str(args.seed)]
        st.pipeline["extender_seed"] = args.seed
    st.pipeline["learn_workload"] = True
    if "--workload-file" in help_text and args.workload:
        wl = workdir / "workload.json"
        out = subprocess.run(
            [sys.executable, "-m", "gpupack", "simulate", "workload", "--trace", str(sub_csv), "-o", str(wl)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if out.returncode == 0 and wl.is_file():
            st.extender_flags += ["--workload-file", str(wl)]
            st.pipeline["learn_workload"] = False
        else:
            st.notes.append(
                f"gpupack simulate workload failed ({out.stderr.strip()[-200:]}): extender learns"
            )
    # The extender's view of node CPU/memory came with --filter-keep-best (issue 12); --extender-cpu
    # overrides the guess.
    cpu = args.extender_cpu
    st.pipeline["extender_cpu"] = ("--filter-keep-best" in help_text) if cpu == "auto" else cpu == "yes"
    return st


def write_subset_csv(pods: PodList, path: Path) -> None:
    """The sampled pods as an openb pod list (what `gpupack simulate workload --trace` reads)."""
    text = pods.spec_text or ["|".join(sorted(s)) if s else "" for s in pods.spec]
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"]
    for i in range(len(pods)):
        lines.append(f"{pods.names[i]},{int(pods.cpu[i])},{int(pods.ram[i])},{int(pods.num_gpu[i])},"
                     f"{int(pods.gpu_milli[i])},{text[i]}")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


# --- the real cluster --------------------------------------------------------------------------


def make_nodes(cp: realk8s.ControlPlane, nodes: NodeList) -> None:
    for i, name in enumerate(nodes.names):
        n, model = int(nodes.gpus[i]), nodes.model[i]
        mem = GPU_MEM_MIB.get(model, DEFAULT_GPU_MEM_MIB)
        inv = NodeInventory(gpus=tuple(GPUInfo(uuid=f"GPU-{name}-{j}", index=j, model=model, mem_mib=mem,
                                               sm_count=80) for j in range(n)))  # fmt: skip
        cp.make_node(name, cpu=f"{int(nodes.cpu[i])}m", memory=f"{int(nodes.ram[i])}Mi",
                     extended={RES_GPU: str(SLOTS_PER_GPU * n)},
                     labels={LABEL_GPU_NODE: "true", LABEL_GPU_MODEL: model, LABEL_GPU_COUNT: str(n)},
                     annotations={ANN_INVENTORY: inv.to_json()})  # fmt: skip


def pod_body(pods: PodList, i: int, name: str) -> dict[str, Any]:
    num, milli = int(pods.num_gpu[i]), int(pods.gpu_milli[i])
    if num == 0:
        c = container("main")
    elif milli >= FULL:
        c = container("main", gpu=num)
    else:
        assert milli % 10 == 0, f"pod {pods.names[i]}: gpu_milli {milli} is not a whole SM percent"
        c = container("main", gpu=1, sm=milli // 10)
    c["resources"]["requests"].update({"cpu": f"{int(pods.cpu[i])}m", "memory": f"{int(pods.ram[i])}Mi"})
    body = pod_obj(name, [c], cls=None, namespace=NAMESPACE)
    body["spec"]["terminationGracePeriodSeconds"] = 0
    models = pods.spec[i]
    if models:
        body["metadata"]["annotations"] = {ANN_GPU_MODELS: "|".join(sorted(models))}
    return body


def _unschedulable(pod: dict[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            return True
    return False


def submit_one(
    core: client.CoreV1Api, body: dict[str, Any], gpu: bool, timeout: float
) -> dict[str, Any] | None:
    """Create the pod and wait for its outcome: the bound pod (handoff done for a GPU pod), or None
    when kube-scheduler reports it unschedulable (the pod is then deleted)."""
    name = body["metadata"]["name"]
    core.create_namespaced_pod(NAMESPACE, body)
    deadline = time.monotonic() + timeout
    delay = 0.005
    while time.monotonic() < deadline:
        pod = get_pod(core, NAMESPACE, name)
        if pod["spec"].get("nodeName"):
            if not gpu or pod_annotations(pod).get(ANN_HANDOFF) == HANDOFF_DONE:
                return pod
        elif _unschedulable(pod):
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
            return None
        time.sleep(delay)
        delay = min(0.05, delay * 1.5)
    raise TimeoutError(f"pod {name}: neither bound nor unschedulable after {timeout:g}s")


def replay_on_cluster(
    cp: realk8s.ControlPlane,
    sl: NodeList,
    sub: PodList,
    order: np.ndarray,
    policy: str,
    extender_flags: list[str],
    workdir: Path,
    gap_ms: float = 100.0,
    pod_timeout: float = 60.0,
    progress: bool = False,
) -> tuple[ReplayResult, dict[str, Any]]:
    """Nodes, extender, kube-scheduler and kubelets on a running control plane, then the replay.
    The caller owns `cp` (its nodes and namespace stay; a test's fixture resets them)."""
    index = {n: i for i, n in enumerate(sl.names)}
    ext = sched = kubelet = None
    info: dict[str, Any] = {}
    try:
        cp.ensure_namespace(NAMESPACE)
        t0 = time.monotonic()
        make_nodes(cp, sl)
        kc = cp.write_kubeconfig(workdir / "kubeconfig")
        ext = ExtenderProcess(kc, workdir / "extender.log", "--policy", policy, *extender_flags)
        ext.wait_ready(60)
        sched = cp.start_scheduler(realk8s.gpupack_scheduler_config(ext.url), name="gpupack-scheduler")
        kubelet = realk8s.KubeletEmulator(cp, NAMESPACE, on_admit=DevicePluginEmulator(cp)).start()
        info["setup_s"] = round(time.monotonic() - t0, 1)
        core = client.CoreV1Api(cp.new_api_client())
        curve = Curve(sl.gpu_capacity)
        arrived = allocated = placed = failed = 0
        decisions: list[tuple[int, tuple[int, ...]]] = []
        arrivals: list[float] = []  # when each pod was submitted: the pace the extender learnt at
        info["arrivals_s"] = arrivals
        t1 = time.monotonic()
        for step, p in enumerate(order):
            p = int(p)
            req = int(sub.num_gpu[p] * sub.gpu_milli[p])
            arrived += req
            arrivals.append(time.monotonic() - t1)
            pod = submit_one(core, pod_body(sub, p, f"p{step:05d}"), bool(sub.num_gpu[p]), pod_timeout)
            if pod is None:
                decisions.append((-1, ()))
                failed += req
            else:
                gpus: tuple[int, ...] = ()
                got = 0
                raw = pod_annotations(pod).get(ANN_ASSIGNMENT)
                if raw:
                    a = decode_assignment(raw)
                    shares = [s for ss in a.containers.values() for s in ss]
                    gpus = tuple(sorted(s.index for s in shares))
                    got = sum(FULL if s.exclusive else s.sm_pct * 10 for s in shares)
                decisions.append((index[pod["spec"]["nodeName"]], gpus))
                allocated += got
                placed += 1
            curve.add(arrived, allocated)
            if gap_ms:
                time.sleep(gap_ms / 1000)  # the extender's watch sees the handoff end / the pod
            if progress and step % 100 == 0:
                print(f"  real: {step}/{len(order)} pods, {time.monotonic() - t1:.0f}s", file=sys.stderr)
        info["replay_s"] = round(time.monotonic() - t1, 1)
        info["kubelet_errors"] = kubelet.errors[:5]
        return ReplayResult(policy, 0, curve.values(), len(order), placed, failed, decisions), info
    finally:
        if kubelet is not None:
            kubelet.stop()
        if sched is not None:
            sched.stop()
        if ext is not None:
            ext.stop()


def run_real(
    args: argparse.Namespace, sl: NodeList, sub: PodList, order: np.ndarray, st: Setup, workdir: Path
) -> tuple[ReplayResult, dict[str, Any]]:
    cp = realk8s.ControlPlane(workdir / "k8s").start()
    try:
        return replay_on_cluster(cp, sl, sub, order, args.policy, st.extender_flags, workdir,
                                 args.gap_ms, args.pod_timeout, args.progress)  # fmt: skip
    finally:
        cp.stop()


def differ(a: ReplayResult, b: ReplayResult) -> dict[str, int]:
    node = sum(x[0] != y[0] for x, y in zip(a.decisions, b.decisions, strict=True))
    full = sum(x != y for x, y in zip(a.decisions, b.decisions, strict=True))
    first = next((i for i, (x, y) in enumerate(zip(a.decisions, b.decisions, strict=True)) if x != y), -1)
    return {"node": node, "node_or_gpus": full, "first": first}


def first_differences(real: ReplayResult, model: ReplayResult, n: int = 5) -> list[dict[str, Any]]:
    out = []
    for i, (x, y) in enumerate(zip(real.decisions, model.decisions, strict=True)):
        if x != y:
            out.append({"step": i, "real": x, "model": y, "model_tied": i in model.tied})
            if len(out) >= n:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=150)
    ap.add_argument("--trace", default="default", help="openb_pod_list_<NAME>.csv")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--policy", default="gpupack", choices=("gpupack", "fgd", "bestfit"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--data", type=Path, default=None, help="openb directory (default $GPUPACK_SHARED/data/openb)"
    )
    ap.add_argument(
        "--stop-at",
        type=float,
        default=101.0,
        help="stop once arrivals pass this %% of capacity (0: the whole arrival order)",
    )
    ap.add_argument(
        "--keep-best",
        type=int,
        default=-1,
        help="--filter-keep-best for the extender: -1 as deploy/ ships it (1 if not found), 0 off",
    )
    ap.add_argument(
        "--no-workload",
        dest="workload",
        action="store_false",
        help="do not give the extender the workload even if it takes --workload-file",
    )
    ap.add_argument(
        "--extender-cpu",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether the pipeline model's extender sees node CPU/memory (auto: guessed from --help)",
    )
    ap.add_argument("--gap-ms", type=float, default=100.0,
                    help="pause after each pod, so the extender's watch has seen it bound and its handoff end")  # fmt: skip
    ap.add_argument("--pod-timeout", type=float, default=60.0)
    ap.add_argument("--sim-only", action="store_true", help="skip the real cluster")
    ap.add_argument("--mode", choices=("device-plugin", "dra", "both", "dra-gpupack", "dra-node"), default="device-plugin",
                    help="the real cluster: gpupack's extender and device-plugin resources, DRA with "
                         "the in-tree allocator alone (v1.36), or both one after the other")  # fmt: skip
    ap.add_argument("--dra-gap-ms", type=float, default=0.0,
                    help="pause after each pod in the DRA replay (no extender watch to catch up)")  # fmt: skip
    ap.add_argument("--dra-cpu-pods-by-scheduler", action="store_true",
                    help="--mode dra-gpupack / dra-node: CPU-only pods placed by kube-scheduler, not pinned by gpupack")  # fmt: skip
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--what-if", action="append", default=[], metavar="FIELD=VALUE",
                    help="also run the pipeline model with this PipelineConfig field changed (repeatable; "
                         "e.g. cpu_pods_via_extender=true, filter_keep_best=0)")  # fmt: skip
    args = ap.parse_args(argv)

    d = args.data or data_dir()
    nodes = read_nodes(d / "openb_node_list_gpu_node.csv")
    pods = read_pods(d / f"openb_pod_list_{args.trace}.csv")
    sl = node_slice(nodes, args.nodes)
    sub = sample_pods(pods, sl.gpu_capacity / nodes.gpu_capacity, args.seed)
    full_order = arrival_order(sub, sl.gpu_capacity, args.seed)
    order = full_order[: stop_index(sub, full_order, sl.gpu_capacity, args.stop_at)]

    with tempfile.TemporaryDirectory(prefix="replay-realk8s-") as tmp:
        workdir = Path(tmp)
        sub_csv = workdir / "subset.csv"
        write_subset_csv(sub, sub_csv)
        st = decide_setup(args, sub_csv, workdir)
        sims = {
            pol: replay_mode("default", sl, sub, pol, args.seed, order)
            for pol in ("gpupack", "fgd", "bestfit")
        }
        sim = sims[args.policy]
        t = time.monotonic()
        pipe = replay_mode("pipeline", sl, sub, args.policy, args.seed, order, **st.pipeline)
        pipe_s = time.monotonic() - t
        what_if = None
        if args.what_if:
            changed = dict(st.pipeline)
            for kv in args.what_if:
                k, v = kv.split("=", 1)
                changed[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
            what_if = (changed, replay_mode("pipeline", sl, sub, args.policy, args.seed, order, **changed))
        dp = not args.sim_only and args.mode not in ("dra", "dra-gpupack", "dra-node")
        real, info = run_real(args, sl, sub, order, st, workdir) if dp else (None, {})
        dra_real, dra_info = (None, {})
        gp_real, gp_info = (None, {})
        if not args.sim_only and args.mode in ("dra-gpupack", "dra-node"):  # replay_dra_gpupack.py
            import replay_dra_gpupack

            gp_real, gp_info = replay_dra_gpupack.run(sl, sub, order, workdir, ["--policy", args.policy,
                                                      *st.extender_flags], args.pod_timeout, args.progress,
                                                      place_pods=not args.dra_cpu_pods_by_scheduler,
                                                      node_only=args.mode == "dra-node")  # fmt: skip
        if not args.sim_only and args.mode in ("dra", "both"):
            import replay_dra

            dra_real, dra_info = replay_dra.run(sl, sub, order, workdir, args.dra_gap_ms, args.pod_timeout,
                                                args.progress)  # fmt: skip

    out: dict[str, Any] = {
        "nodes": len(sl), "gpus": int(sl.gpus.sum()), "trace": args.trace, "seed": args.seed, "policy": args.policy,
        "pods_sampled": len(sub), "pods_submitted": len(order), "stop_at_pct": args.stop_at,
        "extender_flags": st.extender_flags, "pipeline_config": st.pipeline, "notes": st.notes,
        "unallocated_pct_at_100": {
            **{f"sim_default_{p}": round(r.unallocated_pct_at_100, 2) for p, r in sims.items()},
            f"sim_pipeline_{args.policy}": round(pipe.unallocated_pct_at_100, 2),
        },
        "placed": {"sim_default": sim.placed, "sim_pipeline": pipe.placed},
        "differ_sim_pipeline_vs_default": differ(pipe, sim),
        "pipeline_s": round(pipe_s, 1),
    }  # fmt: skip
    if what_if is not None:
        out["what_if_config"] = what_if[0]
        out["differ_sim_what_if_vs_default"] = differ(what_if[1], sim)
        out["unallocated_pct_at_100"][f"sim_pipeline_what_if_{args.policy}"] = round(
            what_if[1].unallocated_pct_at_100, 2
        )
    if real is not None:
        arrivals = info.pop("arrivals_s")
        out["seconds_per_pod"] = round(info["replay_s"] / max(1, len(order)), 3)
        cfg = PipelineConfig(**st.pipeline)
        follow = follow_pipeline(sl, sub, args.policy, order, real.decisions, config=cfg, arrivals=arrivals)
        if cfg.learn_workload:
            # the extender learnt in batches timed by the real run's pace: the model at that pace
            paced = replay_pipeline(sl, sub, args.policy, args.seed, order, config=cfg, arrivals=arrivals)
            out["unallocated_pct_at_100"][f"sim_pipeline_real_pace_{args.policy}"] = round(
                paced.unallocated_pct_at_100, 2
            )
            out["differ_real_vs_sim_pipeline_real_pace"] = differ(real, paced)
        agree = 0
        for (node, gpus), (best, mgpus) in zip(real.decisions, follow, strict=False):
            if not ((node < 0 and not best) or (node in best and gpus == mgpus)):
                out["first_model_disagreement"] = {
                    "step": agree, "pod": sub.names[int(order[agree])], "real": [node, gpus],
                    "model_best": best, "model_gpus": mgpus,
                    # the last earlier pod on each node involved: a lagging view shows up here
                    "last_pod_on": {str(n): max((i for i, (m, _) in enumerate(real.decisions[:agree]) if m == n),
                                                default=-1) for n in {node, *best[:3]}},
                }  # fmt: skip
                break
            agree += 1
        # Pods in a row, from the first, whose real decision the model (forced along the real run)
        # had among its equal best, GPUs included.
        out["real_decisions_the_model_could_take"] = f"{agree}/{len(order)}"
        out["unallocated_pct_at_100"][f"real_{args.policy}"] = round(real.unallocated_pct_at_100, 2)
        out["placed"]["real"] = real.placed
        out["differ_real_vs_sim_default"] = differ(real, sim)
        out["differ_real_vs_sim_pipeline"] = differ(real, pipe)
        out["pipeline_first_tie"] = pipe.tied[0] if pipe.tied else -1
        out["pipeline_tied_steps"] = len(pipe.tied)
        out["first_differences_real_vs_pipeline"] = first_differences(real, pipe)
        fgd = sims["fgd"].unallocated_pct_at_100
        out["real_vs_sim_same_policy_points"] = round(
            real.unallocated_pct_at_100 - sim.unallocated_pct_at_100, 2
        )
        out["real_below_sim_fgd_pct"] = (
            round(100 * (fgd - real.unallocated_pct_at_100) / fgd, 1) if fgd else None
        )
        out.update(info)
    if dra_real is not None:
        out["unallocated_pct_at_100"]["real_dra_in_tree"] = round(dra_real.unallocated_pct_at_100, 2)
        out["placed"]["real_dra_in_tree"] = dra_real.placed
        out["differ_real_dra_vs_sim_default"] = differ(dra_real, sim)
        out["dra"] = {**dra_info, "seconds_per_pod": round(dra_info["replay_s"] / max(1, len(order)), 3)}
    if gp_real is not None:
        gk = "dra_node" if args.mode == "dra-node" else "dra_gpupack"  # node only / node and GPU
        out["unallocated_pct_at_100"][f"real_{gk}"] = round(gp_real.unallocated_pct_at_100, 2)
        out["placed"][f"real_{gk}"] = gp_real.placed
        out[f"differ_real_{gk}_vs_sim_default"] = differ(gp_real, sim)
        out[gk] = {
            **gp_info,
            "seconds_per_pod": round(gp_info["replay_s"] / max(1, len(order)), 3),
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        u = out["unallocated_pct_at_100"]
        print(f"{out['nodes']} nodes ({out['gpus']} GPUs), trace {args.trace}, seed {args.seed}, policy {args.policy}: "
              f"{len(order)} of {len(sub)} sampled pods submitted (to {args.stop_at:g}% arrival)")  # fmt: skip
        print(f"extender flags: {' '.join(st.extender_flags) or '(none)'}; pipeline model: {st.pipeline}")
        for n in st.notes:
            print(f"note: {n}")
        print("unallocated GPUs at 100% arrival:")
        for k, v in u.items():
            print(f"  {k:<28} {v:6.2f}%")
        print(f"placements differing (node / node or GPUs / first): pipeline vs default "
              f"{tuple(out['differ_sim_pipeline_vs_default'].values())}")  # fmt: skip
        if real is not None:
            print(f"  real vs sim default {tuple(out['differ_real_vs_sim_default'].values())}, "
                  f"real vs sim pipeline {tuple(out['differ_real_vs_sim_pipeline'].values())}")  # fmt: skip
            print(f"real decisions the pipeline model could take (forced along the real run): "
                  f"{out['real_decisions_the_model_could_take']}")  # fmt: skip
            if "first_model_disagreement" in out:
                print(f"  first it could not: {out['first_model_disagreement']}")
            print(f"real - sim ({args.policy}): {out['real_vs_sim_same_policy_points']:+.2f} points; "
                  f"real below sim FGD by {out['real_below_sim_fgd_pct']}%; "
                  f"setup {info['setup_s']}s, replay {info['replay_s']}s")  # fmt: skip
        if gp_real is not None:
            gk = "dra_node" if args.mode == "dra-node" else "dra_gpupack"
            what = "gpupack choosing the node" if gk == "dra_node" else "gpupack allocating"
            print(f"DRA, {what}: {out[gk]} ; placements differing from sim default "
                  f"{tuple(out[f'differ_real_{gk}_vs_sim_default'].values())}")  # fmt: skip
        if dra_real is not None:
            print(f"DRA, in-tree allocator alone: {out['dra']} ; placements differing from sim default "
                  f"{tuple(out['differ_real_dra_vs_sim_default'].values())}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
