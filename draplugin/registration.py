"""The kubelet plugin registration service (pluginregistration v1) and the two sockets.

The kubelet's plugin watcher finds `<registry dir>/gpu.gpupack.io-reg.sock`, calls GetInfo (type
`DRAPlugin`, the driver name, the DRA service's endpoint, the versions offered) and reports the
outcome with NotifyRegistrationStatus. The DRA service listens on `<plugins dir>/gpu.gpupack.io/
dra.sock`; it starts first, since once the registration socket exists the kubelet may call it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from draplugin.api import (
    PLUGIN_TYPE,
    SERVICE_V1,
    SERVICE_V1BETA1,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from draplugin.service import Driver, add_services
from draplugin.slices import DRIVER

log = logging.getLogger("gpupack.draplugin.registration")
VERSIONS = (SERVICE_V1, SERVICE_V1BETA1)


class Registration(pluginregistration_v1_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, endpoint: str, on_registered: threading.Event) -> None:
        self.endpoint = endpoint
        self.registered = on_registered
        self.registrations = 0

    def GetInfo(self, request: Any, context: Any) -> Any:
        return pluginregistration_v1_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER, endpoint=self.endpoint, supported_versions=list(VERSIONS)
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            self.registrations += 1
            self.registered.set()
            log.info("registered with the kubelet as %s (%s)", DRIVER, ", ".join(VERSIONS))
        else:
            log.error("the kubelet refused the registration: %s", request.error)
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


class Sockets:
    """Both gRPC servers; `start` serves, `stop` stops and removes the sockets."""

    def __init__(self, driver: Driver, registry_dir: str, plugins_dir: str) -> None:
        self.driver = driver
        self.reg_sock = Path(registry_dir) / f"{DRIVER}-reg.sock"
        self.dra_sock = Path(plugins_dir) / DRIVER / "dra.sock"
        self.registered = threading.Event()
        self.registration = Registration(str(self.dra_sock), self.registered)
        self._dra: grpc.Server | None = None
        self._reg: grpc.Server | None = None

    def start(self) -> None:
        for s in (self.reg_sock, self.dra_sock):
            s.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(s)  # left by an earlier run of the plugin
        self._dra = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra"))
        add_services(self._dra, self.driver)
        if self._dra.add_insecure_port(f"unix://{self.dra_sock}") == 0:
            raise OSError(f"cannot listen on {self.dra_sock}")
        self._dra.start()
        self._reg = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dra-reg"))
        pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(self.registration, self._reg)
        if self._reg.add_insecure_port(f"unix://{self.reg_sock}") == 0:
            raise OSError(f"cannot listen on {self.reg_sock}")
        self._reg.start()
        log.info("serving %s (registration %s)", self.dra_sock, self.reg_sock)

    def stop(self) -> None:
        # the registration socket first: the kubelet sees the plugin go before its service does
        for server, sock in ((self._reg, self.reg_sock), (self._dra, self.dra_sock)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
            if server is not None:
                server.stop(1).wait(2)
