"""The openb replay of benchmarks/replay_realk8s.py through DRA with the in-tree allocator alone
(`replay_realk8s.py --mode dra`): no gpupack extender, no extended resources.

Nodes: the same slice of the trace, each a fake Ready node with its CPU and memory and one
ResourceSlice (benchmarks/dra_objects.py: `gpupack dra-plugin`'s shape, one device per GPU with
the model's memory and 100 % of SMs as consumable capacity). Pods: the same sampled pods in the
same arrival order, one at a time; each GPU pod gets its own ResourceClaim, created just before it
(a direct claim: one object per pod whatever its shape, with no ResourceClaim controller round
trip before kube-scheduler sees it): a share of `milli` asks `sm: milli/10` and `memory: 1Mi`
(the trace's shares carry no GPU memory, as in the device-plugin replay, which asks no
`gpu-mem`; 1Mi is the slice's minimum: a claim naming no memory would take the device's default,
its whole memory), N whole GPUs ask `count: N` and no capacity (each device's defaults: the whole
memory, so nothing else fits beside it). Allowed models become a CEL selector on the device's
`model` attribute. kube-scheduler v1.36 (its own plugins only, `percentageOfNodesToScore: 100` as
gpupack's profile sets it) picks the node by its default scores and its DynamicResources plugin
allocates the devices; kube-controller-manager runs as well (its ResourceClaim controller is then
idle: no templates). A pod with a claim is done when bound: the allocation is written in the claim's
status before the Binding; no kubelet is modelled.

Allocated GPU milli, as the simulator counts it, from the claims' `consumedCapacity`: a share its
SMs x 10, a whole device 1000. After the run every device's consumption summed over all claims is
checked against its slice (dra_objects.check_capacity): an overfill fails the run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests", ROOT / "tests" / "extender", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import dra_objects as dra  # noqa: E402
import realk8s  # noqa: E402
from ext_helpers import container, pod_obj  # noqa: E402
from kubernetes import client  # noqa: E402

from gpupack.contract import LABEL_GPU_COUNT, LABEL_GPU_MODEL, LABEL_GPU_NODE, GPUInfo  # noqa: E402
from gpupack.core.model import FULL  # noqa: E402
from gpupack.simulate.openb import DEFAULT_GPU_MEM_MIB, GPU_MEM_MIB, NodeList, PodList  # noqa: E402
from gpupack.simulate.replay import Curve, ReplayResult  # noqa: E402

NAMESPACE = "replay-dra"
SCHEDULER = "dra-scheduler"
SHARE_MEM_MIB = 1  # see the module doc: the trace's shares have no GPU memory


def scheduler_config() -> dict[str, Any]:
    """kube-scheduler's own plugins (DynamicResources allocating), every node scored as in gpupack's
    profile, no extender."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "percentageOfNodesToScore": 100,
        "profiles": [{"schedulerName": SCHEDULER}],
    }


def dra_unsupported(cp: realk8s.ControlPlane) -> str:
    """Why this API server cannot run the DRA replay ("" when it can): it must serve ResourceSlices
    in resource.k8s.io/v1 and keep a device's allowMultipleAllocations (consumable capacity; a
    server with the feature off drops the field), asked of the server itself."""
    groups = client.ApisApi(cp.api_client()).get_api_versions().groups
    versions = {v.version for g in groups if g.name == "resource.k8s.io" for v in g.versions}
    if "v1" not in versions:
        return f"the API server serves no resource.k8s.io/v1 (DRA; it serves {sorted(versions) or 'none'})"
    res = client.ResourceV1Api(cp.api_client()).get_api_resources().resources
    if not any(r.name == "resourceslices" for r in res):
        return "the API server serves no resource.k8s.io/v1 ResourceSlices"
    api = client.ResourceV1Api(cp.api_client())
    probe = dra.node_slice("dra-probe-node", [GPUInfo(uuid="GPU-probe", index=0, model="probe", mem_mib=1024,
                                                      sm_count=1)])  # fmt: skip
    probe["metadata"]["name"] = "gpupack-dra-probe"
    kept = api.create_resource_slice(probe, dry_run="All", _preload_content=False)
    dev = json.loads(kept.data)["spec"]["devices"][0]
    if not dev.get("allowMultipleAllocations"):
        return (
            "the API server drops allowMultipleAllocations (consumable capacity off: DRAConsumableCapacity)"
        )
    return ""


def make_nodes(cp: realk8s.ControlPlane, nodes: NodeList) -> list[dict[str, Any]]:
    """The nodes (CPU and memory only) and their ResourceSlices, owned by the nodes; the slices."""
    api = client.ResourceV1Api(cp.api_client())
    slices = []
    for i, name in enumerate(nodes.names):
        n, model = int(nodes.gpus[i]), nodes.model[i]
        cp.make_node(name, cpu=f"{int(nodes.cpu[i])}m", memory=f"{int(nodes.ram[i])}Mi",
                     labels={LABEL_GPU_NODE: "true", LABEL_GPU_MODEL: model, LABEL_GPU_COUNT: str(n)})  # fmt: skip
        if not n:
            continue
        mem = GPU_MEM_MIB.get(model, DEFAULT_GPU_MEM_MIB)
        gpus = [
            GPUInfo(uuid=f"GPU-{name}-{j}", index=j, model=model, mem_mib=mem, sm_count=80) for j in range(n)
        ]
        body = dra.node_slice(name, gpus, node_uid=cp.core.read_node(name).metadata.uid)
        api.create_resource_slice(body)
        slices.append(body)
    return slices


def ensure_device_class(cp: realk8s.ControlPlane) -> None:
    try:
        client.ResourceV1Api(cp.api_client()).create_device_class(dra.device_class())
    except client.ApiException as e:
        if e.status != 409:  # already there (another run on this control plane)
            raise


def claim_spec(pods: PodList, i: int) -> dict[str, Any] | None:
    """Pod i's claim spec (None for a CPU-only pod)."""
    num, milli = int(pods.num_gpu[i]), int(pods.gpu_milli[i])
    if num == 0:
        return None
    models = pods.spec[i]
    if milli >= FULL:
        return dra.claim_spec(num, models=models)
    assert milli % 10 == 0, f"pod {pods.names[i]}: gpu_milli {milli} is not a whole SM percent"
    return dra.claim_spec(1, SHARE_MEM_MIB, milli // 10, models)


def pod_body(pods: PodList, i: int, name: str, namespace: str, claim: str | None) -> dict[str, Any]:
    c = container("main")
    c["resources"]["requests"].update({"cpu": f"{int(pods.cpu[i])}m", "memory": f"{int(pods.ram[i])}Mi"})
    body = pod_obj(name, [c], cls=None, namespace=namespace)
    body["spec"]["schedulerName"] = SCHEDULER
    body["spec"]["terminationGracePeriodSeconds"] = 0
    if claim is not None:
        body["spec"]["resourceClaims"] = [dra.pod_claim(claim)]
        c["resources"]["claims"] = [{"name": dra.REQUEST}]
    return body


def _unschedulable(pod: Any) -> bool:
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in (pod.status.conditions or [])
    )


def submit_one(
    core: client.CoreV1Api, res: client.ResourceV1Api, namespace: str, pod: dict[str, Any],
    spec: dict[str, Any] | None, timeout: float,
) -> tuple[str, dict[str, Any] | None] | None:  # fmt: skip
    """Create the claim (if any) and the pod; wait until the pod is bound: (node, its claim as the API
    has it), or None when kube-scheduler reports it unschedulable (pod and claim are then deleted)."""
    name = pod["metadata"]["name"]
    if spec is not None:
        res.create_namespaced_resource_claim(namespace, dra.claim(name, namespace, spec))
    core.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + timeout
    delay = 0.005
    while time.monotonic() < deadline:
        p = core.read_namespaced_pod(name, namespace)
        if p.spec.node_name:
            if spec is None:
                return p.spec.node_name, None
            raw = res.read_namespaced_resource_claim(name, namespace, _preload_content=False)
            return p.spec.node_name, json.loads(raw.data)
        if _unschedulable(p):
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            if spec is not None:
                res.delete_namespaced_resource_claim(name, namespace)
            return None
        time.sleep(delay)
        delay = min(0.05, delay * 1.5)
    raise TimeoutError(f"pod {name}: neither bound nor unschedulable after {timeout:g}s")


def list_json(call: Any, *args: Any) -> list[dict[str, Any]]:
    return list(json.loads(call(*args, _preload_content=False).data)["items"])


def replay_on_cluster(
    cp: realk8s.ControlPlane,
    sl: NodeList,
    sub: PodList,
    order: np.ndarray,
    gap_ms: float = 0.0,
    pod_timeout: float = 60.0,
    progress: bool = False,
    namespace: str = NAMESPACE,
) -> tuple[ReplayResult, dict[str, Any]]:
    """Nodes, slices, DeviceClass and kube-scheduler on a running v1.36+ control plane, then the
    replay. The caller owns `cp` (its nodes, slices (owned by the nodes) and namespace stay)."""
    index = {n: i for i, n in enumerate(sl.names)}
    sched = None
    info: dict[str, Any] = {}
    try:
        cp.ensure_namespace(namespace)
        t0 = time.monotonic()
        ensure_device_class(cp)
        slices = make_nodes(cp, sl)
        sched = cp.start_scheduler(scheduler_config(), name=SCHEDULER)
        info["setup_s"] = round(time.monotonic() - t0, 1)
        api = cp.new_api_client()
        core, res = client.CoreV1Api(api), client.ResourceV1Api(api)
        curve = Curve(sl.gpu_capacity)
        arrived = allocated = placed = failed = 0
        decisions: list[tuple[int, tuple[int, ...]]] = []
        t1 = time.monotonic()
        for step, p in enumerate(order):
            p = int(p)
            req = int(sub.num_gpu[p] * sub.gpu_milli[p])
            arrived += req
            spec = claim_spec(sub, p)
            name = f"p{step:05d}"
            out = submit_one(core, res, namespace, pod_body(sub, p, name, namespace, name if spec else None),
                             spec, pod_timeout)  # fmt: skip
            if out is None:
                decisions.append((-1, ()))
                failed += req
            else:
                node, claim_obj = out
                gpus: tuple[int, ...] = ()
                if claim_obj is not None:
                    rs = dra.results(claim_obj)
                    assert rs, f"pod {name} bound to {node} with its claim unallocated"
                    gpus = tuple(sorted(dra.device_index(r["device"]) for r in rs))
                    allocated += dra.allocated_milli(claim_obj)
                decisions.append((index[node], gpus))
                placed += 1
            curve.add(arrived, allocated)
            if gap_ms:
                time.sleep(gap_ms / 1000)
            if progress and step % 100 == 0:
                print(f"  dra: {step}/{len(order)} pods, {time.monotonic() - t1:.0f}s", file=sys.stderr)
        info["replay_s"] = round(time.monotonic() - t1, 1)
        claims = list_json(res.list_namespaced_resource_claim, namespace)
        # the invariant of consumable capacity, summed over every claim: raises on an overfill
        info["devices_in_use"] = dra.check_capacity(slices, claims)
        info["claims_allocated"] = sum(1 for c in claims if dra.results(c))
        info["shared_devices"] = _shared_devices(claims)
        return ReplayResult("dra-in-tree", 0, curve.values(), len(order), placed, failed, decisions), info
    finally:
        if sched is not None:
            sched.stop()


def _shared_devices(claims: list[dict[str, Any]]) -> int:
    """Devices holding more than one claim."""
    count: dict[tuple[str, str], int] = {}
    for c in claims:
        for r in dra.results(c):
            key = (r.get("pool", ""), r.get("device", ""))
            count[key] = count.get(key, 0) + 1
    return sum(1 for v in count.values() if v > 1)


def run(
    sl: NodeList, sub: PodList, order: np.ndarray, workdir: Path, gap_ms: float, pod_timeout: float,
    progress: bool,
) -> tuple[ReplayResult, dict[str, Any]]:  # fmt: skip
    """A control plane of its own (with kube-controller-manager), the replay, then stopped."""
    cp = realk8s.ControlPlane(workdir / "k8s-dra").start()
    try:
        why = dra_unsupported(cp)
        if why:
            raise SystemExit(f"DRA replay impossible with {cp.assets}: {why}")
        return replay_on_cluster(cp, sl, sub, order, gap_ms, pod_timeout, progress)
    finally:
        cp.stop()
