"""Fixtures: the real control plane (tests/conftest.py's `cluster`), a namespace of the test's own,
and the real `gpupack extender` process talking to it."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import realk8s
from ext_helpers import DevicePluginEmulator
from processes import ExtenderProcess


@pytest.fixture
def sfx() -> str:
    """A suffix that keeps this test's node names apart from every other test's."""
    return secrets.token_hex(3)


@pytest.fixture
def ns(cluster: realk8s.ControlPlane, request: pytest.FixtureRequest, sfx: str) -> str:
    """A namespace of this test's own (with its `default` ServiceAccount, so pods can be created)."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = f"{base}-{sfx}"
    cluster.ensure_namespace(name)
    return name


@pytest.fixture
def kubeconfig(cluster: realk8s.ControlPlane, tmp_path: Path) -> Path:
    """An admin kubeconfig for the real API server."""
    return cluster.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def start_extender(kubeconfig: Path, tmp_path: Path):
    """Starts `gpupack extender` processes (admin kubeconfig unless one is given); stops them after."""
    procs: list[ExtenderProcess] = []

    def start(*extra: str, ready: bool = True, kubeconfig_path: Path | None = None) -> ExtenderProcess:
        p = ExtenderProcess(kubeconfig_path or kubeconfig, tmp_path / f"extender-{len(procs)}.log", *extra)
        procs.append(p)
        if ready:
            p.wait_ready()
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def kubelet(cluster: realk8s.ControlPlane, ns: str) -> Iterator[DevicePluginEmulator]:
    """The kubelet of every fake node, with gpupack's device plugin finishing each handoff; fails
    the test on any error either of them met."""
    plugin = DevicePluginEmulator(cluster)
    with realk8s.KubeletEmulator(cluster, ns, on_admit=plugin) as k:
        yield plugin
    assert not plugin.errors, plugin.errors
    assert not k.errors, k.errors


@pytest.fixture
def env_no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    yield
