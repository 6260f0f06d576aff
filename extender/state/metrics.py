"""Prometheus metrics of the extender, in a registry of its own.

Names follow one scheme across the components (docs/operator-guide.md, Metrics): base units
(`_bytes`, `_ratio`, `_seconds`), counters end in `_total`, a GPU is labelled by `node`, `uuid`
and `index`, and the same quantity has the same name wherever it is exported (the device plugin
exports `gpupack_gpu_memory_bytes` too).

Per-GPU and cluster gauges are produced at scrape time from the view (a collector), so keeping
them costs nothing on the scheduling path; each node's per-GPU lines are written once per node
version and kept (gpu_gauges.py), and the /metrics handler writes the registry with `render`.
Every scheduler replica's extender holds the same view, so only the active one (beside the
kube-scheduler holding the leader Lease) exports them: otherwise each sum over the cluster would
count every GPU once per replica.

Fragmentation (`gpupack_cluster_fragmentation_ratio`): the share of free GPU memory that sits on
partly used GPUs, 0 when every free MiB is on an idle GPU, towards 1 when free memory is spread
in slivers no large model can use. Computed over healthy GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .gpu_gauges import GpuGauges
from .view import ClusterView

# fine below 50 ms: the verbs' latency targets are 10 ms (1,000 nodes) and 50 ms (5,000 nodes)
BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
           10, 30)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "gpupack_extender_request_seconds",
            "Extender request latency by verb",
            ["verb"],
            buckets=BUCKETS,
            registry=r,
        )
        # request_seconds runs from the request's headers; a client still writing its body (a
        # kube-scheduler waiting for a CPU on a busy control-plane node) counts there, not here
        self.answer = Histogram(
            "gpupack_extender_answer_seconds",
            "Extender verb latency from the whole request body received to the answer, by verb",
            ["verb"],
            buckets=BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "gpupack_extender_node_rejections_total",
            "Nodes rejected at filter, by reason",
            ["reason"],
            registry=r,
        )
        self.bind_failures = Counter(
            "gpupack_extender_bind_failures_total", "Failed binds, by reason", ["reason"], registry=r
        )
        self.bind_wait = Histogram(
            "gpupack_extender_bind_wait_seconds",
            "Time a bind waited for its node: behind other binds there and for a pending GPU handoff",
            buckets=BUCKETS,
            registry=r,
        )
        self.binds = Counter("gpupack_extender_binds_total", "Successful binds", registry=r)
        self.bad_requests = Counter(
            "gpupack_extender_bad_requests_total", "Requests answered with 4xx, by verb", ["verb"], registry=r
        )
        self.problems = Counter(
            "gpupack_extender_annotation_problems_total",
            "Corrupt or conflicting annotations seen in the cluster, by kind",
            ["kind"],
            registry=r,
        )
        self.requeued = Counter(
            "gpupack_extender_requeued_pods_total",
            "Waiting pods asked to retry (gpupack.io/requeued-at), by why: restart (the extender's "
            "first sync) or room (a node gained room; see Requeuer)",
            ["why"],
            registry=r,
        )
        self.gc_full = Histogram(
            "gpupack_extender_gc_full_seconds",
            "Full garbage collections, run between verbs (extender/verbs/collector.py), by whether one was "
            "overdue and ran while filters kept coming",
            ["overdue"],
            buckets=BUCKETS,
            registry=r,
        )
        self.warmed = Histogram(
            "gpupack_extender_shape_warm_seconds",
            "A pod shape's answers computed off kube-scheduler's cycle (extender/verbs/warming.py), by why: "
            "pending (a pod of that shape waits to be scheduled) or learnt (the policy learnt, every "
            "node is scored again)",
            ["why"],
            buckets=BUCKETS,
            registry=r,
        )
        self.admission = Counter(
            "gpupack_webhook_admission_total",
            "Admission reviews, by kind and result",
            ["kind", "result"],
            registry=r,
        )

        self._sizes_attached = False

    def full_collection(self, seconds: float, overdue: bool) -> None:
        self.gc_full.labels("true" if overdue else "false").observe(seconds)

    def attach_extender(self, ext: Sized) -> None:
        """Export `ext.tracked_sizes()` (framework.Extender) as `gpupack_extender_tracked_entries`:
        a count per map the process keeps, which should follow the live pods and nodes, not how
        many came and went. Once per registry (a second Extender on the same Metrics is not)."""
        if not self._sizes_attached:
            self._sizes_attached = True
            self.registry.register(SizesCollector(ext))

    def attach_view(self, view: ClusterView, active: Callable[[], bool] = lambda: True) -> None:
        """`active`: whether this replica exports the cluster's gauges (the one whose scheduler
        holds the leader Lease; always, for a single replica)."""
        self.registry.register(ViewCollector(view, active))


class Sized(Protocol):
    def tracked_sizes(self) -> dict[str, int]: ...


class SizesCollector(Collector):
    """The extender's tracked structures' sizes at scrape time: ~80 len() calls under the view's
    lock, and a sum over per-node maps (~0.1 ms at 5,000 nodes)."""

    def __init__(self, ext: Sized) -> None:
        self.ext = ext

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "gpupack_extender_tracked_entries",
            "Entries in each map, set or queue the extender process keeps, by structure (they follow "
            "the live pods, nodes and pod shapes, not how many came and went)",
            labels=["structure"],
        )
        for name, n in sorted(self.ext.tracked_sizes().items()):
            g.add_metric([name], n)
        yield g


class ViewCollector(Collector):
    def __init__(self, view: ClusterView, active: Callable[[], bool] = lambda: True) -> None:
        self.view = view
        self.active = active
        self.gpus = GpuGauges(view)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpupack_extender_synced", "1 after the first full list", value=int(self.view.synced.is_set())
        )
        try:
            active = bool(self.active())
        except Exception:  # a scrape must not fail because the Lease cannot be read
            active = False
        yield GaugeMetricFamily(
            "gpupack_extender_active",
            "1 on the replica that exports the cluster's gauges (the leader)",
            value=int(active),
        )
        if active:
            yield from self._cluster()
        else:
            self.gpus.forget()

    def _cluster(self) -> Iterator[Metric]:
        snap = self.gpus.snapshot()
        yield from snap.families
        yield GaugeMetricFamily(
            "gpupack_cluster_fragmentation_ratio",
            "Share of free GPU memory on partly used GPUs",
            value=snap.fragmentation,
        )
        yield GaugeMetricFamily(
            "gpupack_cluster_pods", "gpupack pods holding GPU reservations", value=snap.pods
        )
        yield GaugeMetricFamily(
            "gpupack_cluster_pending_handoffs", "Pods bound but not yet allocated", value=snap.pending
        )
