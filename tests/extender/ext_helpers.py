"""Builders for extender tests: node inventories, Node and Pod objects, recorded payloads, and the\ndevice plugin's side of the bind -> Allocate handoff for the real cluster's KubeletEmulator."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import realk8s
from kubernetes import client
from processes import ExtenderProcess

from gpupack import handoff
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    ANN_RESERVATIONS,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    LABEL_CLASS,
    LABEL_GPU_COUNT,
    LABEL_GPU_MODEL,
    LABEL_GPU_NODE,
    RES_GPU,
    SLOTS_PER_GPU,
    Assignment,
    ContractError,
    GPUInfo,
    GPUShare,
    NodeInventory,
    Reservation,
    decode_inventory,
    encode_reservations,
)

H100_MIB = 81559


def shared_dir() -> Path | None:
    env = os.environ.get("GPUPACK_SHARED")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared"
    return d if d.is_dir() else None


def payload_dir(mode: str) -> Path:
    d = shared_dir()
    if d is None or not (d / "payloads" / mode).is_dir():
        pytest.skip("recorded scheduler payloads not found (set GPUPACK_SHARED to the shared/ directory)")
    return d / "payloads" / mode


def assigned(
    pod: dict[str, Any],
    node: str,
    shares: dict[str, tuple[GPUShare, ...]],
    handoff: str = "done",
    uid: str | None = None,
    reservation: str = "",
) -> dict[str, Any]:
    """`pod` bound to `node` and Running, with an assignment of `shares` (container -> shares)."""
    pod = json.loads(json.dumps(pod))
    uid = uid or f"uid-{pod['metadata']['name']}"
    pod["metadata"]["uid"] = uid
    a = Assignment(
        uid, node, pod["metadata"]["labels"].get("gpupack.io/class", "online"), shares, "", reservation
    )
    pod["metadata"].setdefault("annotations", {})[ANN_ASSIGNMENT] = a.to_json()
    pod["metadata"]["annotations"][ANN_HANDOFF] = handoff
    pod["spec"]["nodeName"] = node
    pod["status"]["phase"] = "Running"
    return pod


def payloads(mode: str) -> list[tuple[str, dict[str, Any]]]:
    d = payload_dir(mode)
    out = []
    for f in sorted(d.glob("*.json")):
        if f.name.endswith(".response.json"):
            continue
        out.append((f.stem.split("-", 1)[1], json.loads(f.read_text())))
    return out


def inventory(
    node: str, n: int = 8, mem: int = H100_MIB, model: str = "NVIDIA-H100-80GB-HBM3"
) -> NodeInventory:
    return NodeInventory(
        gpus=tuple(
            GPUInfo(uuid=f"GPU-{node}-{i}", index=i, model=model, mem_mib=mem, sm_count=132) for i in range(n)
        )
    )


def node_obj(
    name: str,
    n: int = 8,
    mem: int = H100_MIB,
    model: str = "NVIDIA-H100-80GB-HBM3",
    reservations: list[Reservation] | None = None,
    raw_inventory: str | None = None,
) -> dict[str, Any]:
    ann = {
        ANN_INVENTORY: raw_inventory
        if raw_inventory is not None
        else inventory(name, n, mem, model).to_json()
    }
    if reservations is not None:
        ann[ANN_RESERVATIONS] = encode_reservations(reservations)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}, "annotations": ann},
        "spec": {},
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", RES_GPU: str(SLOTS_PER_GPU * n)},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", RES_GPU: str(SLOTS_PER_GPU * n)},
        },
    }


def container(name: str, gpu: int | None = None, mem: int | str | None = None, sm: int | None = None) -> dict:
    limits: dict[str, str] = {}
    if gpu is not None:
        limits["gpupack.io/gpu"] = str(gpu)
    if mem is not None:
        limits["gpupack.io/gpu-mem"] = str(mem)
    if sm is not None:
        limits["gpupack.io/gpu-sm"] = str(sm)
    return {
        "name": name,
        "image": "registry.invalid/x:1",
        "resources": {"limits": limits, "requests": dict(limits)},
    }


def pod_obj(
    name: str,
    containers: list[dict],
    cls: str | None = "online",
    namespace: str = "default",
    init: list[dict] | None = None,
    uid: str | None = None,
    owner: tuple[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {}}
    if cls is not None:
        meta["labels"][LABEL_CLASS] = cls
    if uid is not None:
        meta["uid"] = uid
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": owner[0],
                "name": owner[1],
                "uid": f"uid-{owner[1]}",
                "controller": True,
            }
        ]
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "gpupack-scheduler"}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": "Pending"}}


def gpu_node(
    cluster: Any,
    name: str,
    n: int = 8,
    mem: int = H100_MIB,
    model: str = "NVIDIA-H100-80GB-HBM3",
    reservations: list[Reservation] | None = None,
    raw_inventory: str | None = None,
    **host: str,
) -> None:
    """A Ready node of the real cluster as gpupack's device plugin publishes it: the inventory
    annotation, the gpupack labels, and SLOTS_PER_GPU `gpupack.io/gpu` slots per GPU allocatable
    (`host`: cpu, memory, pods as realk8s.make_node takes them)."""
    obj = node_obj(name, n, mem, model, reservations, raw_inventory)
    labels = {LABEL_GPU_NODE: "true", LABEL_GPU_MODEL: model, LABEL_GPU_COUNT: str(n)}
    cluster.make_node(name, extended={RES_GPU: str(SLOTS_PER_GPU * n)}, labels=labels,
                      annotations=obj["metadata"]["annotations"], **host)  # fmt: skip


def create_pod(core: client.CoreV1Api, pod: dict[str, Any], namespace: str) -> dict[str, Any]:
    """Create `pod` (a builder's or a recorded one) in `namespace`; the API's JSON back."""
    body = copy.deepcopy(pod)
    meta = body["metadata"]
    for k in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "ownerReferences"):
        meta.pop(k, None)
    meta["namespace"] = namespace
    body.pop("status", None)
    body["spec"].pop("nodeName", None)
    # the recorded pods carry their old ServiceAccount token volume; admission adds a fresh one
    vols = [v for v in body["spec"].get("volumes") or [] if not v["name"].startswith("kube-api-access-")]
    body["spec"]["volumes"] = vols or None
    for c in body["spec"].get("containers", []) + body["spec"].get("initContainers", []):
        mounts = [m for m in c.get("volumeMounts") or [] if not m["name"].startswith("kube-api-access-")]
        c["volumeMounts"] = mounts or None
    return json.loads(core.create_namespaced_pod(namespace, body, _preload_content=False).data)


def get_pod(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)


def list_pods(core: client.CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    return json.loads(core.list_namespaced_pod(namespace, _preload_content=False).data)["items"]


def bind_body(pod: dict, node: str) -> dict:
    """The extender's bind request (kube-scheduler's ExtenderBindingArgs) for `pod` on `node`."""
    m = pod["metadata"]
    return {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node}


def annotations(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("annotations") or {}


class DevicePluginEmulator:
    """What gpupack's device plugin does when the kubelet admits a pod, as a KubeletEmulator
    `on_admit` hook: every GPU container (the kubelet's order) recorded in `gpupack.io/allocated`
    and `gpupack.io/handoff: done`, in one PATCH carrying the pod's resourceVersion, as
    deviceplugin/allocate.py ends a handoff. Before that it checks what Allocate relies on: the
    assignment is for this pod and node, names every GPU container with as many GPUs of this
    node's published inventory as it requests. A pod bound without a pending handoff is left
    alone; a check that fails is recorded in `errors` and marks the handoff failed, as the plugin
    does."""

    def __init__(self, cluster: Any, delay: float = 0.0, static_inventory: bool = False) -> None:
        # as many connections as the kubelets admit pods at once (realk8s.ADMIT_CONCURRENCY)
        self.core = client.CoreV1Api(
            realk8s.with_pool(cluster.new_api_client(), realk8s.ADMIT_CONCURRENCY + 2)
        )
        self.delay = delay
        self.served: list[str] = []
        self.errors: list[str] = []
        # A device plugin knows its node's GPUs without asking the API server; reading the Node
        # each time checks the published inventory as it is now. `static_inventory`: read each
        # node once (a benchmark whose inventories never change: one API call per pod less on the
        # cores the measured control plane shares).
        self._inventories: dict[str, Any] | None = {} if static_inventory else None

    def _inventory(self, node: str) -> Any:
        if self._inventories is not None and node in self._inventories:
            return self._inventories[node]
        inv = decode_inventory(annotations(get_node(self.core, node)).get(ANN_INVENTORY), node)
        if self._inventories is not None:
            self._inventories[node] = inv
        return inv

    def _check(self, pod: dict[str, Any]) -> list[str]:
        p = handoff.pod_view(pod)
        a = p.assignment()
        inv = self._inventory(p.node_name)
        uuids = {g.uuid for g in inv.gpus}
        if a.pod_uid != p.uid or a.node != p.node_name:
            raise ContractError(f"pod {p.key}: assignment is for {a.pod_uid} on {a.node}")
        names = []
        for c in handoff.gpu_containers(p):
            shares = a.containers.get(c.name, ())
            if len(shares) != c.gpu_count() or not {s.uuid for s in shares} <= uuids:
                raise ContractError(f"pod {p.key} container {c.name}: assigned {shares}, node has {uuids}")
            names.append(c.name)
        return names

    def __call__(self, v1pod: Any) -> None:
        ns, name = v1pod.metadata.namespace, v1pod.metadata.name
        time.sleep(self.delay)
        # The kubelet's pod is the one it was bound as: if its handoff is pending, the PATCH is sent
        # with its resourceVersion at once, and read again only if the pod has changed since (409).
        # (A read before every admission was a third of the stand-in's API calls in a burst.)
        pod: dict[str, Any] | None = self.core.api_client.sanitize_for_serialization(v1pod)
        for _ in range(20):
            if pod is None or annotations(pod).get(ANN_HANDOFF) != HANDOFF_PENDING:
                pod = get_pod(self.core, ns, name)
            if annotations(pod).get(ANN_HANDOFF) != HANDOFF_PENDING:
                return
            try:
                patch: dict[str, str] = {
                    ANN_ALLOCATED: json.dumps(self._check(pod), separators=(",", ":")),
                    ANN_HANDOFF: HANDOFF_DONE,
                }
            except ContractError as e:
                self.errors.append(str(e))
                patch = handoff.failed_annotations()
            body = {"metadata": {"annotations": patch, "resourceVersion": pod["metadata"]["resourceVersion"]}}
            try:
                _ = self.core.patch_namespaced_pod(name, ns, body, _preload_content=False).data  # not a V1Pod
            except client.ApiException as e:
                if e.status == 409:  # the pod changed since we read it: read it again
                    pod = None
                    continue
                raise
            if patch.get(ANN_HANDOFF) == HANDOFF_DONE:
                self.served.append(f"{ns}/{name}")
            return


def get_node(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    return json.loads(core.read_node(name, _preload_content=False).data)


def extender_with_scheduler(
    k8s: realk8s.ControlPlane, tmp: Path, scheduler_name: str, *flags: str
) -> Iterator[SimpleNamespace]:
    """The real `gpupack extender` (with `flags`) and the real kube-scheduler running gpupack's
    shipped profile pointed at it, for a module fixture: yields `ext`, `proc` (the scheduler) and
    what a test needs to restart the extender behind the same URL (`kc`, `tmp`, `port`, `flags`).
    A test may replace `ext`; the one there at the end is stopped."""
    kc = k8s.write_kubeconfig(tmp / "kubeconfig")
    ext = ExtenderProcess(kc, tmp / "extender-0.log", *flags)
    st = SimpleNamespace(ext=ext, kc=kc, tmp=tmp, port=ext.port, flags=flags, proc=None)
    try:
        ext.wait_ready()
        st.proc = k8s.start_scheduler(realk8s.gpupack_scheduler_config(ext.url), name=scheduler_name)
        yield st
    finally:
        if st.proc is not None:
            st.proc.stop()
        st.ext.stop()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the extender and its children (the webhook process, when it has one), as a crashed
    container would lose them all."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == proc.pid:
                children.append(int(stat.parent.name))
    proc.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def assume_on(ext: Any, pod: dict[str, Any], node: str, now: Any) -> bool:
    """Place `pod` on `node` in `ext`'s view as its bind would (fit, then assume), without the API
    server; False when it does not fit there."""
    from extender.verbs.binding import assignment_from_fit

    view = ext.view
    req = ext.pod_request(pod)
    with view.lock:
        f, res = ext.placements.node_fit(node, req, now, None)
        if not f:
            return False
        a = assignment_from_fit(
            view.state.nodes[node], req, f, now, res.id if res else "", view.nodes[node].gpu_indexes
        )
        view.assume(req.key, req.uid, a, frozenset())
    return True


def workload_policy(view: Any, pods: list[dict[str, Any]]) -> Any:
    """A gpupack policy given the workload of `pods` (one pod of each shape): it learns nothing,
    so two extenders on `view` score alike."""
    from extender.verbs.framework import Extender
    from gpupack.core.fgd import Workload
    from gpupack.core.fgd import shape_of as fgd_shape
    from gpupack.core.gpupack_policy import GpupackPolicy

    probe = Extender(view, GpupackPolicy(), None)
    workload = Workload()
    for p in pods:
        workload.add(fgd_shape(probe.pod_request(p)))
    return GpupackPolicy(workload=workload)
