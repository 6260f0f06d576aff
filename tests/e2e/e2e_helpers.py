"""Launchers for the end-to-end tests: the real extender process, a node (device plugin + test
kubelet), and kube-scheduler's two extender calls. Kept apart from any conftest.py (those names
collide across test folders)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from kubernetes import client

from deviceplugin.discovery import discover, init_nvml
from deviceplugin.fake_nvml import FakeNvml
from deviceplugin.plugin import DevicePlugin, PluginConfig
from gpupack.contract import ANN_INVENTORY, SLOTS_PER_GPU

REPO = Path(__file__).resolve().parents[2]
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


def write_kubeconfig(path: Path, url: str) -> Path:
    cluster = {"name": "t", "cluster": {"server": url}}
    ctx = {"name": "t", "context": {"cluster": "t", "user": "t"}}
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "t", "user": {}}],
                "contexts": [ctx],
                "current-context": "t",
            }
        )
    )
    return path


class Extender:
    """`gpupack extender` (gunicorn) as a child process on a free loopback port."""

    def __init__(self, kubeconfig: Path, log: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{self.port}", log
        cmd = [
            sys.executable,
            "-m",
            "gpupack",
            "extender",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kubeconfig",
            str(kubeconfig),
            "--webhook-port",
            "0",
            "--log-level",
            "warning",
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.http = requests.Session()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_ready(self, timeout: float = 30.0) -> Extender:
        def ready() -> bool:
            assert self.proc.poll() is None, f"extender exited: {self.tail()}"
            try:
                return self.http.get(self.url + "/readyz", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        until(ready, timeout, f"extender /readyz ({self.log})", interval=0.1)
        return self

    def post(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        r = requests.post(
            f"{self.url}/{verb}",
            data=json.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, f"/{verb} answered {r.status_code}: {r.text[:500]}"
        return r.json()

    def reserved(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(node, GPU UUID) -> (reserved MiB, reserved SM %), read from /metrics."""
        out: dict[tuple[str, str], list[float]] = {}
        for line in self.http.get(self.url + "/metrics", timeout=5).text.splitlines():
            for i, name in enumerate(("gpupack_gpu_reserved_mem_mib{", "gpupack_gpu_reserved_sm_percent{")):
                if line.startswith(name):
                    labels = dict(kv.split("=", 1) for kv in line[len(name) : line.index("}")].split(","))
                    key = (labels["node"].strip('"'), labels["uuid"].strip('"'))
                    out.setdefault(key, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
        return {k: (v[0], round(v[1], 1)) for k, v in out.items()}

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
