"""A morning burst through the real cluster-autoscaler: gpupack's autoscale controller vs the
autoscaler alone (issue 28).

The real control plane (with controller-manager), kube-scheduler with gpupack's shipped profile, the
`gpupack extender` process and the upstream cluster-autoscaler 1.29.5 with its kwok provider
(../shared/k8s). A fleet of 10 GPU nodes in 3 node groups (4 x H100 8-GPU, 3 x A100 4 x 40 GB,
3 x L40S 4 x 48 GB) takes a burst of --pods share pods at once (memory 10/20/40 GB, SM 25 %; a fifth
restricted to A100, a tenth to L40S). The kubelets and device plugins of the nodes the autoscaler
adds are emulated (tests/extender/ca_harness.py), as are the admissions of bound pods.

Two variants, each on a fresh control plane, in the same run:

- gpupack: the extender with `--autoscale-templates` (placeholder pods, scale-down marks);
- baseline: the extender without it, the autoscaler alone (today's behaviour).

Per variant: seconds from the burst to all pods bound (or the pods bound at --cap-s), nodes added
per group, the most placeholders at once. "offline" is gpupack's packing of the whole burst at once
on the fleet (`plan_scale_up` with every pod known: what one omniscient pass would ask for), and
"lower bound" a memory bound per group. --json prints the result as JSON.

    python benchmarks/bench_autoscale.py --pods 200 --json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "extender"))

import realk8s  # noqa: E402
from ca_harness import (  # noqa: E402
    GROUP_LABEL,
    Autoscaler,
    Group,
    NewNodeKubelet,
    existing_node,
    kwok_nodes,
    share_pod,
    write_configmaps,
)
from ext_helpers import DevicePluginEmulator, list_pods  # noqa: E402
from processes import ExtenderProcess  # noqa: E402

from extender.controllers.autoscale_groups import LABEL_PLACEHOLDER  # noqa: E402
from gpupack.core.autoscale import NodeGroup, plan_scale_up  # noqa: E402
from gpupack.core.model import ClusterState, ContainerRequest, PodRequest  # noqa: E402

GROUPS = [
    Group("h100", "NVIDIA-H100-80GB-HBM3", 8, 81559, max_count=30),
    Group("a100", "NVIDIA-A100-SXM4-40GB", 4, 40960, max_count=30),
    Group("l40s", "NVIDIA-L40S", 4, 46068, max_count=30),
]
FLEET = {"h100": 4, "a100": 3, "l40s": 3}


def burst(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        models = GROUPS[1].model if r < 0.2 else GROUPS[2].model if r < 0.3 else None
        out.append(share_pod(f"burst-{i}", rng.choice([10000, 20000, 40000]), 25, models))
    return out


def as_request(pod: dict[str, Any]) -> PodRequest:
    lim = pod["spec"]["containers"][0]["resources"]["limits"]
    models = (pod["metadata"].get("annotations") or {}).get("gpupack.io/gpu-models")
    return PodRequest(pod["metadata"]["name"], "online",
                      (ContainerRequest("c", 1, int(lim["gpupack.io/gpu-mem"]), int(lim["gpupack.io/gpu-sm"]) * 10),),
                      gpu_models=frozenset({models}) if models else None)  # fmt: skip


def offline(pods: list[dict[str, Any]]) -> tuple[dict[str, int], int]:
    """gpupack's packing of the whole burst at once, and a lower bound on the nodes to add (memory
    and SM of the pods each group alone can take, over the fleet's and one new node's)."""
    state = ClusterState()
    for g in GROUPS:
        for i in range(FLEET[g.name]):
            state.add_node(NodeGroup(g.name, g.model, g.gpus, g.mem_mib).template(f"{g.name}-{i}"))
    groups = [NodeGroup(g.name, g.model, g.gpus, g.mem_mib) for g in GROUPS]
    reqs = [as_request(p) for p in pods]
    plan = plan_scale_up(state, reqs, groups)
    # lower bound: pods restricted to a model need that group; the rest fill whatever is left
    bound = 0
    spare_gpus = 0.0
    for g in GROUPS:
        own = [r for r in reqs if r.gpu_models == frozenset({g.model})]
        gpus = max(sum(r.containers[0].mem_mib or 0 for r in own) / g.mem_mib,
                   sum(r.containers[0].milli or 0 for r in own) / 1000)  # fmt: skip
        extra = max(0.0, gpus - FLEET[g.name] * g.gpus)
        bound += math.ceil(extra / g.gpus)
        spare_gpus += max(0.0, FLEET[g.name] * g.gpus - gpus)
    free = [r for r in reqs if r.gpu_models is None]
    h100 = GROUPS[0]
    need = max(sum(r.containers[0].mem_mib or 0 for r in free) / h100.mem_mib,
               sum(r.containers[0].milli or 0 for r in free) / 1000)  # fmt: skip
    bound += max(0, math.ceil((need - spare_gpus) / h100.gpus))
    return plan.nodes, bound


def run_variant(
    variant: str, pods: list[dict[str, Any]], cap_s: float, assets: Path | None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-autoscale-{variant}-"))
    cp = realk8s.ControlPlane(tmp, assets)
    cp.start(controller_manager=True)
    ext = ca = sched = None
    try:
        ns, sysns = "burst", "gpupack-system"
        cp.ensure_namespace(ns)
        cp.ensure_namespace(sysns)
        for g in GROUPS:
            for i in range(FLEET[g.name]):
                existing_node(cp, f"{g.name}-fleet-{i}", g)
        templates = write_configmaps(cp.core, sysns, GROUPS)
        kc = cp.write_kubeconfig(tmp / "kubeconfig")
        flags = ["--log-level", "info"]
        if variant == "gpupack":
            flags += ["--autoscale-templates", templates, "--autoscale-namespace", sysns,
                      "--autoscale-group-label", GROUP_LABEL, "--autoscale-interval-s", "2"]  # fmt: skip
        ext = ExtenderProcess(kc, tmp / "extender.log", *flags)
        ext.wait_ready()
        sched = cp.start_scheduler(realk8s.gpupack_scheduler_config(ext.url))
        plugin = DevicePluginEmulator(cp, static_inventory=False)
        with realk8s.KubeletEmulator(cp, ns, on_admit=plugin), NewNodeKubelet(cp, GROUPS) as nk:
            ca = Autoscaler(cp, sysns, tmp / "ca.log", kc)
            t0 = time.monotonic()
            for p in pods:
                cp.core.create_namespaced_pod(ns, p)
            most_placeholders, bound_n, t_all = 0, 0, None
            while time.monotonic() - t0 < cap_s:
                listed = list_pods(cp.core, ns)
                bound_n = sum(1 for p in listed if p["spec"].get("nodeName"))
                holders = [
                    p
                    for p in list_pods(cp.core, sysns)
                    if LABEL_PLACEHOLDER in (p["metadata"].get("labels") or {})
                ]
                most_placeholders = max(most_placeholders, len(holders))
                if bound_n == len(pods):
                    t_all = time.monotonic() - t0
                    break
                time.sleep(1.0)
            added: dict[str, int] = {}
            for n in kwok_nodes(cp.core):
                if "-fleet-" not in n["metadata"]["name"]:
                    g = n["metadata"]["labels"][GROUP_LABEL]
                    added[g] = added.get(g, 0) + 1
            return {"variant": variant, "pods": len(pods), "bound": bound_n,
                    "all_bound_s": None if t_all is None else round(t_all, 1), "cap_s": cap_s,
                    "nodes_added": dict(sorted(added.items())), "nodes_added_total": sum(added.values()),
                    "most_placeholders": most_placeholders, "ca_scale_ups": len(ca.scale_ups()),
                    "first_node_ready_s": round(min(nk.ready_at.values()) - t0, 1) if nk.ready_at else None}  # fmt: skip
    finally:
        if ca is not None:
            ca.stop()
        if sched is not None:
            sched.stop()
        if ext is not None:
            ext.stop()
        cp.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cap-s", type=float, default=300.0, help="give up waiting for all pods after this")
    ap.add_argument("--baseline-cap-s", type=float, default=90.0, help="the same for the autoscaler alone")
    ap.add_argument("--assets", type=Path, default=None, help="Kubernetes binaries (default: ../shared/k8s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pods = burst(args.pods, args.seed)
    plan, bound = offline(pods)
    out = {"fleet": FLEET, "offline_plan": plan, "offline_total": sum(plan.values()), "lower_bound": bound,
           "runs": [run_variant("gpupack", pods, args.cap_s, args.assets),
                    run_variant("baseline", pods, args.baseline_cap_s, args.assets)]}  # fmt: skip
    g, b = out["runs"]
    out["bound_ratio"] = round(g["bound"] / max(1, b["bound"]), 2)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"offline plan {plan} ({out['offline_total']} nodes), lower bound {bound}")
        for r in out["runs"]:
            print(f"{r['variant']:8} bound {r['bound']}/{r['pods']} all in {r['all_bound_s']} s (cap {r['cap_s']:g}), "
                  f"nodes added {r['nodes_added']} = {r['nodes_added_total']}, placeholders at most "
                  f"{r['most_placeholders']}, CA scale-ups {r['ca_scale_ups']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
