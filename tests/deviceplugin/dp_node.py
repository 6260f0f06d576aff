"""`DP`, what the `dp` fixture hands a device-plugin test: one GPU node of the real control plane, its own namespace, a kubeconfig for the
plugin process, the kubelet's real device manager (tests/deviceplugin/harness.py) and the test
binder (what the extender writes at bind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import realk8s
from dp_binder import TestBinder
from fake_nvml import FakeNvml, fake_uuid
from harness import HarnessDir, plugin_command

from deviceplugin.discovery import discover, init_nvml
from deviceplugin.health import DeviceState
from deviceplugin.publish import node_patch
from gpupack import contract, handoff
from gpupack.contract import ANN_INVENTORY, RES_GPU, RES_GPU_MEM, RES_GPU_SM

Spec = tuple[str, int, int, int]  # container name, gpupack.io/gpu, gpu-mem MiB (0: whole GPUs), gpu-sm %


class DP:
    """Everything a device-plugin test needs, named uniquely for this test."""

    def __init__(self, cluster: realk8s.ControlPlane, tmp_path: Path) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.cluster = cluster
        self.core = cluster.core
        self.ns = f"dp-{suffix}"
        self.node = f"dpn-{suffix}"
        cluster.ensure_namespace(self.ns)
        cluster.make_node(self.node)
        self.kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
        self.dirs = HarnessDir()
        self.harness = self.dirs.harness
        self.kubelet_dir = self.dirs.kubelet_dir
        self.binder = TestBinder(self.core)
        self.procs: list[subprocess.Popen[str]] = []
        self.nvml: dict[str, Any] = {"gpus": 4, "numa_nodes": 1, "uuid_seed": self.node}

    # -- the plugin --
    def plugin_cmd(
        self,
        nvml: Mapping[str, Any] | None = None,
        *extra: str,
        kubeconfig: Path | None = None,
        podresources: bool = True,
    ) -> str:
        return plugin_command(
            self.node, self.kubelet_dir, kubeconfig or self.kubeconfig, nvml or self.nvml, *extra,
            podresources=podresources,
        )  # fmt: skip

    def start_plugin(
        self, nvml: Mapping[str, Any] | None = None, *extra: str, kubeconfig: Path | None = None
    ) -> subprocess.Popen[str]:
        """The plugin as a long-lived process of its own (it outlives harness runs, as a DaemonSet
        pod outlives kubelet restarts)."""
        log = self.dirs.base / f"plugin-own.{len(self.procs)}.log"
        with log.open("w") as out:
            p = subprocess.Popen(
                ["/bin/sh", "-c", self.plugin_cmd(nvml, *extra, kubeconfig=kubeconfig)],
                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        self.procs.append(p)
        return p

    def plugin_log(self, i: int = -1) -> str:
        logs = sorted(self.dirs.base.glob("plugin-own.*.log"))
        return logs[i].read_text() if logs else ""

    # -- pods --
    def make_pod(
        self, name: str, containers: Sequence[Spec] = (("main", 1, 10000, 20),), init: Sequence[Spec] = (),
        scheduler: str = contract.SCHEDULER_NAME,
    ) -> dict[str, Any]:  # fmt: skip
        def cs(lst: Sequence[Spec]) -> list[dict[str, Any]]:
            out = []
            for cname, n, mem, sm in lst:
                limits = {RES_GPU: str(n)} if n else {"cpu": "100m"}
                if mem:
                    limits[RES_GPU_MEM] = str(mem)
                if mem and sm:
                    limits[RES_GPU_SM] = str(sm)
                out.append({"name": cname, "image": "busybox", "resources": {"limits": limits}})
            return out

        body: dict[str, Any] = {
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"schedulerName": scheduler, "containers": cs(containers)},
        }
        if init:
            body["spec"]["initContainers"] = cs(init)
        return json.loads(self.core.create_namespaced_pod(self.ns, body, _preload_content=False).data)

    def bind(self, name: str, gpus: Mapping[str, Sequence[int]] | None = None) -> contract.Assignment:
        if self.inventory() is None:
            self.publish_inventory()
        return self.binder.bind(self.ns, name, self.node, gpus)

    def nvml_uuid(self, index: int) -> str:
        return fake_uuid(str(self.nvml["uuid_seed"]), index)

    def publish_inventory(self) -> None:
        """What the plugin publishes for `self.nvml`, as if it had run on this node before: the
        extender needs the inventory to bind, while a harness run starts the plugin only after."""
        nvml = FakeNvml(self.nvml)
        init_nvml(nvml)
        labels, annotations = node_patch(DeviceState(discover(nvml).gpus), handoff.ENFORCE_BOTH)
        self.core.patch_node(self.node, {"metadata": {"labels": labels, "annotations": annotations}})

    def read_pod(self, name: str) -> dict[str, Any]:
        return json.loads(self.core.read_namespaced_pod(name, self.ns, _preload_content=False).data)

    def annotations(self, name: str) -> dict[str, str]:
        return self.read_pod(name)["metadata"].get("annotations") or {}

    def inventory(self) -> contract.NodeInventory | None:
        n = json.loads(self.core.read_node(self.node, _preload_content=False).data)
        raw = (n["metadata"].get("annotations") or {}).get(ANN_INVENTORY)
        return contract.decode_inventory(raw, self.node) if raw else None

    def wait_inventory(self, pred: Any = None, timeout: float = 30) -> contract.NodeInventory:
        def ok() -> Any:
            inv = self.inventory()
            return inv if inv is not None and (pred is None or pred(inv)) else None

        return realk8s.until(ok, timeout, f"inventory of node {self.node}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
        self.dirs.close()
