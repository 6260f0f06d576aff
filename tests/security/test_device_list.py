"""The device plugin can hand a container's GPU list to the NVIDIA container toolkit as volume
mounts, which a tenant cannot write into its pod spec: with the toolkit's
accept-nvidia-visible-devices-envvar-when-unprivileged = false, a tenant's own
NVIDIA_VISIBLE_DEVICES is then ignored (docs/operator-guide.md, "Security model")."""

from __future__ import annotations

import threading

import pytest

from deviceplugin.api import api_pb2
from deviceplugin.main import build_parser
from deviceplugin.server import DEVICE_LIST_DIR, DevicePluginService

ENV = {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b", "CUDA_DEVICE_MEMORY_LIMIT_0": "1024m"}


class _Allocator:
    def allocate(self, ids: list[str]) -> dict[str, str]:
        return dict(ENV)


def _allocate(strategy: str) -> api_pb2.ContainerAllocateResponse:
    svc = DevicePluginService(None, _Allocator(), threading.Event(), strategy)  # type: ignore[arg-type]
    req = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-a::0"])]
    )
    (resp,) = svc.Allocate(req, None).container_responses
    return resp


def test_volume_mounts_name_the_gpus_and_the_variable_does_not():
    r = _allocate("volume-mounts")
    assert [(m.container_path, m.host_path, m.read_only) for m in r.mounts] == [
        (f"{DEVICE_LIST_DIR}/GPU-a", "/dev/null", True),
        (f"{DEVICE_LIST_DIR}/GPU-b", "/dev/null", True),
    ]
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == DEVICE_LIST_DIR
    assert r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"  # the limits are unchanged


def test_envvar_is_the_default_and_both_sends_both():
    assert build_parser().parse_args(["--node-name", "n"]).device_list_strategy == "envvar"
    r = _allocate("envvar")
    assert not r.mounts and r.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    r = _allocate("both")
    assert len(r.mounts) == 2 and r.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    with pytest.raises(ValueError):
        DevicePluginService(None, _Allocator(), threading.Event(), "cdi")  # type: ignore[arg-type]
