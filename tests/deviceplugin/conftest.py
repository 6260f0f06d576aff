"""Fixtures: an in-test Kubernetes API (KubeAPIServer), the test kubelet, and the plugin in-process."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from dp_kubelet import TestKubelet
from dp_util import NODE
from kubernetes import client

from deviceplugin.discovery import discover, init_nvml
from deviceplugin.fake_nvml import FakeNvml
from deviceplugin.plugin import DevicePlugin, PluginConfig

kubeapi = pytest.importorskip("gpupack.testing.kubeapi", reason="gpupack.testing.kubeapi not available")

@pytest.fixture
def api() -> Iterator[object]:
    server = kubeapi.KubeAPIServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def core(api) -> client.CoreV1Api:
    c = client.CoreV1Api(api.api_client())
    c.create_node({"metadata": {"name": NODE}})
    return c


@pytest.fixture
def plugin_dir() -> Iterator[str]:
    # unix socket paths are limited to ~107 bytes: keep the directory short
    d = tempfile.mkdtemp(prefix="dp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir) -> Iterator[TestKubelet]:
    k = TestKubelet(plugin_dir).start()
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def start_plugin(api, core, plugin_dir):
    started: list[DevicePlugin] = []

    def start(fake: dict | None = None, **cfg_kwargs) -> tuple[DevicePlugin, FakeNvml]:
        nvml = FakeNvml(fake or {"gpus": 8, "numa_nodes": 2})
        init_nvml(nvml)
        cfg = PluginConfig(node=NODE, kubelet_dir=plugin_dir, probe_interval_s=0.2, **cfg_kwargs)
        p = DevicePlugin(cfg, nvml, discover(nvml), api.api_client())
        p.start()
        started.append(p)
        return p, nvml

    yield start
    for p in started:
        p.stop()
