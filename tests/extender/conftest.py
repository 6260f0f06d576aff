"""Fixtures: an in-test Kubernetes API server and the real `gpupack extender` process (gunicorn)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gpupack.contract import ANN_HANDOFF, HANDOFF_DONE, HANDOFF_PENDING, LABEL_MANAGED
from gpupack.testing.kubeapi import KubeAPIServer

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_kubeconfig(path: Path, url: str) -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        "current-context": "t",
    }
    path.write_text(json.dumps(cfg))
    return path


class ExtenderProc:
    def __init__(self, kubeconfig: Path, extra: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable, "-m", "gpupack", "extender", "--host", "127.0.0.1", "--port", str(self.port),
            "--kubeconfig", str(kubeconfig), "--webhook-port", "0", "--log-level", "warning", *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.http = requests.Session()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"extender exited: {self.log.read_text()[-3000:]}")
            try:
                if self.http.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise AssertionError(f"extender not ready: {self.log.read_text()[-3000:]}")

    def post(self, verb: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        return self.http.post(f"{self.url}/{verb}", data=data, headers={"Content-Type": "application/json"},
                              timeout=kw.get("timeout", 30))

    def reserved(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(node, gpu) -> (reserved MiB, reserved SM %) from /metrics."""
        text = self.http.get(self.url + "/metrics", timeout=5).text
        out: dict[tuple[str, str], list[float]] = {}
        for line in text.splitlines():
            for name, i in (("gpupack_gpu_reserved_mem_mib{", 0), ("gpupack_gpu_reserved_sm_percent{", 1)):
                if line.startswith(name):
                    labels = dict(kv.split("=", 1) for kv in line[len(name):line.index("}")].split(","))
                    key = (labels["node"].strip('"'), labels["gpu"].strip('"'))
                    out.setdefault(key, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
        return {k: (v[0], v[1]) for k, v in out.items()}

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def kubeapi() -> Iterator[KubeAPIServer]:
    with KubeAPIServer(bookmark_interval=0.5) as srv:
        yield srv


@pytest.fixture
def kubeconfig(kubeapi: KubeAPIServer, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", kubeapi.url)


@pytest.fixture
def start_extender(kubeconfig: Path, tmp_path: Path):
    procs: list[ExtenderProc] = []

    def start(*extra: str, ready: bool = True) -> ExtenderProc:
        p = ExtenderProc(kubeconfig, list(extra), tmp_path / f"extender-{len(procs)}.log")
        procs.append(p)
        if ready:
            p.wait_ready()
        return p

    yield start
    for p in procs:
        p.stop()


class FakeKubelet:
    """Plays kubelet + device plugin for the handoff: marks bound pods' handoff done."""

    def __init__(self, server: KubeAPIServer, delay: float = 0.0) -> None:
        self.server, self.delay = server, delay
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.served: list[str] = []

    def run(self) -> None:
        while not self.stop_ev.wait(0.01):
            for p in self.server.list("pods"):
                meta = p["metadata"]
                if meta.get("labels", {}).get(LABEL_MANAGED) and p["spec"].get("nodeName") and \
                        meta.get("annotations", {}).get(ANN_HANDOFF) == HANDOFF_PENDING:
                    time.sleep(self.delay)
                    try:
                        self.server.patch("pods", meta["name"], {"metadata": {"annotations": {ANN_HANDOFF: HANDOFF_DONE}}},
                                          meta["namespace"])
                        self.served.append(meta["name"])
                    except Exception:  # noqa: BLE001 - the pod may be gone meanwhile
                        pass

    def __enter__(self) -> FakeKubelet:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_ev.set()
        self.thread.join(5)


@pytest.fixture
def env_no_proxy(monkeypatch):
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
