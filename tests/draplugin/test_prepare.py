"""NodePrepareResources / NodeUnprepareResources without a cluster: the CDI spec files (atomic,
idempotent, named by claim UID only), hostile claims (clamped capacities, wrong UID, no
allocation, foreign pools and devices), per-claim error isolation through the gRPC servicer, and
the online / offline exclusion on one GPU."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeNvml

from deviceplugin.discovery import discover
from deviceplugin.health import DeviceState
from draplugin import cdi, claims
from draplugin.api import dra_v1_pb2, dra_v1_pb2_grpc
from draplugin.service import Driver, servicer
from gpupack import kubeclient

NODE = "node-a"
MEM = 81920


def _state(n: int = 2) -> DeviceState:
    nvml = FakeNvml({"gpus": n, "memory_mib": MEM, "sm_count": 108})
    nvml.init()
    found = discover(nvml)
    return DeviceState(found.gpus)


def _claim(
    uid: str, *results: dict[str, Any], name: str = "c", cls: str = "gpupack-online"
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": cls}}]}},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def _result(
    device: str = "gpu-0", memory: str | None = "20Gi", sm: str | None = "40", **kw: Any
) -> dict[str, Any]:
    cc = {k: v for k, v in (("memory", memory), ("sm", sm)) if v is not None}
    r = {"request": "gpu", "driver": "gpu.gpupack.io", "pool": NODE, "device": device, "consumedCapacity": cc,
         "shareID": str(uuid.uuid4())}  # fmt: skip
    r.update(kw)
    return r


class Claims:
    """The API server as far as prepare reads it: claims by namespace/name, or an error."""

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str], dict[str, Any] | Exception] = {}

    def add(self, obj: dict[str, Any] | Exception, ns: str = "team", name: str = "c") -> None:
        self.objs[(ns, name)] = obj

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        o = self.objs.get((namespace, name))
        if o is None:
            raise kubeclient.ApiException(status=404, reason="Not Found")
        if isinstance(o, Exception):
            raise o
        return o


@pytest.fixture
def drv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Driver, Claims]:
    api = Claims()
    d = Driver(node=NODE, cdi_dir=str(tmp_path / "cdi"), state=_state(), kube=None)
    monkeypatch.setattr(d, "read_claim", api.read)
    return d, api


def _files(d: Driver) -> list[str]:
    return sorted(os.listdir(d.cdi_dir)) if os.path.isdir(d.cdi_dir) else []


def test_share_prepared_as_one_cdi_device_with_limits(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result()))
    p = d.prepare_one("team", "c", uid)
    assert p.cdi_ids() == [f"gpu.gpupack.io/gpu={uid}-gpu-0"]
    assert _files(d) == [f"gpupack-{uid}.json"]
    doc = json.loads(Path(d.cdi_dir, f"gpupack-{uid}.json").read_text())
    assert doc["cdiVersion"] == "0.6.0" and doc["kind"] == "gpu.gpupack.io/gpu"
    (dev,) = doc["devices"]
    assert dev["name"] == f"{uid}-gpu-0"
    env = dict(e.split("=", 1) for e in dev["containerEdits"]["env"])
    gpu0 = d.state.gpus()[0]
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu0.uuid
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "40"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"


def test_whole_gpu_gets_no_limits_and_memory_only_share_no_sm_limit(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    whole, mem_only = str(uuid.uuid4()), str(uuid.uuid4())
    api.add(_claim(whole, _result("gpu-1", memory=f"{MEM}Mi", sm="0")), name="w")
    api.add(_claim(mem_only, _result("gpu-0", memory="10Gi", sm="0")), name="m")
    w = d.prepare_one("team", "w", whole)
    assert w.devices[0].env["NVIDIA_VISIBLE_DEVICES"] == d.state.gpus()[1].uuid
    assert not any(k.startswith("CUDA_") for k in w.devices[0].env)
    m = d.prepare_one("team", "m", mem_only)
    assert m.devices[0].env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
    assert m.devices[0].env["CUDA_DEVICE_SM_LIMIT"] == "100"  # no SM share asked: not limited


def test_prepare_twice_is_idempotent_and_unprepare_removes(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result()))
    first = d.prepare_one("team", "c", uid)
    path = Path(d.cdi_dir, f"gpupack-{uid}.json")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    again = d.prepare_one("team", "c", uid)
    assert again.cdi_ids() == first.cdi_ids()
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before  # not even rewritten
    assert _files(d) == [path.name]
    assert d.unprepare_one(uid) is True
    assert _files(d) == []
    assert d.unprepare_one(uid) is False  # unknown claim: success, nothing to do
    assert d.unprepare_one(str(uuid.uuid4())) is False


def test_write_is_atomic_a_failed_rename_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = str(uuid.uuid4())
    claim = cdi.PreparedClaim(
        uid, "ns", "n", "online", (cdi.PreparedDevice("gpu", NODE, "gpu-0", "GPU-x", 1, 0, "", {"A": "1"}),)
    )
    old = cdi.write(tmp_path, claim)
    old_bytes = old.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    changed = cdi.PreparedClaim(
        uid, "ns", "n", "online", (cdi.PreparedDevice("gpu", NODE, "gpu-0", "GPU-x", 2, 0, "", {"A": "2"}),)
    )
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        cdi.write(tmp_path, changed)
    assert sorted(os.listdir(tmp_path)) == [old.name]  # no temporary file left behind
    assert old.read_bytes() == old_bytes  # the old spec, whole
    # what the plugin reads back after a restart is what it wrote
    (back,), bad = cdi.prepared(tmp_path)
    assert back == claim and bad == []


@pytest.mark.parametrize(
    ("memory", "sm", "want_mem", "want_sm"),
    [
        ("10Ti", "500", MEM, 100),
        ("1", "-5", 1, 0),
        ("20Gi", "40.5", 20480, 41),
        (None, None, MEM, 0),
        # a huge exponent is clamped as a decimal, in no time (never a million-digit integer)
        ("1e999999", "1e999999", MEM, 100),
        ("-5Gi", "-1e999999", 1, 0),
    ],
)
def test_consumed_capacity_is_clamped_to_the_gpu(
    drv: tuple[Driver, Claims], memory: str | None, sm: str | None, want_mem: int, want_sm: int
) -> None:
    d, api = drv
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result(memory=memory, sm=sm)))
    (dev,) = d.prepare_one("team", "c", uid).devices
    assert (dev.mem_mib, dev.sm_pct) == (want_mem, want_sm)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["metadata"].update(uid=str(uuid.uuid4())), "has UID"),
        (lambda c: c.pop("status"), "is not allocated"),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="other-node"),
            "not this node",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-9"),
            "is not a GPU of node",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="../../etc/passwd"),
            "is not a GPU",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
                memory="lots"
            ),
            "not a quantity",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
                memory="1e999999Gi"
            ),
            "not a quantity",
        ),
        (lambda c: c["status"]["allocation"]["devices"]["results"].extend([_result()] * 40), "at most 32"),
    ],
)
def test_hostile_claims_fail_alone_and_write_nothing(
    drv: tuple[Driver, Claims], mutate: Any, message: str
) -> None:
    d, api = drv
    uid = str(uuid.uuid4())
    c = _claim(uid, _result())
    mutate(c)
    api.add(c)
    with pytest.raises(claims.ClaimError, match=message):
        d.prepare_one("team", "c", uid)
    assert _files(d) == []


def test_file_names_come_from_the_uid_only(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    long_name = "n" * 253
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result(request="r" * 5000), name=long_name), name=long_name)
    p = d.prepare_one("team", long_name, uid)
    assert _files(d) == [f"gpupack-{uid}.json"] and len(p.devices[0].request) <= 253
    for bad in ("../../../tmp/x", "a" * 300, "", "12345678-1234-1234-1234-1234567890ab/../x"):
        with pytest.raises(cdi.BadUID):
            d.prepare_one("team", "c", bad)
    assert _files(d) == [f"gpupack-{uid}.json"]


def test_one_bad_claim_does_not_fail_the_others_in_a_request(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    good, wrong_uid, gone, broken, traversal = (str(uuid.uuid4()) for _ in range(5))
    api.add(_claim(good, _result()), name="good")
    api.add(_claim(str(uuid.uuid4()), _result()), name="wrong")
    api.add(RuntimeError("surprise"), name="broken")
    svc = servicer(dra_v1_pb2, dra_v1_pb2_grpc, "v1", d)
    req = dra_v1_pb2.NodePrepareResourcesRequest(claims=[
        dra_v1_pb2.Claim(namespace="team", name="wrong", uid=wrong_uid),
        dra_v1_pb2.Claim(namespace="team", name="gone", uid=gone),
        dra_v1_pb2.Claim(namespace="team", name="broken", uid=broken),
        dra_v1_pb2.Claim(namespace="team", name="good", uid=traversal[:8] + "/../../x"),
        dra_v1_pb2.Claim(namespace="team", name="good", uid=good),
    ])  # fmt: skip
    resp = svc.NodePrepareResources(req, None)
    assert resp.claims[good].error == ""
    assert [x.cdi_device_ids[0] for x in resp.claims[good].devices] == [f"gpu.gpupack.io/gpu={good}-gpu-0"]
    assert resp.claims[good].devices[0].share_id
    assert "has UID" in resp.claims[wrong_uid].error
    assert "404" in resp.claims[gone].error
    assert "internal error: RuntimeError: surprise" in resp.claims[broken].error
    assert "is not a UID" in resp.claims[traversal[:8] + "/../../x"].error
    assert _files(d) == [f"gpupack-{good}.json"]
    un = svc.NodeUnprepareResources(
        dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[
            dra_v1_pb2.Claim(namespace="team", name="good", uid=good),
            dra_v1_pb2.Claim(namespace="team", name="x", uid="../x"),
            dra_v1_pb2.Claim(namespace="team", name="gone", uid=gone),
        ]), None)  # fmt: skip
    assert [un.claims[u].error for u in (good, "../x", gone)] == ["", "", ""]
    assert _files(d) == []


def test_online_and_offline_never_prepared_on_one_gpu(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    on, off, off2 = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    api.add(_claim(on, _result("gpu-0"), name="on"), name="on")
    api.add(_claim(off, _result("gpu-0"), name="off", cls="gpupack-offline"), name="off")
    api.add(_claim(off2, _result("gpu-1"), name="off2", cls="gpupack-offline"), name="off2")
    d.prepare_one("team", "on", on)
    with pytest.raises(claims.ClaimError, match="holds online claim team/on"):
        d.prepare_one("team", "off", off)
    assert d.prepare_one("team", "off2", off2).pod_class == "offline"  # another GPU: fine
    d.unprepare_one(on)
    assert d.prepare_one("team", "off", off).pod_class == "offline"  # the GPU is free of online now


def test_unhealthy_gpu_is_not_prepared(drv: tuple[Driver, Claims]) -> None:
    d, api = drv
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result("gpu-1")))
    d.state.mark_unhealthy(d.state.gpus()[1].uuid, "XID 79")
    with pytest.raises(claims.ClaimError, match="unhealthy"):
        d.prepare_one("team", "c", uid)


def test_v1beta1_service_answers_as_v1_and_changes_are_announced(drv: tuple[Driver, Claims]) -> None:
    from draplugin.api import dra_v1beta1_pb2, dra_v1beta1_pb2_grpc

    d, api = drv
    changes: list[int] = []
    d.on_change = lambda: changes.append(1)
    uid = str(uuid.uuid4())
    api.add(_claim(uid, _result("gpu-1")))
    svc = servicer(dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, "v1beta1", d)
    claim = dra_v1beta1_pb2.Claim(namespace="team", name="c", uid=uid)
    resp = svc.NodePrepareResources(dra_v1beta1_pb2.NodePrepareResourcesRequest(claims=[claim]), None)
    assert [x.cdi_device_ids[0] for x in resp.claims[uid].devices] == [f"gpu.gpupack.io/gpu={uid}-gpu-1"]
    assert cdi.holds(d.cdi_dir) == {"gpu-1": "online"} and changes == [1]
    svc.NodeUnprepareResources(dra_v1beta1_pb2.NodeUnprepareResourcesRequest(claims=[claim]), None)
    assert cdi.holds(d.cdi_dir) == {} and changes == [1, 1]


def test_health_stream_reports_every_gpu_and_a_change() -> None:
    from draplugin.api import dra_health_v1alpha1_pb2 as pb
    from draplugin.service import Health

    d = Driver(node=NODE, cdi_dir="/nonexistent", state=_state(), kube=None)

    class Ctx:
        def is_active(self) -> bool:
            return True

    stream = Health(d).NodeWatchResources(pb.NodeWatchResourcesRequest(), Ctx())
    first = next(stream)
    assert [(x.device.pool_name, x.device.device_name, x.health) for x in first.devices] == [
        (NODE, "gpu-0", pb.HEALTHY),
        (NODE, "gpu-1", pb.HEALTHY),
    ]
    d.state.mark_unhealthy(d.state.gpus()[1].uuid, "XID 79")
    second = next(stream)
    assert [x.health for x in second.devices] == [pb.HEALTHY, pb.UNHEALTHY]


def test_racing_prepares_of_both_classes_never_both_pass(drv: tuple[Driver, Claims]) -> None:
    """The check and the write are one step: of an online and an offline claim prepared at the same
    moment on one GPU, exactly one is prepared, however the threads interleave."""
    import threading

    d, api = drv
    for round_ in range(20):
        on, off = str(uuid.uuid4()), str(uuid.uuid4())
        api.add(_claim(on, _result("gpu-0"), name=f"on{round_}"), name=f"on{round_}")
        api.add(
            _claim(off, _result("gpu-0"), name=f"off{round_}", cls="gpupack-offline"), name=f"off{round_}"
        )
        start = threading.Barrier(2)
        ok: list[str] = []

        def prep(name: str, uid: str, start: threading.Barrier = start, ok: list[str] = ok) -> None:
            start.wait()
            try:
                d.prepare_one("team", name, uid)
                ok.append(uid)
            except claims.ClaimError:
                pass

        threads = [
            threading.Thread(target=prep, args=a) for a in ((f"on{round_}", on), (f"off{round_}", off))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(ok) == 1
        d.unprepare_one(ok[0])
    assert _files(d) == []
