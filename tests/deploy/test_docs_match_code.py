"""The operator guide and the Grafana dashboard name only metrics and flags the code has, and the
guide documents every metric and flag the code has."""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path

import pytest

from extender.state.gpu_gauges import FAMILIES

REPO = Path(__file__).resolve().parents[2]
GUIDE = (REPO / "docs" / "operator-guide.md").read_text()
DASHBOARD = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
METRIC = re.compile(r"\bgpupack_[a-z0-9_]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def code_metrics() -> set[str]:
    """Metric names defined in the components' sources, as Prometheus exposes them."""
    names: set[str] = set()
    for path in [
        *REPO.glob("extender/**/*.py"),
        *REPO.glob("deviceplugin/**/*.py"),
        *REPO.glob("gpupack/**/*.py"),
    ]:
        text = path.read_text()
        if "prometheus_client" not in text:
            continue
        for kind, name in re.findall(
            r"\b(Counter|Gauge|Histogram|Summary|GaugeMetricFamily|CounterMetricFamily)\(\s*\"(gpupack_[a-z0-9_]+)\"",
            text,
        ):
            if kind in ("Counter", "CounterMetricFamily") and not name.endswith("_total"):
                name += "_total"
            names.add(name)
    # the per-GPU gauges are written by the extender itself (extender/state/gpu_gauges.py), not declared
    # through a prometheus_client class
    names.update(name for name, _ in FAMILIES)
    return names


def base(name: str) -> str:
    for s in SUFFIXES:
        if name.endswith(s) and s != "_total":
            return name[: -len(s)]
    return name


def known(name: str, defined: set[str]) -> bool:
    return name in defined or base(name) in defined or base(name) + "_total" in defined


def test_code_defines_metrics():
    assert {
        "gpupack_extender_binds_total",
        "gpupack_gpu_healthy",
        "gpupack_deviceplugin_allocate_seconds",
    } <= code_metrics()


def test_guide_names_only_real_metrics_and_all_of_them():
    defined = code_metrics()
    mentioned = set(METRIC.findall(GUIDE))
    defrag_metrics = REPO / "extender" / "controllers" / "defrag" / "metrics.py"
    if not defrag_metrics.exists():  # built in parallel; checked once present
        mentioned = {m for m in mentioned if not m.startswith("gpupack_defrag_")}
    assert sorted(m for m in mentioned if not known(m, defined)) == []
    assert sorted(defined - {base(m) for m in mentioned} - mentioned) == []


def test_dashboard_queries_use_real_metrics():
    defined = code_metrics()
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    assert exprs
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert sorted(m for m in used if not known(m, defined)) == []
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }


def _section(heading: str) -> str:
    start = GUIDE.index(heading)
    nxt = GUIDE.find("\n### ", start + 1)
    return GUIDE[start : nxt if nxt != -1 else None]


@pytest.mark.parametrize(
    "heading,module",
    [
        ("### `gpupack extender`", "extender.main"),
        ("### `gpupack device-plugin`", "deviceplugin.main"),
        ("### `python -m gpupack.certs`", "gpupack.certs"),
        ("### `gpupack defrag`", "extender.controllers.defrag.cli"),
    ],
)
def test_guide_flag_tables_match_the_parsers(heading, module):
    if (
        module.startswith("extender.controllers.defrag")
        and not (REPO / "extender" / "controllers" / "defrag").is_dir()
    ):
        pytest.skip("extender/controllers/defrag not present yet")
    parser = importlib.import_module(module).build_parser()
    have = _flags(parser)
    table_rows = [line for line in _section(heading).splitlines() if line.startswith("| `--")]
    documented = {f for line in table_rows for f in re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1])}
    assert sorted(documented - have) == [], "documented flags the command does not have"
    assert sorted(have - documented) == [], "flags missing from the guide"
