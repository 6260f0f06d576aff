"""Launchers for the end-to-end tests: the real extender process, a node (device plugin + test
kubelet), and kube-scheduler's two extender calls. Kept apart from any conftest.py (those names
collide across test folders)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from processes import REPO, ExtenderProcess, write_kubeconfig

from deviceplugin.discovery import discover, init_nvml
from deviceplugin.fake_nvml import FakeNvml
from deviceplugin.plugin import DevicePlugin, PluginConfig
from gpupack.contract import ANN_INVENTORY, SLOTS_PER_GPU

# The device plugin tests' kubelet is a plain module in a folder without __init__.py.
sys.path.insert(0, str(REPO / "tests" / "deviceplugin"))
from dp_kubelet import TestKubelet  # noqa: E402

__all__ = ["Extender", "Node", "TestKubelet", "until", "write_kubeconfig"]


def until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            break
        time.sleep(interval)
    assert v, f"timed out after {timeout:g}s waiting for {what}"
    return v


class Extender(ExtenderProcess):
    """The shared launcher, with the e2e tests' stricter calls: answers must be 200, and
    reservations are keyed by GPU UUID."""

    def wait_ready(self, timeout: float = 30.0) -> Extender:  # type: ignore[override]
        super().wait_ready(timeout)
        return self

    def post(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        r = super().post(verb, body)
        assert r.status_code == 200, f"/{verb} answered {r.status_code}: {r.text[:500]}"
        return r.json()

    def reserved(self) -> dict[tuple[str, str], tuple[float, float]]:  # type: ignore[override]
        """(node, GPU UUID) -> (reserved MiB, reserved SM %), read from /metrics."""
        return {k: (mem, round(sm, 1)) for k, (mem, sm) in super().reserved("uuid").items()}


class Node:
    """One GPU node: the real device plugin on a FakeNvml, registered with a test kubelet over
    unix sockets in a short temp dir (socket paths are limited to ~107 bytes)."""

    def __init__(self, core: client.CoreV1Api, api_client: Any, name: str, gpus: int) -> None:
        self.name, self.core = name, core
        core.create_node({"metadata": {"name": name}})
        self.dir = tempfile.mkdtemp(prefix="e2e")
        self.kubelet = TestKubelet(self.dir).start()
        nvml = FakeNvml({"gpus": gpus, "numa_nodes": 1, "uuid_seed": name})
        init_nvml(nvml)
        cfg = PluginConfig(node=name, kubelet_dir=self.dir, probe_interval_s=0.5)
        self.plugin = DevicePlugin(cfg, nvml, discover(nvml), api_client)
        self.plugin.start()
        until(
            lambda: len(self.kubelet.healthy_devices()) == gpus * SLOTS_PER_GPU,
            15,
            f"{name}: device plugin registered and advertised {gpus * SLOTS_PER_GPU} device IDs",
        )
        until(
            lambda: ANN_INVENTORY in (self.read()["metadata"].get("annotations") or {}),
            10,
            f"{name}: device plugin published its inventory",
        )

    def read(self) -> dict[str, Any]:
        return json.loads(self.core.read_node(self.name, _preload_content=False).data)

    def admit(self) -> None:
        """Start the kubelet's serial admission of pods bound to this node."""
        self.kubelet.run_admission(self.core, self.name)

    def stop(self) -> None:
        self.plugin.stop()
        self.kubelet.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
