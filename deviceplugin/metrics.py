"""Prometheus metrics of the device plugin (served on /metrics by prometheus-client).

Named as the extender's (extender/metrics.py): base units, counters `_total`, a GPU labelled by
`node`, `uuid` and `index`; the plugin's own series start `gpupack_deviceplugin_`.

Per-GPU reservations are computed at scrape time from the assignments of the live pods on this
node (state lives in Kubernetes), cached briefly so a scrape storm does not hammer the API.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.health import DeviceState
from gpupack import handoff, identity
from gpupack.contract import ANN_ASSIGNMENT, Assignment, ContractError
from gpupack.core.fit import pod_charge
from gpupack.guarded import GuardedServer, Limits, raise_fd_limit

log = logging.getLogger("gpupack.deviceplugin.metrics")

MIB = 1 << 20

# The metrics/health port is open to the network (Prometheus, the kubelet's probes): a budget of
# its own, served by gpupack/guarded.py, so idle or trickling connections hold no thread and the
# 1,025th connection closes the one that has waited longest. Scrapes and probes are small GETs;
# a scrape lists this node's pods at most once per ttl_s, so 4 threads are plenty. Scrapes and
# probes carry no body: 4 MiB of bodies in flight, and 64 requests waiting, are more than they use.
METRICS_LIMITS = Limits(max_connections=1024, max_body=65536, threads=4,
                        max_body_bytes_in_flight=4 << 20, max_queued=64)  # fmt: skip


def reserved_by_gpu(pods: Iterable[Any], node: str) -> dict[str, tuple[int, int]]:
    """uuid -> (reserved MiB, reserved SM %) summed over the live pods assigned on `node`.

    A pod's charge per GPU is gpupack.core.fit.pod_charge's: max(init, sum of app), as the
    scheduler charged it.
    """
    out: dict[str, tuple[int, int]] = {}
    for p in map(handoff.pod_view, pods):
        if not p.live or ANN_ASSIGNMENT not in p.annotations:
            continue
        try:
            a = p.assignment()
        except ContractError:
            continue
        if a.node != node:
            continue
        # init containers in the pod's order: an earlier one's own GPUs are a later one's to ride on
        by_name = _holds(a)
        inits = [c.name for c in p.containers if c.init and c.name in by_name]
        app = [hs for cname, hs in by_name.items() if cname not in inits]
        charged = pod_charge(app, [by_name[cname] for cname in inits])
        for uuid, (mem, sm, _) in charged.items():
            m0, s0 = out.get(uuid, (0, 0))
            out[uuid] = (m0 + mem, s0 + sm)
    return out


def _holds(a: Assignment) -> dict[str, list[tuple[str, int, int, bool]]]:
    return {
        cname: [(s.uuid, s.mem_mib, s.sm_pct, s.exclusive) for s in shares]
        for cname, shares in a.containers.items()
    }


class _GPUCollector(Collector):
    def __init__(
        self, node: str, state: DeviceState, list_pods: Callable[[], list[dict]] | None, ttl_s: float
    ):
        self.node = node
        self.state = state
        self.list_pods = list_pods
        self.ttl_s = ttl_s
        self._cache: tuple[float, dict[str, tuple[int, int]]] = (0.0, {})
        self._lock = threading.Lock()

    def _reserved(self) -> dict[str, tuple[int, int]]:
        if self.list_pods is None:
            return {}
        with self._lock:
            t, val = self._cache
            if time.monotonic() - t < self.ttl_s:
                return val
            try:
                val = reserved_by_gpu(self.list_pods(), self.node)
            except Exception as e:  # a scrape must not fail because the API is down
                log.warning("cannot compute reservations: %s", e)
                return val
            self._cache = (time.monotonic(), val)
            return val

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["node", "uuid", "index", "model"]
        cap = GaugeMetricFamily("gpupack_gpu_memory_bytes", "GPU memory of each GPU", labels=labels)
        sms = GaugeMetricFamily("gpupack_gpu_sm_count", "Streaming multiprocessors of the GPU", labels=labels)
        healthy = GaugeMetricFamily("gpupack_gpu_healthy", "1 when the GPU is healthy", labels=labels)
        rmem = GaugeMetricFamily(
            "gpupack_gpu_reserved_memory_bytes", "GPU memory reserved by gpupack pods", labels=labels
        )
        rsm = GaugeMetricFamily(
            "gpupack_gpu_reserved_sm_ratio", "Share of the SMs reserved on each GPU (0-1)", labels=labels
        )
        reserved = self._reserved()
        for g in self.state.gpus():
            lv = [self.node, g.uuid, str(g.index), g.model]
            cap.add_metric(lv, g.mem_mib * MIB)
            sms.add_metric(lv, g.sm_count)
            healthy.add_metric(lv, 1 if g.healthy else 0)
            m, s = reserved.get(g.uuid, (0, 0))
            rmem.add_metric(lv, m * MIB)
            rsm.add_metric(lv, s / 100)
        yield from (cap, sms, healthy, rmem, rsm)


class Metrics:
    def __init__(
        self,
        node: str,
        state: DeviceState,
        list_pods: Callable[[], list[dict]] | None = None,
        ttl_s: float = 5.0,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_GPUCollector(node, state, list_pods, ttl_s))
        self.node = node
        self.handoff_failures = Counter(
            "gpupack_deviceplugin_handoff_failures_total",
            "Allocate calls that failed the handoff, by reason",
            ["node", "reason"],
            registry=self.registry,
        )
        # node-labelled like the GPU series, so one dashboard filter selects a node's everything
        self.allocate_latency = Histogram(
            "gpupack_deviceplugin_allocate_seconds",
            "Allocate latency (including the Kubernetes API calls)",
            ["node"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        ).labels(node)
        self.prestart_refusals = Counter(
            "gpupack_deviceplugin_prestart_refusals_total",
            "Containers PreStartContainer refused to start, by reason (the holder of the GPU is not "
            "the pod gpupack assigned it to, or could not be identified)",
            ["node", "reason"],
            registry=self.registry,
        )
        for reason in identity.REASONS:  # every reason exported from the start, at 0
            self.prestart_refusals.labels(node=node, reason=reason)
        self.registrations = Counter(
            "gpupack_deviceplugin_kubelet_registrations_total",
            "Successful registrations with the kubelet",
            ["node"],
            registry=self.registry,
        ).labels(node)

    def handoff_failed(self, reason: str) -> None:
        self.handoff_failures.labels(node=self.node, reason=reason).inc()

    def serve(
        self,
        port: int,
        addr: str = "0.0.0.0",
        ready: Callable[[], str] | None = None,
        limits: Limits = METRICS_LIMITS,
    ) -> MetricsServer:
        """/metrics, plus /healthz and /readyz for the kubelet's probes. The probes never touch
        the API server (/metrics lists this node's pods): an API slowdown must not restart the
        plugin on every GPU node. `ready` returns "" when ready, else why not."""
        return serve_metrics(self.registry, port, addr, ready, limits)


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    addr: str = "0.0.0.0",
    ready: Callable[[], str] | None = None,
    limits: Limits = METRICS_LIMITS,
) -> MetricsServer:
    """A node plugin's listener (the device plugin's and the DRA plugin's): /metrics of `registry`,
    /healthz, and /readyz (503 with `ready()`'s reason while it is not ""), on a guarded server."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            why = ready() if ready is not None else ""
            status = "503 Service Unavailable" if why else "200 OK"
            start_response(status, [("Content-Type", "text/plain")])
            return [(why or "ok").encode() + b"\n"]
        body: Iterable[bytes] = metrics_app(environ, start_response)
        return body

    raise_fd_limit()  # each connection is a descriptor: the limit must be reached first
    server = GuardedServer()
    listener = server.add(app, addr, port, limits, name="metrics")
    server.start()
    return MetricsServer(server, listener.port)


class MetricsServer:
    """The running metrics/health listener: its port, and stop()."""

    def __init__(self, server: GuardedServer, port: int) -> None:
        self.server = server
        self.port = port

    def stop(self) -> None:
        self.server.stop()
