"""The DevicePlugin gRPC service on the plugin's own unix socket."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from deviceplugin.allocate import Allocator
from deviceplugin.api import HEALTHY, UNHEALTHY, api_pb2, api_pb2_grpc
from deviceplugin.health import DeviceState
from deviceplugin.prestart import PreStart, PreStartRefused
from gpupack import contract
from gpupack.handoff import HandoffError

log = logging.getLogger("gpupack.deviceplugin.server")

# pre_start_required: the kubelet calls PreStartContainer before each container start, when it
# knows which pod holds the devices (deviceplugin/prestart.py); Allocate does not.
PLUGIN_OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


def device_id(uuid: str, slot: int) -> str:
    return f"{uuid}::{slot}"


def list_response(
    state: DeviceState, slots_per_gpu: int = contract.SLOTS_PER_GPU
) -> api_pb2.ListAndWatchResponse:
    """SLOTS_PER_GPU device IDs per GPU: the kubelet sees a small count, never one ID per MiB."""
    devices = []
    for g in state.gpus():
        topo = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=g.numa_node)]) if g.numa_node >= 0 else None
        health = HEALTHY if g.healthy else UNHEALTHY
        for k in range(slots_per_gpu):
            devices.append(api_pb2.Device(ID=device_id(g.uuid, k), health=health, topology=topo))
    return api_pb2.ListAndWatchResponse(devices=devices)


# How the container runtime learns a container's GPUs (NVIDIA container toolkit). "envvar":
# NVIDIA_VISIBLE_DEVICES. "volume-mounts": one mount per GPU under DEVICE_LIST_DIR, which only a
# device plugin (or an admin) can add: with the toolkit's
# accept-nvidia-visible-devices-envvar-when-unprivileged = false, a tenant's own
# NVIDIA_VISIBLE_DEVICES is then ignored. "both": either way (for mixed node configurations).
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "both")
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


def device_list_response(env: dict[str, str], strategy: str) -> api_pb2.ContainerAllocateResponse:
    uuids = [u for u in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u]
    if strategy == "envvar":
        return api_pb2.ContainerAllocateResponse(envs=env)
    mounts = [api_pb2.Mount(container_path=f"{DEVICE_LIST_DIR}/{u}", host_path="/dev/null", read_only=True)
              for u in uuids]  # fmt: skip
    if strategy == "volume-mounts":
        # what the toolkit expects then (and the UUIDs never appear in a variable a tenant could copy)
        env = {**env, "NVIDIA_VISIBLE_DEVICES": DEVICE_LIST_DIR}
    return api_pb2.ContainerAllocateResponse(envs=env, mounts=mounts)


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(
        self,
        state: DeviceState,
        allocator: Allocator,
        stopping: threading.Event,
        device_list: str = "envvar",
        prestart: PreStart | None = None,
    ) -> None:
        if device_list not in DEVICE_LIST_STRATEGIES:
            raise ValueError(
                f"device list strategy {device_list!r}: expected one of {DEVICE_LIST_STRATEGIES}"
            )
        self.state = state
        self.allocator = allocator
        self.stopping = stopping
        self.device_list = device_list
        self.prestart = prestart

    def GetDevicePluginOptions(self, request, context):  # noqa: N802 (gRPC method names)
        return PLUGIN_OPTIONS

    def ListAndWatch(self, request, context) -> Iterator[api_pb2.ListAndWatchResponse]:  # noqa: N802
        version = self.state.version
        log.info("ListAndWatch: kubelet connected")
        yield list_response(self.state)
        while context.is_active() and not self.stopping.is_set():
            v = self.state.wait_change(version, timeout_s=0.5)
            if v != version:
                version = v
                log.info("ListAndWatch: sending health update (state version %d)", v)
                yield list_response(self.state)

    def GetPreferredAllocation(self, request, context):  # noqa: N802
        out = []
        for req in request.container_requests:
            ids = self.allocator.preferred(
                list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size
            )
            out.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request, context):  # noqa: N802
        responses = []
        for req in request.container_requests:
            try:
                env = self.allocator.allocate(list(req.devices_ids))
            except HandoffError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpupack: {e}")
            responses.append(device_list_response(env, self.device_list))
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):  # noqa: N802
        if self.prestart is None:  # fail closed: registered with pre_start_required, nothing to ask
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "gpupack: no PreStartContainer check configured"
            )
        try:
            self.prestart.check(list(request.devices_ids))
        except PreStartRefused as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"gpupack: {e}")
        return api_pb2.PreStartContainerResponse()


def _remove_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


class PluginServer:
    """Owns the gRPC server on `socket_path`; restartable (the kubelet deletes the socket on restart)."""

    def __init__(self, socket_path: str, service: DevicePluginService, workers: int = 16) -> None:
        self.socket_path = socket_path
        self.service = service
        self.workers = workers
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        _remove_socket(self.socket_path)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="gpupack-grpc")
        )
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server
        log.info("serving the device plugin API on %s", self.socket_path)

    def socket_present(self) -> bool:
        try:
            return stat.S_ISSOCK(os.lstat(self.socket_path).st_mode)
        except FileNotFoundError:
            return False

    def restart(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=0.5)
            self._start_locked()

    def stop(self, grace: float = 1.0) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=grace).wait(grace + 1)
                self._server = None
            _remove_socket(self.socket_path)
