"""Fixtures: an in-test Kubernetes API server and the real `gpupack extender` process (gunicorn)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import ExtenderProcess, write_kubeconfig

from gpupack.testing.kubeapi import KubeAPIServer


@pytest.fixture
def kubeapi() -> Iterator[KubeAPIServer]:
    with KubeAPIServer(bookmark_interval=0.5) as srv:
        yield srv


@pytest.fixture
def kubeconfig(kubeapi: KubeAPIServer, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", kubeapi.url)


@pytest.fixture
def start_extender(kubeconfig: Path, tmp_path: Path):
    procs: list[ExtenderProcess] = []

    def start(*extra: str, ready: bool = True) -> ExtenderProcess:
        p = ExtenderProcess(kubeconfig, tmp_path / f"extender-{len(procs)}.log", *extra)
        procs.append(p)
        if ready:
            p.wait_ready()
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def env_no_proxy(monkeypatch):
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
