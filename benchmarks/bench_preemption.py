"""GPU-aware preemption at scale, through the real kube-scheduler (shipped profile) and the real
extender with its preemption controller (issue 26).

N nodes x G GPUs full of offline shares (per GPU, a seeded mix of 2-4 offline pods: 40+40, 20x4,
40+20+20 or 30+30+20 GB; placed directly, bound with their assignments, as a filled cluster would
be); a tenth of the GPUs hold pods that a PodDisruptionBudget allowing no disruption covers. Then
P online pods (40,000 MiB, 40 % SM, a higher PriorityClass) arrive at once. Two of them fit on a
GPU, so at least P/2 GPUs must be emptied of offline pods.

Reported: seconds from the first online pod's creation to all of them bound (handoff done), and
the same for the same P pods on the same number of empty nodes (the baseline, measured first in
the same run: what scheduling alone costs), and their ratio; victims in all, per preemptor, and
against the minimum an offline solver finds (the P/2 unprotected GPUs with the fewest offline
pods: exact here, since every online pod needs a GPU free of offline pods and two share one);
over-committed GPUs and budget violations (evicted protected pods) at the end.

    python benchmarks/bench_preemption.py                         # 10 nodes x 8 GPUs, 20 online pods
    python benchmarks/bench_preemption.py --nodes 100 --online 200 --json
"""

from __future__ import annotations

import argparse
import json
import random
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
from ext_helpers import H100_MIB, DevicePluginEmulator, container, gpu_node, list_pods, pod_obj  # noqa: E402
from kubernetes import client  # noqa: E402
from processes import ExtenderProcess  # noqa: E402

from gpupack.contract import (  # noqa: E402
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    Assignment,
    GPUShare,
    decode_assignment,
)

MIXES = ([40000, 40000], [20000] * 4, [40000, 20000, 20000], [30000, 30000, 20000])
ONLINE_MIB, ONLINE_SM, OFFLINE_SM = 40000, 40, 20
HIGH, LOW = "bench-online", "bench-offline"


def priority_classes(cp: realk8s.ControlPlane) -> None:
    sch = client.SchedulingV1Api(cp.api_client())
    for name, value in ((HIGH, 100000), (LOW, 100)):
        try:
            sch.create_priority_class({"metadata": {"name": name}, "value": value})
        except client.ApiException as e:
            if e.status != 409:
                raise


def online_pod(i: int, ns: str) -> dict[str, Any]:
    p = pod_obj(f"web-{i}", [container("main", 1, ONLINE_MIB, ONLINE_SM)], cls="online", namespace=ns)
    p["spec"]["priorityClassName"] = HIGH
    p["spec"]["terminationGracePeriodSeconds"] = 5
    return p


def fill(cp: realk8s.ControlPlane, ns: str, nodes: list[str], gpus: int, seed: int) -> dict[str, Any]:
    """Offline pods bound on every GPU; returns per GPU the pods and whether a budget covers them."""
    rng = random.Random(seed)
    core = cp.core
    plan = []
    layout: dict[str, dict[str, Any]] = {}
    for n in nodes:
        for g in range(gpus):
            protected = rng.random() < 0.1
            uuid = f"GPU-{n}-{g}"
            layout[uuid] = {"pods": [], "protected": protected}
            for k, mem in enumerate(rng.choice(MIXES)):
                name = f"off-{n}-{g}-{k}"
                layout[uuid]["pods"].append(name)
                plan.append((name, n, g, uuid, mem, protected))

    def one(item: tuple[str, str, int, str, int, bool]) -> None:
        name, n, g, uuid, mem, protected = item
        body = pod_obj(name, [container("main", 1, mem, OFFLINE_SM)], cls="offline", namespace=ns)
        body["spec"].update(nodeName=n, priorityClassName=LOW, terminationGracePeriodSeconds=5)
        if protected:
            body["metadata"]["labels"]["keep"] = "yes"
        body.pop("status")
        made = core.create_namespaced_pod(ns, body)
        a = Assignment(made.metadata.uid, n, "offline", {"main": (GPUShare(uuid, g, mem, OFFLINE_SM),)})
        ann = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE, ANN_ALLOCATED: '["main"]'}
        core.patch_namespaced_pod(name, ns, {"metadata": {"annotations": ann}})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, plan))
    n_keep = sum(1 for item in plan if item[5])
    client.PolicyV1Api(cp.api_client()).create_namespaced_pod_disruption_budget(
        ns,
        {
            "metadata": {"name": "keep"},
            "spec": {"minAvailable": n_keep, "selector": {"matchLabels": {"keep": "yes"}}},
        },
    )
    return layout


def wait_bound(cp: realk8s.ControlPlane, ns: str, names: set[str], cap_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < cap_s:
        done = sum(
            1
            for p in list_pods(cp.core, ns)
            if p["metadata"]["name"] in names
            and p["spec"].get("nodeName")
            and (p["metadata"].get("annotations") or {}).get(ANN_HANDOFF) == HANDOFF_DONE
        )
        if done == len(names):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def create_online(cp: realk8s.ControlPlane, ns: str, count: int) -> set[str]:
    core = cp.core
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(ns, online_pod(i, ns)), range(count)))
    return {f"web-{i}" for i in range(count)}


def overcommitted(pods: list[dict[str, Any]]) -> int:
    use: dict[str, list[Any]] = {}
    for p in pods:
        ann = (p["metadata"].get("annotations") or {}).get(ANN_ASSIGNMENT)
        if not p["spec"].get("nodeName") or not ann:
            continue
        a = decode_assignment(ann)
        for shares in a.containers.values():
            for s in shares:
                use.setdefault(s.uuid, []).append((s.mem_mib, s.sm_pct, a.pod_class))
    bad = 0
    for held in use.values():
        if (
            sum(m for m, _, _ in held) > H100_MIB
            or sum(k for _, k, _ in held) > 100
            or len({c for *_, c in held}) > 1
        ):
            bad += 1
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--online", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--cap-s", type=float, default=600.0, help="give up waiting for the online pods after this long"
    )
    ap.add_argument(
        "--preemption-interval-s", type=float, default=2.0, help="the extender's flag (shipped: 2)"
    )
    ap.add_argument("--log-level", default="warning", help="the extender's (its log is in the run's folder)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if realk8s.assets_dir() is None:
        print(realk8s.HOW_TO_GET, file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="gpupack-preempt-"))
    cp = realk8s.ControlPlane(tmp)
    print(f"logs in {tmp}", file=sys.stderr)
    out: dict[str, Any] = {"nodes": a.nodes, "gpus_per_node": a.gpus, "online_pods": a.online, "seed": a.seed}
    ext = sched = None
    try:
        cp.start(controller_manager=True)  # the disruption controller computes the budget
        out["kubernetes"] = "v{}.{}".format(*cp.server_version())
        priority_classes(cp)
        ext = ExtenderProcess(
            cp.write_kubeconfig(tmp / "kc"), tmp / "extender.log",
            "--preemption-interval-s", str(a.preemption_interval_s), "--log-level", a.log_level,
        )  # fmt: skip
        ext.wait_ready(60)
        sched = cp.start_scheduler(realk8s.gpupack_scheduler_config(ext.url), name="kube-scheduler")
        plugin = DevicePluginEmulator(cp, static_inventory=True)
        # baseline: the same pods on as many empty nodes
        cp.ensure_namespace("bench-base")
        base_nodes = [f"base-{i}" for i in range(a.nodes)]
        for n in base_nodes:
            gpu_node(cp, n, a.gpus)
        with realk8s.KubeletEmulator(cp, "bench-base", on_admit=plugin):
            t_base = wait_bound(cp, "bench-base", create_online(cp, "bench-base", a.online), a.cap_s)
        cp.core.delete_collection_namespaced_pod("bench-base", grace_period_seconds=0)
        for n in base_nodes:
            cp.core.delete_node(n)
        # the filled cluster
        ns = "bench-fill"
        cp.ensure_namespace(ns)
        nodes = [f"gpu-{i}" for i in range(a.nodes)]
        for n in nodes:
            gpu_node(cp, n, a.gpus)
        with realk8s.KubeletEmulator(cp, ns, on_admit=plugin) as kubelet:
            t_fill = time.monotonic()
            layout = fill(cp, ns, nodes, a.gpus, a.seed)
            offline = {p for g in layout.values() for p in g["pods"]}
            protected = {p for g in layout.values() if g["protected"] for p in g["pods"]}
            pol = client.PolicyV1Api(cp.api_client())
            realk8s.until(
                lambda: (st := pol.read_namespaced_pod_disruption_budget("keep", ns).status) is not None
                and (st.observed_generation or 0) >= 1 and st.current_healthy == len(protected)
                and st.disruptions_allowed == 0,
                300, "the budget computed",
            )  # fmt: skip
            out["fill_s"] = round(time.monotonic() - t_fill, 1)
            t_pre = wait_bound(cp, ns, create_online(cp, ns, a.online), a.cap_s)
            pods = list_pods(cp.core, ns)
            out["kubelet_errors"] = len(kubelet.errors)
        left = {p["metadata"]["name"] for p in pods}
        evicted = offline - left
        free_gpus = sorted(len(g["pods"]) for g in layout.values() if not g["protected"])
        minimum = sum(free_gpus[: (a.online + 1) // 2])
        out.update(
            baseline_all_bound_s=None if t_base is None else round(t_base, 2),
            preemption_all_bound_s=None if t_pre is None else round(t_pre, 2),
            ratio=None if not (t_base and t_pre) else round(t_pre / t_base, 2),
            offline_pods=len(offline),
            victims=len(evicted),
            victims_per_preemptor=round(len(evicted) / a.online, 2),
            offline_minimum=minimum,
            victims_over_minimum=round(len(evicted) / minimum, 3) if minimum else None,
            overcommitted_gpus=overcommitted(pods),
            pdb_violations=len(evicted & protected),
            plugin_errors=len(plugin.errors),
        )
    finally:
        if sched is not None:
            sched.stop()
        if ext is not None:
            ext.stop()
        cp.stop()
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{out['kubernetes']}: {a.nodes} nodes x {a.gpus} GPUs, {out['offline_pods']} offline pods, "
              f"{a.online} online pods at once")  # fmt: skip
        print(f"  all bound: {out['preemption_all_bound_s']} s with preemption, {out['baseline_all_bound_s']} s "
              f"on empty nodes (ratio {out['ratio']})")  # fmt: skip
        print(f"  victims {out['victims']} ({out['victims_per_preemptor']} per preemptor), offline minimum "
              f"{out['offline_minimum']} (x{out['victims_over_minimum']})")  # fmt: skip
        print(f"  over-committed GPUs {out['overcommitted_gpus']}, budget violations {out['pdb_violations']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
