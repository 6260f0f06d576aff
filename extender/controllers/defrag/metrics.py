"""Metrics of one defrag run. A CronJob lives too briefly to be scraped, so the registry is
written as a Prometheus textfile (node-exporter textfile collector) and/or pushed to a Pushgateway."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, push_to_gateway, write_to_textfile

log = logging.getLogger("gpupack.defrag.metrics")


class RunMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.evictions = Counter(
            "gpupack_defrag_evictions_total",
            "Evictions attempted, by result (evicted, pdb-refused, gone, error)",
            ["result"],
            registry=r,
        )
        self.moves = Counter(
            "gpupack_defrag_moves_total", "Moves by outcome (done, skipped, aborted)", ["outcome"], registry=r
        )
        self.moves_aborted = Counter(
            "gpupack_defrag_moves_aborted_total",
            "Moves aborted (replacement not running in time, lease lost, window closed)",
            registry=r,
        )
        self.gpus_freed = Gauge("gpupack_defrag_gpus_freed", "Whole GPUs freed by this run", registry=r)
        self.nodes_freed = Gauge("gpupack_defrag_nodes_freed", "Whole nodes freed by this run", registry=r)
        self.planned_evictions = Gauge(
            "gpupack_defrag_planned_evictions", "Evictions in the plan", registry=r
        )
        self.planned_gpus = Gauge("gpupack_defrag_planned_gpus_freed", "GPUs the plan would free", registry=r)
        self.plan_seconds = Gauge("gpupack_defrag_plan_seconds", "Time spent planning", registry=r)
        self.last_run = Gauge(
            "gpupack_defrag_last_run_timestamp_seconds", "When this run ended (Unix time)", registry=r
        )
        self.result = Gauge(
            "gpupack_defrag_run_result", "1 for the run's result label", ["result"], registry=r
        )

    def export(self, textfile: str | None, pushgateway: str | None, job: str = "gpupack-defrag") -> None:
        self.last_run.set_to_current_time()
        if textfile:
            try:
                write_to_textfile(textfile, self.registry)
            except OSError as e:
                log.warning("could not write metrics to %s: %s", textfile, e)
        if pushgateway:
            try:
                push_to_gateway(pushgateway, job=job, registry=self.registry, timeout=10)
            except OSError as e:
                log.warning("could not push metrics to %s: %s", pushgateway, e)
