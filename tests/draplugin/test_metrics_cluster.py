"""`gpupack dra-plugin --metrics-port` as a process against the real v1.36 API server: /healthz at
once, /readyz not ready until the kubelet registers the plugin (here the test plays the kubelet's
plugin watcher on the registration socket) and the node's ResourceSlice is published, then ready;
/metrics counts the slice write and the registration. Skipped where DRA is not served (the refusal
is tests/draplugin/test_dra_cluster.py's)."""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import realk8s
import yaml
from kubernetes import client

from draplugin import slices
from draplugin.api import pluginregistration_v1_pb2, pluginregistration_v1_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
DEVICEPLUGIN_TESTS = str(REPO / "tests" / "deviceplugin")  # the fake NVML (fake_nvml.py)
NODE = "dra-metrics-node"


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, name: str) -> float:
    (v,) = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return v


def test_probes_and_metrics_of_the_running_plugin(k8s: realk8s.ControlPlane, tmp_path: Path) -> None:
    try:
        k8s._get("/apis/resource.k8s.io/v1")
    except Exception:  # 404 before 1.34
        pytest.skip("this API server serves no resource.k8s.io/v1")
    k8s.make_node(NODE)
    nvml = tmp_path / "nvml.yaml"
    nvml.write_text(yaml.safe_dump({"gpus": 2, "memory_mib": 81920, "sm_count": 108, "uuid_seed": NODE}))
    reg, plugins = tmp_path / "reg", tmp_path / "plugins"
    cmd = (
        f"PYTHONPATH={shlex.quote(DEVICEPLUGIN_TESTS)} exec {shlex.quote(sys.executable)} -m gpupack.cli "
        f"dra-plugin --node-name {NODE} --kubeconfig {shlex.quote(str(k8s.kubeconfig))} "
        f"--registry-dir {reg} --plugins-dir {plugins} --cdi-dir {tmp_path / 'cdi'} "
        f"--nvml-module fake_nvml --nvml-config {nvml} --metrics-port 0 --metrics-addr 127.0.0.1"
    )
    log = tmp_path / "plugin.log"
    p = subprocess.Popen(["sh", "-c", cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
    resource = client.ResourceV1Api(k8s.api_client())
    try:
        found = realk8s.until(
            lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text()),
            30,
            "metrics port",
        )
        port = int(found.group(1))
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz") == (503, "not registered with the kubelet yet\n")
        # the kubelet's plugin watcher: GetInfo, then the registration's outcome
        with grpc.insecure_channel(f"unix://{reg / (slices.DRIVER + '-reg.sock')}") as ch:
            stub = pluginregistration_v1_pb2_grpc.RegistrationStub(ch)
            info = stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=10)
            assert info.endpoint == str(plugins / slices.DRIVER / "dra.sock")
            stub.NotifyRegistrationStatus(
                pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=True), timeout=10
            )
        realk8s.until(
            lambda: _get(port, "/readyz") == (200, "ok\n"), 30, "ready once registered and published"
        )
        status, text = _get(port, "/metrics")
        assert status == 200
        assert _metric(text, "gpupack_draplugin_kubelet_registrations_total") == 1
        assert _metric(text, "gpupack_draplugin_slice_publishes_total") >= 1
        assert _metric(text, "gpupack_draplugin_slice_publish_errors_total") == 0
        assert 'gpupack_gpu_healthy{index="1",model=' in text
    finally:
        p.terminate()
        p.wait(15)
        with contextlib.suppress(client.ApiException):
            resource.delete_resource_slice(slices.slice_name(NODE))
        with contextlib.suppress(client.ApiException):
            k8s.core.delete_node(NODE)
    assert p.returncode == 0, log.read_text()[-2000:]
