"""Wires discovery, health, serving, registration, publishing and metrics into one plugin."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from kubernetes import client

from deviceplugin.allocate import Allocator
from deviceplugin.api import DEFAULT_POD_RESOURCES_SOCKET, KUBELET_SOCKET_NAME
from deviceplugin.discovery import Discovery
from deviceplugin.health import DeviceState, HealthWatcher
from deviceplugin.kube import Kube
from deviceplugin.metrics import Metrics, MetricsServer
from deviceplugin.nvml_facade import NvmlFacade
from deviceplugin.prestart import PodResourcesClient, PreStart
from deviceplugin.publish import Publisher
from deviceplugin.registration import KubeletWatcher
from deviceplugin.server import DevicePluginService, PluginServer
from gpupack import handoff

log = logging.getLogger("gpupack.deviceplugin")

SOCKET_NAME = "gpupack.sock"


@dataclass
class PluginConfig:
    node: str
    kubelet_dir: str
    enforcement: str = handoff.ENFORCE_BOTH
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    probe_interval_s: float = 5.0
    socket_name: str = SOCKET_NAME
    device_list_strategy: str = "envvar"  # see server.DEVICE_LIST_STRATEGIES
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET


class DevicePlugin:
    def __init__(
        self, cfg: PluginConfig, nvml: NvmlFacade, discovery: Discovery, api_client: client.ApiClient
    ):
        self.cfg = cfg
        self.nvml = nvml
        self.state = DeviceState(discovery.gpus, discovery.skipped)
        self.kube = Kube(api_client)
        self.metrics = Metrics(cfg.node, self.state, list_pods=lambda: self.kube.pods_on_node(cfg.node))
        self.allocator = Allocator(self.kube, cfg.node, self.state, self.metrics, cfg.enforcement,
                                   after_failure=lambda: self.prestart.repair_consumed())  # fmt: skip
        self.stopping = threading.Event()
        self.socket_path = os.path.join(cfg.kubelet_dir, cfg.socket_name)
        self.podresources = PodResourcesClient(cfg.pod_resources_socket)
        self.prestart = PreStart(self.kube, cfg.node, self.podresources, self.metrics)
        self.server = PluginServer(self.socket_path, DevicePluginService(self.state, self.allocator, self.stopping,
                                                                            cfg.device_list_strategy, self.prestart))  # fmt: skip
        self.health = HealthWatcher(nvml, self.state, probe_interval_s=cfg.probe_interval_s)
        self.publisher = Publisher(self.kube, cfg.node, self.state, cfg.enforcement)
        self.watcher = KubeletWatcher(
            os.path.join(cfg.kubelet_dir, KUBELET_SOCKET_NAME),
            self.server,
            cfg.socket_name,
            on_registered=self.metrics.registrations.inc,
        )
        self._metrics_server: MetricsServer | None = None

    def start(self) -> None:
        os.makedirs(self.cfg.kubelet_dir, exist_ok=True)
        self.server.start()
        self.health.start()
        self.publisher.start()
        self.watcher.start()
        if self.cfg.metrics_port is not None:
            self._metrics_server = self.metrics.serve(
                self.cfg.metrics_port, self.cfg.metrics_addr, self._not_ready
            )
            log.info("metrics on http://%s:%d/metrics", self.cfg.metrics_addr, self.metrics_port)

    def _not_ready(self) -> str:
        """Why the plugin is not ready ("" when it is): its socket must be there for the kubelet."""
        if self.stopping.is_set():
            return "stopping"
        if not os.path.exists(self.socket_path):
            return f"device plugin socket {self.socket_path} not there"
        return ""

    @property
    def metrics_port(self) -> int | None:
        if self._metrics_server is None:
            return None
        return self._metrics_server.port

    def stop(self) -> None:
        """Stop serving and remove the socket (SIGTERM)."""
        self.stopping.set()
        self.state.wake_all()
        self.watcher.stop()
        self.server.stop()
        self.health.stop()
        self.publisher.stop()
        self.podresources.close()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        try:
            self.nvml.shutdown()
        except Exception as e:  # shutting down anyway
            log.debug("nvml shutdown: %s", e)
        log.info("device plugin stopped; socket %s removed", self.socket_path)
