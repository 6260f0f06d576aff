"""The real cluster-autoscaler (1.29.5, kwok provider, ../shared/k8s) beside the real control plane,
kube-scheduler with gpupack's profile and the real `gpupack extender`, for the autoscale tests and
benchmarks/bench_autoscale.py.

No kubelet runs for the nodes the autoscaler adds, so `NewNodeKubelet` plays its part and the
device plugin's: it makes each new node Ready, removes the not-ready taint admission put there and
publishes the GPU inventory its group's template describes (as the DaemonSet's plugin would once
the node boots). Pods bound anywhere are admitted by realk8s.KubeletEmulator with the
DevicePluginEmulator finishing each handoff (tests/extender/conftest.py's `kubelet`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import realk8s
import yaml
from kubernetes import client

from gpupack.contract import (
    ANN_INVENTORY,
    LABEL_GPU_COUNT,
    LABEL_GPU_MEM_MIB,
    LABEL_GPU_MODEL,
    LABEL_GPU_NODE,
    RES_GPU,
    SLOTS_PER_GPU,
    GPUInfo,
    NodeInventory,
)

GROUP_LABEL = "gpupack.io/node-group"
KWOK_FAKE = "kwok.x-k8s.io/node"
# the README's test flags: seconds instead of the defaults' minutes
CA_FLAGS = (
    "--cloud-provider=kwok", "--leader-elect=false", "--scan-interval=2s", "--scale-down-delay-after-add=5s",
    "--scale-down-unneeded-time=8s", "--scale-down-delay-after-delete=0s", "--scale-down-delay-after-failure=5s",
    "--unremovable-node-recheck-timeout=5s", "--node-delete-delay-after-taint=1s", "--max-node-provision-time=2m",
    "--logtostderr=true", "--v=4",
)  # fmt: skip
KWOK_CONFIG = f"""\
apiVersion: v1alpha1
readNodesFrom: configmap
nodegroups:
  fromNodeLabelKey: "{GROUP_LABEL}"
nodes:
  skipTaint: true
configmap:
  name: kwok-provider-templates
"""


@dataclass(frozen=True)
class Group:
    name: str
    model: str
    gpus: int
    mem_mib: int
    max_count: int = 10

    def labels(self) -> dict[str, str]:
        return {GROUP_LABEL: self.name, LABEL_GPU_MODEL: self.model, LABEL_GPU_COUNT: str(self.gpus),
                LABEL_GPU_MEM_MIB: str(self.mem_mib)}  # fmt: skip

    def template(self) -> dict[str, Any]:
        alloc = {"cpu": "64", "memory": "512Gi", "pods": "250", RES_GPU: str(self.gpus * SLOTS_PER_GPU)}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"{self.name}-template",
                "annotations": {
                    "cluster-autoscaler.kwok.nodegroup/name": self.name,
                    "cluster-autoscaler.kwok.nodegroup/min-count": "0",
                    "cluster-autoscaler.kwok.nodegroup/max-count": str(self.max_count),
                },
                "labels": {**self.labels(), "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
            },
            "status": {"capacity": alloc, "allocatable": alloc,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
        }  # fmt: skip

    def inventory(self, node: str) -> NodeInventory:
        return NodeInventory(
            tuple(GPUInfo(f"GPU-{node}-{i}", i, self.model, self.mem_mib, 132) for i in range(self.gpus))
        )


def existing_node(cp: realk8s.ControlPlane, name: str, g: Group) -> None:
    """A node of group `g` that was there before (its kubelet and plugin already running)."""
    labels = {**g.labels(), LABEL_GPU_NODE: "true"}
    # marked as the kwok provider marks its nodes, so that it may remove this one too
    cp.make_node(name, pods="250", extended={RES_GPU: str(g.gpus * SLOTS_PER_GPU)}, labels=labels,
                 annotations={ANN_INVENTORY: g.inventory(name).to_json(), KWOK_FAKE: "fake"})  # fmt: skip
    cp.core.patch_node(name, {"spec": {"providerID": f"kwok:{name}"}})  # the provider's own prefix


def write_configmaps(core: client.CoreV1Api, namespace: str, groups: list[Group]) -> str:
    """The kwok provider's two ConfigMaps (its templates are also gpupack's); their NAMESPACE/NAME."""
    templates = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [g.template() for g in groups]})
    for name, data in (("kwok-provider-config", {"config": KWOK_CONFIG}),
                       ("kwok-provider-templates", {"templates": templates})):  # fmt: skip
        body = {"metadata": {"name": name, "namespace": namespace}, "data": data}
        try:
            core.create_namespaced_config_map(namespace, body)
        except client.ApiException as e:
            if e.status != 409:
                raise
            core.replace_namespaced_config_map(name, namespace, body)
    return f"{namespace}/kwok-provider-templates"


def autoscaler_binary(assets: Path) -> Path:
    """The cluster-autoscaler binary for a control plane of `assets`. Only ../shared/k8s ships one
    (1.29.5): a run against another version's binaries (.ci/run's v1.36 suite) takes it from
    $GPUPACK_CA_ASSETS, else from the default binaries folder, and runs it against that version's
    API server, as a cluster upgraded before its autoscaler would."""
    if "cluster-autoscaler" in (assets / "SHA256SUMS").read_text():
        return realk8s.binary("cluster-autoscaler", assets)
    named = os.environ.get("GPUPACK_CA_ASSETS")
    for folder in [Path(named)] if named else realk8s.default_assets_dirs():
        if (folder / "SHA256SUMS").is_file() and "cluster-autoscaler" in (folder / "SHA256SUMS").read_text():
            return realk8s.binary("cluster-autoscaler", folder)
    raise FileNotFoundError(
        f"no cluster-autoscaler in {assets} nor in {named or 'the default binaries folder'} (set GPUPACK_CA_ASSETS)"
    )


class Autoscaler:
    """The cluster-autoscaler process; `log` is its -v=4 output."""

    def __init__(self, cp: realk8s.ControlPlane, namespace: str, log: Path, kubeconfig: Path) -> None:
        self.log = log
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), KWOK_PROVIDER_MODE="local", POD_NAMESPACE=namespace,
                   KWOK_PROVIDER_CONFIGMAP="kwok-provider-config")  # fmt: skip
        args = [str(autoscaler_binary(cp.assets)), f"--kubeconfig={kubeconfig}",
                "--namespace=kube-system", f"--address=127.0.0.1:{realk8s.free_port()}", *CA_FLAGS]  # fmt: skip
        self.proc = subprocess.Popen(args, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        realk8s.until(lambda: self.proc.poll() is not None or "Starting main loop" in self.text(), 90,
                      what="cluster-autoscaler main loop")  # fmt: skip
        if self.proc.poll() is not None:
            raise RuntimeError(f"cluster-autoscaler exited {self.proc.returncode}: {self.text()[-3000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def scale_ups(self) -> list[str]:
        return re.findall(r"Scale-up: setting group (\S+) size to (\d+)", self.text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class NewNodeKubelet:
    """The kubelet and device plugin of each node the autoscaler adds (see the module docstring),
    after `boot_s` seconds; `ready_at` says when each node was made usable."""

    def __init__(self, cp: realk8s.ControlPlane, groups: list[Group], boot_s: float = 0.5) -> None:
        self.core = client.CoreV1Api(cp.new_api_client())
        self.groups = {g.name: g for g in groups}
        self.boot_s = boot_s
        self.ready_at: dict[str, float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="new-node-kubelet")

    def __enter__(self) -> NewNodeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        first_seen: dict[str, float] = {}
        while not self._stop.wait(0.2):
            try:
                for n in json.loads(self.core.list_node(_preload_content=False).data)["items"]:
                    meta = n["metadata"]
                    name = meta["name"]
                    ann = meta.get("annotations") or {}
                    if ann.get(KWOK_FAKE) != "fake" or ANN_INVENTORY in ann or name in self.ready_at:
                        continue
                    first_seen.setdefault(name, time.monotonic())
                    if time.monotonic() - first_seen[name] >= self.boot_s:
                        self._boot(n)
            except Exception as e:  # a conflict or a node deleted meanwhile: next round
                self.errors.append(repr(e))

    def _boot(self, n: dict[str, Any]) -> None:
        meta = n["metadata"]
        name = meta["name"]
        g = self.groups[meta["labels"][GROUP_LABEL]]
        taints = [t for t in n["spec"].get("taints") or [] if t["key"] != "node.kubernetes.io/not-ready"]
        self.core.patch_node(name, {"spec": {"taints": taints or None},
                                    "metadata": {"labels": {LABEL_GPU_NODE: "true"},
                                                 "annotations": {ANN_INVENTORY: g.inventory(name).to_json()}}})  # fmt: skip
        alloc = {"cpu": "64", "memory": "512Gi", "pods": "250", RES_GPU: str(g.gpus * SLOTS_PER_GPU)}
        realk8s.set_node_status(self.core, name, alloc)
        self.ready_at[name] = time.monotonic()


def kwok_nodes(core: client.CoreV1Api) -> list[dict[str, Any]]:
    return [n for n in json.loads(core.list_node(_preload_content=False).data)["items"]
            if (n["metadata"].get("annotations") or {}).get(KWOK_FAKE) == "fake"]  # fmt: skip


def share_pod(name: str, mem: int, sm: int | None = None, models: str | None = None,
              owner: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    limits = {RES_GPU: "1", "gpupack.io/gpu-mem": str(mem)}
    if sm is not None:
        limits["gpupack.io/gpu-sm"] = str(sm)
    meta: dict[str, Any] = {"name": name, "labels": {"gpupack.io/class": "online"}}
    if models:
        meta["annotations"] = {"gpupack.io/gpu-models": models}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"schedulerName": "gpupack-scheduler", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "registry.invalid/x:1",
                                     "resources": {"limits": limits, "requests": dict(limits)}}]}}  # fmt: skip


def whole_pod(name: str, gpus: int, cpu: str | None = None, selector: dict[str, str] | None = None,
              tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """A pod holding `gpus` whole GPUs, with host requests, a nodeSelector and tolerations."""
    res: dict[str, Any] = {"limits": {RES_GPU: str(gpus)}, "requests": {RES_GPU: str(gpus)}}
    if cpu is not None:
        res["requests"]["cpu"] = cpu
    spec: dict[str, Any] = {"schedulerName": "gpupack-scheduler", "terminationGracePeriodSeconds": 0,
                            "containers": [{"name": "c", "image": "registry.invalid/x:1", "resources": res}]}  # fmt: skip
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"gpupack.io/class": "online"}},
            "spec": spec}  # fmt: skip


def mark_unschedulable(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """What kube-scheduler writes on a pod it found no node for (for tests that run no scheduler)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "test",
            "lastTransitionTime": now}  # fmt: skip
    core.patch_namespaced_pod_status(name, namespace, {"status": {"conditions": [cond]}})


def events(core: client.CoreV1Api, namespace: str, reason: str) -> list[dict[str, Any]]:
    sel = f"reason={reason}"
    return json.loads(core.list_namespaced_event(namespace, field_selector=sel, _preload_content=False).data)[
        "items"
    ]
