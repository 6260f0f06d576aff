"""Prometheus metrics and the kubelet's probes of the DRA plugin (/metrics, /healthz, /readyz).

Named as the device plugin's (deviceplugin/metrics.py) and the extender's: base units, counters
`_total`, a GPU labelled by `node`, `uuid`, `index` and `model` with the same `gpupack_gpu_*` names
(so one dashboard reads either mode); the plugin's own series start `gpupack_draplugin_`.

What is reserved on each GPU, and how many claims are prepared, is read at scrape time from the CDI
directory (the plugin's only state), never from the API server: a scrape or a probe must not
depend on it, or a slow API server would restart the plugin on every GPU node. The directory is
read at most once per `ttl_s`, so a scrape storm costs one read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.health import DeviceState
from deviceplugin.metrics import METRICS_LIMITS, MIB, MetricsServer, serve_metrics
from draplugin import cdi
from gpupack.guarded import Limits

log = logging.getLogger("gpupack.draplugin.metrics")

# the outcome label's values, every one exported from the start at 0 (an alert on a rate needs the
# series before the first failure)
PREPARE_OUTCOMES = ("prepared", "refused", "conflict", "failed")
UNPREPARE_OUTCOMES = ("unprepared", "not_prepared", "failed")


class _PreparedCollector(Collector):
    """Per GPU: capacity, health and what the prepared claims reserve; per class: claims prepared."""

    def __init__(self, node: str, state: DeviceState, cdi_dir: str | Path, ttl_s: float) -> None:
        self.node = node
        self.state = state
        self.cdi_dir = cdi_dir
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._cache: tuple[float, list[cdi.PreparedClaim], int] = (-1e9, [], 0)

    def _prepared(self) -> tuple[list[cdi.PreparedClaim], int]:
        with self._lock:
            t, claims, bad = self._cache
            if time.monotonic() - t >= self.ttl_s:
                try:
                    found, unreadable = cdi.prepared(self.cdi_dir)
                    claims, bad = found, len(unreadable)
                except OSError as e:  # a scrape must not fail because the directory is unreadable
                    log.warning("cannot read the CDI directory %s: %s", self.cdi_dir, e)
                self._cache = (time.monotonic(), claims, bad)
            return claims, bad

    def collect(self) -> Iterable[GaugeMetricFamily]:
        claims, bad = self._prepared()
        labels = ["node", "uuid", "index", "model"]
        cap = GaugeMetricFamily("gpupack_gpu_memory_bytes", "GPU memory of each GPU", labels=labels)
        sms = GaugeMetricFamily("gpupack_gpu_sm_count", "Streaming multiprocessors of the GPU", labels=labels)
        healthy = GaugeMetricFamily("gpupack_gpu_healthy", "1 when the GPU is healthy", labels=labels)
        rmem = GaugeMetricFamily(
            "gpupack_gpu_reserved_memory_bytes",
            "GPU memory reserved by the claims prepared on each GPU",
            labels=labels,
        )
        rsm = GaugeMetricFamily(
            "gpupack_gpu_reserved_sm_ratio",
            "Share of the SMs reserved by the claims prepared on each GPU (0-1)",
            labels=labels,
        )
        reserved: dict[str, tuple[int, int]] = {}
        by_class: dict[str, int] = {"online": 0, "offline": 0}
        for c in claims:
            by_class[c.pod_class] = by_class.get(c.pod_class, 0) + 1
            for d in c.devices:
                m, s = reserved.get(d.gpu_uuid, (0, 0))
                reserved[d.gpu_uuid] = (m + d.mem_mib, s + d.sm_pct)
        for g in self.state.gpus():
            lv = [self.node, g.uuid, str(g.index), g.model]
            cap.add_metric(lv, g.mem_mib * MIB)
            sms.add_metric(lv, g.sm_count)
            healthy.add_metric(lv, 1 if g.healthy else 0)
            m, s = reserved.get(g.uuid, (0, 0))
            rmem.add_metric(lv, m * MIB)
            rsm.add_metric(lv, s / 100)
        count = GaugeMetricFamily(
            "gpupack_draplugin_prepared_claims",
            "ResourceClaims prepared on this node (CDI spec files), by class",
            labels=["node", "class"],
        )
        for cls, n in sorted(by_class.items()):
            count.add_metric([self.node, cls], n)
        unreadable = GaugeMetricFamily(
            "gpupack_draplugin_unreadable_specs",
            "gpupack CDI spec files in the CDI directory that could not be read (ignored by the plugin)",
            labels=["node"],
        )
        unreadable.add_metric([self.node], bad)
        yield from (cap, sms, healthy, rmem, rsm, count, unreadable)


class _CountsCollector(Collector):
    """Counters kept by the parts themselves (the slice publisher, the registration service), read
    at scrape time: the parts stay free of prometheus_client."""

    def __init__(self, node: str, counts: Callable[[], dict[str, int]]) -> None:
        self.node = node
        self.counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        c = self.counts()
        for name, doc in (
            ("gpupack_draplugin_slice_publishes", "Writes of this node's ResourceSlice (create or update)"),
            (
                "gpupack_draplugin_slice_publish_errors",
                "Failed attempts to publish this node's ResourceSlice",
            ),
            ("gpupack_draplugin_kubelet_registrations", "Successful registrations with the kubelet"),
        ):
            fam = CounterMetricFamily(name, doc, labels=["node"])
            fam.add_metric([self.node], c.get(name, 0))
            yield fam


class Metrics:
    """The DRA plugin's registry. `counts` returns the publisher's and registration's counters by
    series name (without `_total`); `observe(op, outcome, seconds)` records one claim's prepare or
    unprepare (draplugin.service calls it)."""

    def __init__(
        self,
        node: str,
        state: DeviceState,
        cdi_dir: str | Path,
        counts: Callable[[], dict[str, int]] | None = None,
        ttl_s: float = 2.0,
    ) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.registry.register(_PreparedCollector(node, state, cdi_dir, ttl_s))
        self.registry.register(_CountsCollector(node, counts or dict))
        self.prepares = Counter(
            "gpupack_draplugin_prepares_total",
            "Claims NodePrepareResources handled, by outcome (refused: the claim breaks a rule or "
            "cannot be read; conflict: its GPU holds a claim of the other class; failed: the spec "
            "could not be written)",
            ["node", "outcome"],
            registry=self.registry,
        )
        self.unprepares = Counter(
            "gpupack_draplugin_unprepares_total",
            "Claims NodeUnprepareResources handled, by outcome",
            ["node", "outcome"],
            registry=self.registry,
        )
        for o in PREPARE_OUTCOMES:
            self.prepares.labels(node=node, outcome=o)
        for o in UNPREPARE_OUTCOMES:
            self.unprepares.labels(node=node, outcome=o)
        self.prepare_latency = Histogram(
            "gpupack_draplugin_prepare_seconds",
            "Time to prepare one claim (reading it from the API server, writing its CDI spec)",
            ["node"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        ).labels(node)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        if op == "prepare":
            self.prepares.labels(node=self.node, outcome=outcome).inc()
            self.prepare_latency.observe(seconds)
        else:
            self.unprepares.labels(node=self.node, outcome=outcome).inc()

    def serve(
        self,
        port: int,
        addr: str = "0.0.0.0",
        ready: Callable[[], str] | None = None,
        limits: Limits = METRICS_LIMITS,
    ) -> MetricsServer:
        """/metrics, plus /healthz and /readyz for the kubelet's probes, on a guarded listener
        with the device plugin's budgets; `ready` returns "" when ready, else why not."""
        return serve_metrics(self.registry, port, addr, ready, limits)


def not_ready(
    stopping: Callable[[], bool],
    sockets: Iterable[Path],
    registered: Callable[[], bool],
    published: Callable[[], bool],
) -> str:
    """Why the plugin is not ready ("" when it is): both sockets there for the kubelet, registered
    with it, and the node's ResourceSlice published once (until then no claim can be allocated
    here). Nothing here calls the API server."""
    if stopping():
        return "stopping"
    for s in sockets:
        if not s.exists():
            return f"socket {s} not there"
    if not registered():
        return "not registered with the kubelet yet"
    if not published():
        return "ResourceSlice not published yet"
    return ""
