"""The DRA allocator's counts reach the extender's registry, named by the project's scheme, read at
scrape time (no copy that could go stale)."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extender.controllers.dra.controller import Counts
from extender.controllers.dra.metrics import register


def _scrape(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_allocators_counts_are_counters_read_at_scrape_time() -> None:
    counts = Counts()
    registry = CollectorRegistry()
    register(registry, lambda: counts)
    before = _scrape(registry)
    names = {f"gpupack_dra_allocator_{n}_total" for n in ("claims_allocated", "pods_ungated", "refusals",
                                                          "conflicts", "passes")}  # fmt: skip
    assert set(before) == names and set(before.values()) == {0.0}
    for name in names:
        assert re.fullmatch(r"gpupack_dra_allocator_[a-z_]+_total", name), name
    counts.allocated, counts.ungated, counts.refused, counts.conflicts, counts.passes = 3, 2, 5, 1, 40
    after = _scrape(registry)
    assert (after["gpupack_dra_allocator_claims_allocated_total"], after["gpupack_dra_allocator_pods_ungated_total"],
            after["gpupack_dra_allocator_refusals_total"], after["gpupack_dra_allocator_conflicts_total"],
            after["gpupack_dra_allocator_passes_total"]) == (3, 2, 5, 1, 40)  # fmt: skip
