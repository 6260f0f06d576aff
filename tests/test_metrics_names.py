"""One metrics naming scheme across the components, and a dashboard that queries only what they export.

The names come from the registries themselves (the extender's with a view holding one GPU node, the
device plugin's with one GPU, a defrag run's), not from reading the sources."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.health import DeviceState
from deviceplugin.metrics import Metrics as PluginMetrics
from extender.controllers.defrag.metrics import RunMetrics
from extender.state.gpu_gauges import render
from extender.state.metrics import Metrics as ExtenderMetrics
from extender.state.view import ClusterView
from gpupack.contract import ANN_INVENTORY, GPUInfo, NodeInventory

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
METRIC = re.compile(r"\bgpupack_[a-zA-Z0-9_:]+")
H100_MIB = 81559
GPU = GPUInfo(uuid="GPU-aaaa-0", index=0, model="NVIDIA-H100", mem_mib=H100_MIB, sm_count=132)
CLUSTER_ONLY = {
    "gpupack_gpu_reserved_memory_bytes", "gpupack_gpu_memory_bytes", "gpupack_gpu_reserved_sm_ratio",
    "gpupack_gpu_class", "gpupack_cluster_fragmentation_ratio", "gpupack_cluster_pods",
    "gpupack_cluster_pending_handoffs",
}  # fmt: skip


def _view() -> ClusterView:
    view = ClusterView()
    ann = {ANN_INVENTORY: NodeInventory(gpus=(GPU,)).to_json()}
    view.apply_node({
        "metadata": {"name": "n1", "labels": {}, "annotations": ann},
        "spec": {},
        "status": {"allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110"}},
    })  # fmt: skip
    return view


def extender_registry(active: bool = True) -> CollectorRegistry:
    m = ExtenderMetrics()
    m.attach_view(_view(), active=lambda: active)
    return m.registry


def plugin_registry() -> CollectorRegistry:
    return PluginMetrics("n1", DeviceState((GPU,))).registry


def exported(registry: CollectorRegistry) -> dict[str, str]:
    """Series name -> type, as a scrape names them (counters with `_total`, histograms with
    `_bucket`/`_sum`/`_count`)."""
    out: dict[str, str] = {}
    for fam in registry.collect():
        if fam.type == "counter":
            out[fam.name + "_total"] = fam.type
        elif fam.type == "histogram":
            out.update({fam.name + s: fam.type for s in ("_bucket", "_sum", "_count")})
        else:
            out[fam.name] = fam.type
    return out


def all_exported() -> dict[str, str]:
    return {**exported(extender_registry()), **exported(plugin_registry()), **exported(RunMetrics().registry)}


def dashboard_queries() -> list[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] for v in DASHBOARD["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    return exprs


def test_dashboard_queries_name_only_exported_series():
    names = all_exported()
    used = {m for e in dashboard_queries() for m in METRIC.findall(e)}
    assert len(used) >= 10  # the parse found the queries' series
    assert sorted(used - set(names)) == []


def test_names_follow_one_scheme():
    names = all_exported()
    for name, kind in names.items():
        assert re.fullmatch(r"gpupack_[a-z0-9_]+", name), name
        # base units only: bytes and ratios, never MiB or percent
        assert not re.search(r"_(mib|mb|percent|pct|ms|milli)(_|$)", name), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
    assert {n for n in names if n.endswith("_seconds_bucket")} >= {
        "gpupack_extender_request_seconds_bucket", "gpupack_deviceplugin_allocate_seconds_bucket",
    }  # fmt: skip


def _samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(render(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_gpu_has_the_same_names_labels_and_units_in_the_extender_and_the_plugin():
    ext, dp = _samples(extender_registry()), _samples(plugin_registry())
    shared = {n for n in ext if n.startswith("gpupack_gpu_")} & {
        n for n in dp if n.startswith("gpupack_gpu_")
    }
    assert shared >= {
        "gpupack_gpu_memory_bytes",
        "gpupack_gpu_reserved_memory_bytes",
        "gpupack_gpu_reserved_sm_ratio",
    }
    for samples in (ext, dp):
        for name, series in samples.items():
            if name.startswith("gpupack_gpu_"):
                for labels, _ in series:
                    assert {labels.get("node"), labels.get("uuid"), labels.get("index")} == {"n1", GPU.uuid, "0"}, (
                        name, labels,
                    )  # fmt: skip
    for samples in (ext, dp):
        assert samples["gpupack_gpu_memory_bytes"][0][1] == H100_MIB * 2**20
        assert samples["gpupack_gpu_reserved_sm_ratio"][0][1] == 0.0


def test_only_the_active_replica_exports_the_cluster_gauges():
    active, standby = exported(extender_registry(True)), exported(extender_registry(False))
    assert set(active) >= CLUSTER_ONLY
    assert not CLUSTER_ONLY & set(standby)
    # what is the replica's own stays on both: its counters, latency, and whether it is synced/active
    assert set(active) - set(standby) == CLUSTER_ONLY
    text = {a: render(extender_registry(a)).decode() for a in (True, False)}
    assert "gpupack_extender_active 1.0" in text[True] and "gpupack_extender_active 0.0" in text[False]


def test_a_failing_leader_check_is_a_standby_not_a_failed_scrape():
    m = ExtenderMetrics()

    def broken() -> bool:
        raise RuntimeError("Lease unreadable")

    m.attach_view(_view(), active=broken)
    text = render(m.registry).decode()
    assert "gpupack_extender_active 0.0" in text and "gpupack_gpu_memory_bytes" not in text
