"""The DRA plugin's metrics and probes without a cluster: names in the repository's one scheme, a
GPU's series the same as the device plugin's, prepare/unprepare outcomes counted per claim through
the gRPC servicer, reservations read from the CDI directory, and /healthz and /readyz served on a
real socket (readiness follows the sockets, the kubelet's registration and the slice)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics_names import exported, plugin_registry
from test_prepare import NODE, Claims, _claim, _result, _state

from deviceplugin.health import DeviceState
from draplugin import cdi
from draplugin.api import dra_v1_pb2, dra_v1_pb2_grpc
from draplugin.metrics import PREPARE_OUTCOMES, UNPREPARE_OUTCOMES, Metrics, not_ready
from draplugin.service import Driver, servicer
from extender.state.gpu_gauges import render

MIB = 1 << 20


def _samples(m: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(render(m.registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(m: Metrics, name: str, **labels: str) -> float:
    (v,) = [v for ls, v in _samples(m)[name] if all(ls.get(k) == x for k, x in labels.items())]
    return v


@pytest.fixture
def wired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Driver, Claims, Metrics]:
    api = Claims()
    d = Driver(node=NODE, cdi_dir=str(tmp_path / "cdi"), state=_state(), kube=None)
    monkeypatch.setattr(d, "read_claim", api.read)
    counts = {"gpupack_draplugin_slice_publishes": 3, "gpupack_draplugin_slice_publish_errors": 1}
    m = Metrics(NODE, d.state, d.cdi_dir, counts=lambda: counts, ttl_s=0)
    d.observe = m.observe
    return d, api, m


def test_names_follow_the_repositorys_scheme(wired: tuple[Driver, Claims, Metrics]) -> None:
    names = exported(wired[2].registry)
    for name, kind in names.items():
        assert re.fullmatch(r"gpupack_(draplugin|gpu)_[a-z0-9_]+", name), name
        assert not re.search(r"_(mib|mb|percent|pct|ms|milli)(_|$)", name), name
        assert name.endswith("_total") == (kind == "counter"), name
    assert {
        "gpupack_draplugin_prepares_total", "gpupack_draplugin_unprepares_total",
        "gpupack_draplugin_prepared_claims", "gpupack_draplugin_slice_publishes_total",
        "gpupack_draplugin_slice_publish_errors_total", "gpupack_draplugin_kubelet_registrations_total",
        "gpupack_draplugin_prepare_seconds_bucket", "gpupack_gpu_healthy",
    } <= set(names)  # fmt: skip
    # a GPU is the same series in either mode: one dashboard reads the device plugin or this one
    gpu = {n: k for n, k in names.items() if n.startswith("gpupack_gpu_")}
    dp = {n: k for n, k in exported(plugin_registry()).items() if n.startswith("gpupack_gpu_")}
    assert gpu == dp
    s = _samples(wired[2])
    for name, series in s.items():
        if name.startswith("gpupack_gpu_"):
            assert {tuple(sorted(ls)) for ls, _ in series} == {("index", "model", "node", "uuid")}, name
    # every outcome is there from the start, at 0
    assert {ls["outcome"] for ls, v in s["gpupack_draplugin_prepares_total"] if v == 0} == set(
        PREPARE_OUTCOMES
    )
    assert {ls["outcome"] for ls, v in s["gpupack_draplugin_unprepares_total"]} == set(UNPREPARE_OUTCOMES)
    assert _value(wired[2], "gpupack_draplugin_slice_publishes_total") == 3
    assert _value(wired[2], "gpupack_draplugin_slice_publish_errors_total") == 1


def test_outcomes_counted_per_claim_and_reservations_read_from_the_cdi_dir(
    wired: tuple[Driver, Claims, Metrics],
) -> None:
    d, api, m = wired
    a, b, off, wrong, gone = (str(uuid.uuid4()) for _ in range(5))
    api.add(_claim(a, _result("gpu-0", memory="20Gi", sm="40"), name="a"), name="a")
    api.add(_claim(b, _result("gpu-0", memory="10Gi", sm="30"), name="b"), name="b")
    api.add(_claim(off, _result("gpu-0"), name="off", cls="gpupack-offline"), name="off")
    api.add(_claim(str(uuid.uuid4()), _result()), name="wrong")
    svc = servicer(dra_v1_pb2, dra_v1_pb2_grpc, "v1", d)
    resp = svc.NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(claims=[
            dra_v1_pb2.Claim(namespace="team", name="a", uid=a),
            dra_v1_pb2.Claim(namespace="team", name="b", uid=b),
            dra_v1_pb2.Claim(namespace="team", name="off", uid=off),  # gpu-0 holds online claims
            dra_v1_pb2.Claim(namespace="team", name="wrong", uid=wrong),  # UID mismatch
            dra_v1_pb2.Claim(namespace="team", name="gone", uid=gone),  # 404
            dra_v1_pb2.Claim(namespace="team", name="a", uid="../x"),  # not a UID
        ]), None)  # fmt: skip
    assert [resp.claims[u].error == "" for u in (a, b, off, wrong, gone)] == [True, True, False, False, False]
    prepares = {o: _value(m, "gpupack_draplugin_prepares_total", outcome=o) for o in PREPARE_OUTCOMES}
    assert prepares == {"prepared": 2, "refused": 3, "conflict": 1, "failed": 0}
    assert _value(m, "gpupack_draplugin_prepare_seconds_count") == 6
    gpu0, gpu1 = d.state.gpus()[0].uuid, d.state.gpus()[1].uuid
    assert _value(m, "gpupack_gpu_reserved_memory_bytes", uuid=gpu0) == 30 * 1024 * MIB
    assert _value(m, "gpupack_gpu_reserved_sm_ratio", uuid=gpu0) == pytest.approx(0.7)
    assert _value(m, "gpupack_gpu_reserved_memory_bytes", uuid=gpu1) == 0
    assert _value(m, "gpupack_draplugin_prepared_claims", **{"class": "online"}) == 2
    assert _value(m, "gpupack_draplugin_prepared_claims", **{"class": "offline"}) == 0
    # a spec file that is not one of ours is counted, not fatal to the scrape
    Path(d.cdi_dir, f"gpupack-{uuid.uuid4()}.json").write_text("{not json")
    assert _value(m, "gpupack_draplugin_unreadable_specs") == 1

    svc.NodeUnprepareResources(
        dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[
            dra_v1_pb2.Claim(namespace="team", name="a", uid=a),
            dra_v1_pb2.Claim(namespace="team", name="a", uid=a),  # again: nothing to undo
        ]), None)  # fmt: skip
    assert _value(m, "gpupack_draplugin_unprepares_total", outcome="unprepared") == 1
    assert _value(m, "gpupack_draplugin_unprepares_total", outcome="not_prepared") == 1
    assert _value(m, "gpupack_draplugin_prepared_claims", **{"class": "online"}) == 1
    assert _value(m, "gpupack_gpu_reserved_memory_bytes", uuid=gpu0) == 10 * 1024 * MIB


def test_a_failed_write_counts_as_failed(
    wired: tuple[Driver, Claims, Metrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, api, m = wired
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result()))

    def full(*_a: object, **_k: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cdi, "write", full)
    resp = servicer(dra_v1_pb2, dra_v1_pb2_grpc, "v1", d).NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace="team", name="c", uid=uid)]
        ),
        None,
    )
    assert "No space left" in resp.claims[uid].error
    assert _value(m, "gpupack_draplugin_prepares_total", outcome="failed") == 1


def test_gpu_health_is_exported(wired: tuple[Driver, Claims, Metrics]) -> None:
    d, _, m = wired
    g1 = d.state.gpus()[1]
    assert _value(m, "gpupack_gpu_healthy", uuid=g1.uuid) == 1
    d.state.mark_unhealthy(g1.uuid, "XID 79")
    assert _value(m, "gpupack_gpu_healthy", uuid=g1.uuid) == 0
    assert _value(m, "gpupack_gpu_healthy", uuid=d.state.gpus()[0].uuid) == 1


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_probes_and_metrics_served(tmp_path: Path) -> None:
    sockets = [tmp_path / "dra.sock", tmp_path / "reg.sock"]
    flags = {"stopping": False, "registered": False, "published": False}
    m = Metrics(NODE, DeviceState(_state().gpus()), tmp_path / "cdi")
    server = m.serve(0, "127.0.0.1", lambda: not_ready(
        lambda: flags["stopping"], sockets, lambda: flags["registered"], lambda: flags["published"]))  # fmt: skip
    try:
        assert _get(server.port, "/healthz") == (200, "ok\n")
        assert _get(server.port, "/readyz") == (503, f"socket {sockets[0]} not there\n")
        for s in sockets:
            s.touch()
        assert _get(server.port, "/readyz") == (503, "not registered with the kubelet yet\n")
        flags["registered"] = True
        assert _get(server.port, "/readyz") == (503, "ResourceSlice not published yet\n")
        flags["published"] = True
        assert _get(server.port, "/readyz") == (200, "ok\n")
        sockets[1].unlink()  # the kubelet cannot find the plugin any more
        assert _get(server.port, "/readyz")[0] == 503
        sockets[1].touch()
        flags["stopping"] = True
        assert _get(server.port, "/readyz") == (503, "stopping\n")
        status, text = _get(server.port, "/metrics")
        assert status == 200 and 'gpupack_draplugin_prepared_claims{class="online",node="node-a"} 0.0' in text
    finally:
        server.stop()


def test_the_guide_documents_every_series_and_flag_and_no_other(
    wired: tuple[Driver, Claims, Metrics],
) -> None:
    from draplugin.main import build_parser

    guide = (Path(__file__).resolve().parents[2] / "docs" / "dra.md").read_text()
    section = guide.split("## Metrics and probes", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(gpupack_[a-z0-9_]+)`", section))
    exported_names = {
        re.sub(r"_(bucket|sum|count)$", "", n) if k == "histogram" else n
        for n, k in exported(wired[2].registry).items()
    }
    assert documented == exported_names
    flags = guide.split("### `gpupack dra-plugin` flags", 1)[1].split("\n## ", 1)[0]
    in_table = set(re.findall(r"`(--[a-z0-9-]+)`", flags))
    have = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert in_table == have - {"--nvml-module", "--nvml-config"}  # the tests' fake NVML only
