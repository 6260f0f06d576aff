"""The DRA allocator's counts as Prometheus series in the extender's registry (its /metrics),
read at scrape time: the controller keeps plain ints and imports no prometheus_client."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from .controller import Counts


class AllocatorCollector(Collector):
    def __init__(self, counts: Callable[[], Counts]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = self.counts()  # counters: exported as <name>_total
        yield CounterMetricFamily(
            "gpupack_dra_allocator_claims_allocated", "ResourceClaims gpupack allocated", value=c.allocated
        )
        yield CounterMetricFamily(
            "gpupack_dra_allocator_pods_ungated", "Pods whose gpupack.io/dra-allocate gate gpupack removed",
            value=c.ungated,
        )  # fmt: skip
        yield CounterMetricFamily(
            "gpupack_dra_allocator_refusals", "Tries that left a pod gated (GPUClaimRefused)", value=c.refused
        )
        yield CounterMetricFamily(
            "gpupack_dra_allocator_conflicts", "Writes that found the claim or pod changed since read",
            value=c.conflicts,
        )  # fmt: skip
        yield CounterMetricFamily(
            "gpupack_dra_allocator_passes", "Allocator passes over gated pods", value=c.passes
        )


def register(registry: CollectorRegistry, counts: Callable[[], Counts]) -> None:
    registry.register(AllocatorCollector(counts))
