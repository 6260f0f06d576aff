"""End to end with the real parts: `kubectl create` -> kube-apiserver -> kube-scheduler (the shipped
profile) -> `gpupack extender` (filter, prioritize, bind) -> the kubelet's real device manager
(`devicemanager-harness`) -> `gpupack device-plugin` (a process, fake NVML) -> the env each
container would receive. Only the kubelet's pod lifecycle around the device manager is emulated
(tests/realk8s.py KubeletEmulator): it hands each bound pod to a device manager run, one pod at a
time per node as the kubelet admits, then marks it Running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import realk8s
import yaml
from kubernetes import client
from processes import ExtenderProcess

from gpupack import handoff
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    SCHEDULER_NAME,
    SLOTS_PER_GPU,
    decode_allocated,
    decode_assignment,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deviceplugin"))
from harness import HarnessDir, harness_pod, plugin_command  # noqa: E402

pytestmark = pytest.mark.timeout(240)
GPUS = 3


@dataclass(frozen=True)
class C:
    """A container's gpupack request; mem 0 = whole GPUs."""

    name: str
    gpus: int = 1
    mem: int = 0
    sm: int = 0

    def manifest(self) -> dict[str, Any]:
        limits = {RES_GPU: str(self.gpus)}
        if self.mem:
            limits[RES_GPU_MEM] = str(self.mem)
            limits[RES_GPU_SM] = str(self.sm)
        return {"name": self.name, "image": "busybox", "resources": {"limits": limits}}


def pod_manifest(name: str, ns: str, containers: list[C], init: list[C] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    spec: dict[str, Any] = {"schedulerName": SCHEDULER_NAME, "containers": [c.manifest() for c in containers]}
    if init:
        spec["initContainers"] = [c.manifest() for c in init]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


class DeviceManagerKubelet:
    """KubeletEmulator `on_admit` hook: one real device manager run per admitted pod, serially
    (the kubelet admits one pod at a time), against the long-lived plugin process."""

    def __init__(self, core: client.CoreV1Api, dirs: HarnessDir) -> None:
        self.core = core
        self.dirs = dirs
        self.lock = threading.Lock()
        self.allocations: dict[str, dict[str, dict[str, Any]]] = {}  # pod name -> container -> event
        self.exit_codes: dict[str, int] = {}
        self.reports: dict[str, str] = {}
        self.hold: dict[str, threading.Event] = {}  # pod name -> admission waits for this

    def __call__(self, v1pod: Any) -> None:
        if v1pod.metadata.name in self.hold:
            self.hold[v1pod.metadata.name].wait(60)
        with self.lock:
            try:
                pod = json.loads(
                    self.core.read_namespaced_pod(
                        v1pod.metadata.name, v1pod.metadata.namespace, _preload_content=False
                    ).data
                )
            except client.ApiException as e:
                if e.status == 404:
                    return  # deleted before admission: a kubelet never admits it
                raise
            if pod["metadata"].get("deletionTimestamp"):
                return
            h = self.dirs.harness
            rc = h.run([harness_pod(pod)], keep_checkpoint=True, wait_s=30)
            name = pod["metadata"]["name"]
            self.allocations[name] = h.allocations(pod["metadata"]["uid"])
            self.reports[name] = h.report()
            self.exit_codes[name] = rc  # last: the test's wait polls it, then reads the other two


@dataclass
class E2E:
    cluster: realk8s.ControlPlane
    ns: str
    node: str
    ext: ExtenderProcess
    dm: DeviceManagerKubelet

    def create(self, manifest: dict[str, Any]) -> None:
        self.cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(manifest))

    def pod(self, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.core.read_namespaced_pod(name, self.ns, _preload_content=False).data)

    def wait_admitted(self, names: list[str], timeout: float = 90) -> None:
        def done() -> bool:
            return all(n in self.dm.exit_codes for n in names)

        try:
            realk8s.until(done, timeout, f"device manager admission of {names}", interval=0.2)
        except AssertionError as e:
            state = {n: (self.pod(n)["spec"].get("nodeName"), (self.pod(n)["metadata"].get("annotations") or {})
                         .get(ANN_HANDOFF)) for n in names}  # fmt: skip
            raise AssertionError(f"{e}: {state}\n--- extender ---\n{self.ext.tail()}") from None


@pytest.fixture
def e2e(cluster: realk8s.ControlPlane, tmp_path: Path) -> Iterator[E2E]:
    sfx = uuid.uuid4().hex[:6]
    ns, node = f"e2e-{sfx}", f"e2en-{sfx}"
    cluster.ensure_namespace(ns)
    cluster.make_node(node, extended={RES_GPU: str(GPUS * SLOTS_PER_GPU)})
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    dirs = HarnessDir()
    nvml = {"gpus": GPUS, "numa_nodes": 1, "uuid_seed": node}
    plugin_log = (dirs.base / "plugin.log").open("w")
    plugin = subprocess.Popen(
        ["/bin/sh", "-c", plugin_command(node, dirs.kubelet_dir, kubeconfig, nvml)],
        stdout=plugin_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    ext = ExtenderProcess(kubeconfig, tmp_path / "extender.log")
    sched = None
    try:
        ext.wait_ready()
        # the plugin publishes the node's GPU inventory before any pod can be placed there
        realk8s.until(
            lambda: ANN_INVENTORY in (cluster.core.read_node(node).metadata.annotations or {}),
            30, "the device plugin's inventory on the node",
        )  # fmt: skip
        sched = cluster.start_scheduler(realk8s.gpupack_scheduler_config(ext.url), name="e2e-scheduler")
        dm = DeviceManagerKubelet(client.CoreV1Api(cluster.new_api_client()), dirs)
        with realk8s.KubeletEmulator(cluster, ns, on_admit=dm) as kubelet:
            yield E2E(cluster, ns, node, ext, dm)
        assert not kubelet.errors, kubelet.errors
    finally:
        if sched is not None:
            sched.stop()
        ext.stop()
        if plugin.poll() is None:
            os.killpg(plugin.pid, signal.SIGTERM)
            plugin.wait(10)
        plugin_log.close()
        dirs.close()


def expected_env(pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    """container -> the env its assignment implies (handoff.container_env)."""
    a = decode_assignment(pod["metadata"]["annotations"][ANN_ASSIGNMENT], pod=pod["metadata"]["name"])
    return {name: handoff.container_env(shares) for name, shares in a.containers.items()}


def check_request(pod: dict[str, Any], want: list[C]) -> None:
    a = decode_assignment(pod["metadata"]["annotations"][ANN_ASSIGNMENT], pod=pod["metadata"]["name"])
    for c in want:
        shares = a.containers[c.name]
        assert len(shares) == c.gpus, (c, shares)
        for s in shares:
            if c.mem:
                assert (s.mem_mib, s.sm_pct, s.exclusive) == (c.mem, c.sm, False), (c, s)
            else:
                assert s.exclusive, (c, s)


# pods whose containers exercise what the kubelet does differently from a naive reading: an init
# container reusing the app container's device IDs, two GPU containers, a whole GPU
PODS: dict[str, tuple[list[C], list[C]]] = {
    "share": ([C("main", 1, 40000, 30)], []),
    "init-same-count": ([C("main", 1, 40000, 30)], [C("download", 1, 8000, 10)]),
    "two-containers": ([C("a", 1, 20000, 20), C("b", 1, 20000, 20)], []),
    "whole": ([C("main", 1)], []),
}


def test_kubectl_create_to_container_env_equals_the_assignment(e2e: E2E) -> None:
    for name, (containers, init) in PODS.items():
        e2e.create(pod_manifest(name, e2e.ns, containers, init))
    e2e.wait_admitted(list(PODS))
    held: dict[str, list[tuple[str, int, int, bool]]] = {}
    for name, (containers, init) in PODS.items():
        pod = e2e.pod(name)
        ann = pod["metadata"]["annotations"]
        assert e2e.dm.exit_codes[name] == 0, e2e.dm.reports[name]
        assert pod["spec"]["nodeName"] == e2e.node
        check_request(pod, [*init, *containers])
        want = expected_env(pod)
        got = e2e.dm.allocations[name]
        assert list(got) == [c.name for c in [*init, *containers]], got.keys()  # the kubelet's order
        for cname, env in want.items():
            received = got[cname]["envs"]
            assert {k: received.get(k) for k in env} == env, (name, cname, received)
            # the kubelet's device IDs are slots of exactly the assigned GPUs
            uuids = {d.split("::")[0] for d in got[cname]["device_ids"][RES_GPU]}
            assert uuids == set(env["NVIDIA_VISIBLE_DEVICES"].split(",")), (
                name,
                cname,
                got[cname]["device_ids"],
            )
        assert ann[ANN_HANDOFF] == HANDOFF_DONE
        assert decode_allocated(ann[ANN_ALLOCATED], pod=name) == [c.name for c in [*init, *containers]]
        a = decode_assignment(ann[ANN_ASSIGNMENT], pod=name)
        for cname, shares in a.containers.items():
            if cname in {c.name for c in containers}:
                for s in shares:
                    held.setdefault(s.uuid, []).append((name, s.mem_mib, s.sm_pct, s.exclusive))
    for holders in held.values():  # app containers add up; init containers ran before them
        assert sum(m for _, m, _, _ in holders) <= 143771 and sum(s for _, _, s, _ in holders) <= 100, holders
        assert not any(ex for *_, ex in holders) or len(holders) == 1, holders


def test_pod_deleted_mid_handoff_does_not_lock_the_node(e2e: E2E) -> None:
    """A bound pod deleted before the kubelet admits it: the next pod is bound and admitted."""
    gate = e2e.dm.hold["first"] = threading.Event()
    e2e.create(pod_manifest("first", e2e.ns, [C("main", 1, 60000, 50)]))
    realk8s.until(
        lambda: (e2e.pod("first")["metadata"].get("annotations") or {}).get(ANN_HANDOFF) == HANDOFF_PENDING,
        60, "first pod bound with a pending handoff",
    )  # fmt: skip
    e2e.cluster.core.delete_namespaced_pod("first", e2e.ns)  # graceful: the emulated kubelet confirms
    realk8s.until(lambda: not any(p.metadata.name == "first" for p in e2e.cluster.core.list_namespaced_pod(e2e.ns).items),
                  30, "the deleted pod gone")  # fmt: skip
    gate.set()
    e2e.create(pod_manifest("second", e2e.ns, [C("main", 1, 60000, 50)]))
    e2e.wait_admitted(["second"])
    assert e2e.dm.exit_codes["second"] == 0, e2e.dm.reports["second"]
    assert "first" not in e2e.dm.exit_codes
    ann = e2e.pod("second")["metadata"]["annotations"]
    assert ann[ANN_HANDOFF] == HANDOFF_DONE
