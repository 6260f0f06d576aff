"""Time from a GPU node joining to a parked GPU pod bound there, with and without the extender's
Requeuer, under the real kube-scheduler of whichever Kubernetes version $GPUPACK_K8S_ASSETS (or
--assets) holds (issue 30: is the Requeuer still needed where kube-scheduler has queueing hints?).

The scenario of tests/extender/test_extender_requeue.py: one small GPU node (1 x A100 40 GB); a pod
asking 60000 MiB on one GPU is parked by kube-scheduler as Unschedulable (the extender's reason in
its FailedScheduling event); a second later a node of 2 x H100 joins (created Ready, untainted, its
inventory published, as a cluster-autoscaler scale-up and gpupack's device plugin would leave it);
the time is from that node's last write to the pod's spec.nodeName (event `node-joins`). Event
`pod-leaves`: a pod holds the only GPU, the parked pod waits past its back-off (11 s), the first pod
is deleted; the time is from the delete to the parked pod bound. Bound pods are admitted by a
KubeletEmulator with gpupack's device plugin ending the handoff. Per variant a fresh extender and
kube-scheduler (the shipped profile) on one control plane:

- requeuer: `gpupack extender` as shipped;
- none: the same with the Requeuer never started (Requeuer.start replaced by a no-op in the
  extender's process through a sitecustomize on its PYTHONPATH; nothing in the product changes).

A pod not bound within --cap-s counts as not bound (kube-scheduler's own flush of unschedulable
pods comes after 5 minutes). Prints one line per trial and a summary; --json prints the summary
as JSON.

    GPUPACK_K8S_ASSETS=../shared/k8s-1.36 python benchmarks/bench_requeue.py --trials 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from ext_helpers import DevicePluginEmulator, container, create_pod, get_pod, gpu_node, pod_obj  # noqa: E402
from processes import ExtenderProcess  # noqa: E402

BIG_MIB = 60000  # more than the small node's 40 GiB GPU, less than an H100
A100_40_MIB = 40960
NO_REQUEUER = "import extender.controllers.requeue as _r\n_r.Requeuer.start = lambda self: self\n"


def parked(core: Any, ns: str, name: str, timeout: float = 60.0) -> None:
    def unschedulable() -> bool:
        pod = get_pod(core, ns, name)
        return any(c["type"] == "PodScheduled" and c["status"] == "False" and c["reason"] == "Unschedulable"
                   for c in pod["status"].get("conditions") or [])  # fmt: skip

    realk8s.until(unschedulable, timeout, f"{name} parked as Unschedulable")


def trial(cp: realk8s.ControlPlane, i: int, variant: str, event: str, cap_s: float) -> float | None:
    """Seconds from the event (the new node's last write, the first pod's deletion) to the parked
    pod bound; None past `cap_s`."""
    core = cp.core
    ns, small, new = f"rq-{variant}-{event}-{i}", f"small-{variant}-{i}", f"new-{variant}-{i}"
    cp.ensure_namespace(ns)
    plugin = DevicePluginEmulator(cp)
    with realk8s.KubeletEmulator(cp, ns, on_admit=plugin):
        if event == "node-joins":
            gpu_node(cp, small, 1, mem=A100_40_MIB, model="NVIDIA-A100-SXM4-40GB")
            create_pod(core, pod_obj("big", [container("c", 1, BIG_MIB, 50)]), ns)
            parked(core, ns, "big")
            time.sleep(
                1
            )  # past the scheduler's handling of that failure: the pod sits among its unschedulable
            gpu_node(cp, new, 2)
        else:  # a pod holding the only GPU leaves, after the parked pod's back-off (10 s at most)
            small = new = f"one-{variant}-{i}"
            gpu_node(cp, new, 1)
            create_pod(core, pod_obj("first", [container("c", 1, BIG_MIB, 50)]), ns)
            realk8s.until(lambda: get_pod(core, ns, "first")["spec"].get("nodeName"), 30, "first pod bound")
            create_pod(core, pod_obj("big", [container("c", 1, BIG_MIB, 50)]), ns)
            parked(core, ns, "big")
            time.sleep(11)
            core.delete_namespaced_pod("first", ns)  # the KubeletEmulator confirms it
        t0 = time.monotonic()
        took: float | None = None
        while time.monotonic() - t0 < cap_s:
            if get_pod(core, ns, "big")["spec"].get("nodeName") == new:
                took = time.monotonic() - t0
                break
            time.sleep(0.05)
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    for n in {small, new}:
        core.delete_node(n)
    core.delete_namespace(ns)
    return took


def run_variant(
    cp: realk8s.ControlPlane, tmp: Path, variant: str, events: list[str], trials: int, cap_s: float
) -> dict[str, Any]:
    env_saved = os.environ.get("PYTHONPATH")
    if variant == "none":
        hook = tmp / "no-requeuer"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(NO_REQUEUER)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT)])
    try:
        ext = ExtenderProcess(cp.write_kubeconfig(tmp / f"kc-{variant}"), tmp / f"extender-{variant}.log")
    finally:
        if env_saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_saved
    sched = None
    try:
        ext.wait_ready(60)
        sched = cp.start_scheduler(
            realk8s.gpupack_scheduler_config(ext.url), name=f"kube-scheduler-{variant}"
        )
        out: dict[str, Any] = {}
        for event in events:
            times: list[float | None] = []
            for i in range(trials):
                t = trial(cp, i, variant, event, cap_s)
                times.append(t)
                print(f"{variant} {event} trial {i}: " + (f"bound {t:.2f} s after the event" if t is not None
                                                          else f"not bound within {cap_s:g} s"), file=sys.stderr)  # fmt: skip
            bound = sorted(t for t in times if t is not None)
            out[event] = {
                "trials": trials,
                "bound": len(bound),
                "seconds": [None if t is None else round(t, 3) for t in times],
                "median_s": round(statistics.median(bound), 3) if bound else None,
                "max_s": round(bound[-1], 3) if bound else None,
            }
        out["requeued_pods"] = ext.metric('gpupack_extender_requeued_pods_total{why="room"}')
    finally:
        if sched is not None:
            sched.stop()
        ext.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--assets", type=Path, help="Kubernetes binaries folder (default: $GPUPACK_K8S_ASSETS, ../shared/k8s)"
    )
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--cap-s", type=float, default=30.0, help="give up on a pod after this long")
    ap.add_argument("--variant", action="append", choices=("requeuer", "none"), help="default: both")
    ap.add_argument("--event", action="append", choices=("node-joins", "pod-leaves"), help="default: both")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.assets is not None:
        os.environ["GPUPACK_K8S_ASSETS"] = str(a.assets)
    assets = realk8s.assets_dir()
    if assets is None:
        print(realk8s.HOW_TO_GET, file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="gpupack-requeue-"))
    cp = realk8s.ControlPlane(tmp, assets)
    out: dict[str, Any] = {"cap_s": a.cap_s}
    try:
        cp.start(controller_manager=False)
        out["kubernetes"] = "v{}.{}".format(*cp.server_version())
        for variant in a.variant or ("requeuer", "none"):
            out[variant] = run_variant(
                cp, tmp, variant, a.event or ["node-joins", "pod-leaves"], a.trials, a.cap_s
            )
    finally:
        cp.stop()
    if a.json:
        print(json.dumps(out))
    else:
        for variant in a.variant or ("requeuer", "none"):
            for event in a.event or ("node-joins", "pod-leaves"):
                r = out[variant][event]
                print(f"{out['kubernetes']} {variant:9s} {event:10s} bound {r['bound']}/{r['trials']} within "
                      f"{a.cap_s:g} s; median {r['median_s']} s, max {r['max_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
