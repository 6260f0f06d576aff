"""A test kubelet built from the same proto: the device-plugin half of a real kubelet.

- serves Registration on <dir>/kubelet.sock and, on Register, dials the plugin's socket,
  asks its options and consumes ListAndWatch (like pkg/kubelet/cm/devicemanager);
- `restart()` does what a kubelet restart does to the directory: removes every plugin socket
  and re-creates kubelet.sock;
- admits pods bound to its node ONE AT A TIME (the kubelet's admission loop is serial),
  calling GetPreferredAllocation/Allocate once per GPU container, init containers first, with as
  many device IDs as the container requests, chosen from healthy, unallocated devices; a failed
  Allocate rejects the pod (phase Failed, reason UnexpectedAdmissionError) as the kubelet does.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from kubernetes import watch

from deviceplugin.api import API_VERSION, HEALTHY, api_pb2, api_pb2_grpc
from gpupack import handoff
from gpupack.contract import RES_GPU


@dataclass
class Admission:
    pod_key: str
    pod_uid: str
    ok: bool
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # container -> env
    device_ids: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: TestKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request, context):  # noqa: N802
        if request.version != API_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version}")
        if "/" not in request.resource_name:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not an extended resource: {request.resource_name}"
            )
        try:
            self.kubelet._connect(request.resource_name, request.endpoint, request.options)
        except Exception as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin: {e}")
        return api_pb2.Empty()


class TestKubelet:
    __test__ = False  # not a pytest test class

    def __init__(self, directory: str, resource: str = RES_GPU) -> None:
        self.dir = directory
        self.resource = resource
        self.sock = os.path.join(directory, "kubelet.sock")
        self.registrations: list[str] = []  # endpoints, in order
        self.devices: dict[str, str] = {}  # device ID -> health, latest ListAndWatch
        self.updates = 0  # ListAndWatch messages received
        self.last_message_bytes = 0
        self.allocated: dict[str, set[str]] = {}  # pod uid -> device IDs in use
        self.admissions: dict[str, Admission] = {}  # pod uid -> result
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.DevicePluginStub | None = None
        self._options: Any = None
        self._stop = threading.Event()
        self._admit_q: queue.Queue[dict | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    # --- Registration server ----------------------------------------------------------------------
    def start(self) -> TestKubelet:
        os.makedirs(self.dir, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix:{self.sock}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        self._stop.set()
        self._admit_q.put(None)
        if self._server:
            self._server.stop(0).wait(2)
        if self._channel:
            self._channel.close()
        for t in self._threads:
            t.join(timeout=5)

    def restart(self) -> None:
        """Kubelet restart: registration server down, plugin sockets removed, kubelet.sock re-created."""
        if self._server:
            self._server.stop(0).wait(2)
        if self._channel:
            self._channel.close()
            self._channel = None
        for name in os.listdir(self.dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, name))
        with self._cond:
            self.devices = {}
        time.sleep(0.05)
        self.start()

    def _connect(self, resource: str, endpoint: str, options: Any) -> None:
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.dir, endpoint)}")
        grpc.channel_ready_future(channel).result(timeout=5)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        self._options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        old = self._channel
        self._channel, self._stub = channel, stub
        if old is not None:
            old.close()
        stream = stub.ListAndWatch(api_pb2.Empty())
        t = threading.Thread(target=self._consume, args=(stream,), daemon=True)
        t.start()
        with self._cond:
            self.registrations.append(endpoint)
            self._cond.notify_all()

    def _consume(self, stream: Any) -> None:
        try:
            for msg in stream:
                with self._cond:
                    self.devices = {d.ID: d.health for d in msg.devices}
                    self.updates += 1
                    self.last_message_bytes = msg.ByteSize()
                    self._cond.notify_all()
        except grpc.RpcError:
            pass  # plugin went away or channel closed; a new Register reconnects

    def wait_for(self, pred, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(pred, timeout=timeout)

    def healthy_devices(self) -> list[str]:
        with self._cond:
            return sorted(d for d, h in self.devices.items() if h == HEALTHY)

    # --- admission ----------------------------------------------------------------------------------
    def allocate(self, device_ids: list[str]) -> api_pb2.AllocateResponse:
        assert self._stub is not None, "no plugin registered"
        return self._stub.Allocate(
            api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=device_ids)]
            ),
            timeout=15,
        )

    def admit(self, pod: dict) -> Admission:
        """Admit one pod: Allocate per GPU container, init containers first, in spec order."""
        view = handoff.pod_view(pod)
        result = Admission(pod_key=view.key, pod_uid=view.uid, ok=True)
        in_use = set().union(*self.allocated.values()) if self.allocated else set()
        mine: set[str] = set()
        for c in view.containers:
            n = c.gpu_count()
            if n == 0:
                continue
            free = [d for d in self.healthy_devices() if d not in in_use and d not in mine]
            if len(free) < n:
                result.ok, result.error = (
                    False,
                    f"container {c.name}: {n} {self.resource} wanted, {len(free)} free",
                )
                break
            if self._options is not None and self._options.get_preferred_allocation_available:
                pref = self._stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(
                        container_requests=[
                            api_pb2.ContainerPreferredAllocationRequest(
                                available_deviceIDs=free, allocation_size=n
                            )
                        ]
                    ),
                    timeout=10,
                )
                ids = list(pref.container_responses[0].deviceIDs)[:n]
                if len(ids) != n or not set(ids) <= set(free):
                    ids = free[:n]
            else:
                ids = free[:n]
            try:
                resp = self.allocate(ids)
            except grpc.RpcError as e:
                result.ok, result.error = False, e.details() or str(e)
                break
            mine |= set(ids)
            result.envs[c.name] = dict(resp.container_responses[0].envs)
            result.device_ids[c.name] = ids
        if result.ok:
            self.allocated[view.uid] = mine
        with self._cond:
            self.admissions[view.uid] = result
            self._cond.notify_all()
        return result

    def release(self, pod_uid: str) -> None:
        self.allocated.pop(pod_uid, None)

    # --- pods bound to this node, admitted one at a time ------------------------------------------
    def run_admission(self, core: Any, node: str) -> None:
        """Watch pods bound to `node` (official client) and admit each once, serially."""
        t1 = threading.Thread(target=self._watch_pods, args=(core, node), daemon=True)
        t2 = threading.Thread(target=self._admit_loop, args=(core,), daemon=True)
        self._threads += [t1, t2]
        t1.start()
        t2.start()

    def _watch_pods(self, core: Any, node: str) -> None:
        """List, then watch from that resourceVersion (relist on 410), like an informer."""
        seen: set[str] = set()
        while not self._stop.is_set():
            try:
                resp = core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}", _preload_content=False
                )
                body = json.loads(resp.data)
                for p in body.get("items", []):
                    self._offer(p, seen)
                rv = body["metadata"].get("resourceVersion", "")
                while not self._stop.is_set():
                    w = watch.Watch()
                    for ev in w.stream(
                        core.list_pod_for_all_namespaces,
                        field_selector=f"spec.nodeName={node}",
                        resource_version=rv,
                        timeout_seconds=2,
                        allow_watch_bookmarks=True,
                    ):
                        obj = ev["raw_object"]
                        if ev["type"] == "ERROR":
                            raise RuntimeError("watch expired")
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if ev["type"] == "DELETED":
                            self.release(obj["metadata"].get("uid", ""))
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            self._offer(obj, seen)
                        if self._stop.is_set():
                            w.stop()
            except Exception:
                if self._stop.wait(0.2):
                    return

    def _offer(self, obj: dict, seen: set[str]) -> None:
        uid = obj.get("metadata", {}).get("uid", "")
        view = handoff.pod_view(obj)
        if uid not in seen and view.live and view.phase in ("", "Pending"):
            seen.add(uid)
            self._admit_q.put(obj)

    def _admit_loop(self, core: Any) -> None:
        while not self._stop.is_set():
            pod = self._admit_q.get()
            if pod is None:
                return
            view = handoff.pod_view(pod)
            if not any(c.gpu_count() for c in view.containers):
                continue
            res = self.admit(pod)
            status = (
                {"phase": "Running"}
                if res.ok
                else {
                    "phase": "Failed",
                    "reason": "UnexpectedAdmissionError",
                    "message": f"Allocate failed due to {res.error}",
                }
            )
            with contextlib.suppress(Exception):
                core.patch_namespaced_pod_status(
                    view.name,
                    view.namespace,
                    {"status": status},
                    _content_type="application/merge-patch+json",
                )
