"""Registration with the kubelet, and re-registration when the kubelet restarts.

The kubelet deletes plugin sockets and re-creates kubelet.sock when it restarts; the watcher
polls both (cheap stat calls) and brings the plugin back within a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import grpc

from deviceplugin.api import API_VERSION, api_pb2, api_pb2_grpc
from deviceplugin.server import PLUGIN_OPTIONS, PluginServer
from gpupack.contract import RES_GPU

log = logging.getLogger("gpupack.deviceplugin.registration")


class RegistrationError(RuntimeError):
    pass


def register(kubelet_socket: str, endpoint: str, resource: str = RES_GPU, timeout_s: float = 5.0) -> None:
    """Registration.Register; RegistrationError with the kubelet's reason on failure."""
    with grpc.insecure_channel(f"unix:{kubelet_socket}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            api_pb2_grpc.RegistrationStub(channel).Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION, endpoint=endpoint, resource_name=resource, options=PLUGIN_OPTIONS
                ),
                timeout=timeout_s,
            )
        except grpc.FutureTimeoutError as e:
            raise RegistrationError(
                f"kubelet socket {kubelet_socket} did not answer within {timeout_s}s"
            ) from e
        except grpc.RpcError as e:
            raise RegistrationError(f"kubelet refused registration: {e.code().name}: {e.details()}") from e


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class KubeletWatcher:
    """Registers now, and again whenever kubelet.sock is re-created or our socket disappears."""

    def __init__(
        self,
        kubelet_socket: str,
        server: PluginServer,
        endpoint: str,
        poll_s: float = 0.2,
        retry_s: float = 1.0,
        on_registered: Callable[[], None] | None = None,
    ) -> None:
        self.kubelet_socket = kubelet_socket
        self.server = server
        self.endpoint = endpoint
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.on_registered = on_registered
        self.registered_identity: tuple[int, int, int] | None = None
        self.registrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpupack-kubelet-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        waiting_logged = False
        while not self._stop.is_set():
            ident = _identity(self.kubelet_socket)
            if not self.server.socket_present():
                log.warning(
                    "plugin socket %s was removed (kubelet restart?); serving again", self.server.socket_path
                )
                self.server.restart()
                self.registered_identity = None
            if ident is None:
                if not waiting_logged:
                    log.info("waiting for the kubelet socket %s", self.kubelet_socket)
                    waiting_logged = True
                self.registered_identity = None
            elif ident != self.registered_identity:
                waiting_logged = False
                try:
                    register(self.kubelet_socket, self.endpoint)
                except RegistrationError as e:
                    log.warning("registration failed: %s; retrying in %.1fs", e, self.retry_s)
                    self._stop.wait(self.retry_s)
                    continue
                self.registered_identity = ident
                self.registrations += 1
                log.info("registered %s with the kubelet (endpoint %s)", RES_GPU, self.endpoint)
                if self.on_registered:
                    self.on_registered()
            self._stop.wait(self.poll_s)
