"""Device plugin parts that need neither a kubelet nor the Kubernetes API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_nvml import FakeConfigError, FakeNvml
from google.protobuf import descriptor_pb2

from deviceplugin.api import api_pb2, api_pb2_grpc, podresources_pb2
from deviceplugin.api.generate import proto_descriptor
from deviceplugin.discovery import NvmlUnavailable, discover, init_nvml
from deviceplugin.health import DeviceState, HealthWatcher
from deviceplugin.publish import model_label, node_patch
from deviceplugin.server import list_response
from gpupack import contract

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`gpupack device-plugin` as a process, over the fake NVML of this folder."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "gpupack", "device-plugin", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60, env=env)  # fmt: skip


def test_committed_stubs_match_the_proto():
    committed = descriptor_pb2.FileDescriptorProto.FromString(api_pb2.DESCRIPTOR.serialized_pb)
    fresh = descriptor_pb2.FileDescriptorProto.FromString(proto_descriptor())
    assert committed == fresh, "deviceplugin/api stubs are stale: run python -m deviceplugin.api.generate"
    grpc_src = (REPO / "deviceplugin" / "api" / "api_pb2_grpc.py").read_text()
    for svc in fresh.service:
        for m in svc.method:
            assert f"/v1beta1.{svc.name}/{m.name}" in grpc_src


def test_committed_podresources_stubs_match_the_proto_and_upstream_wire_names():
    """proto/podresources.proto is k8s.io/kubelet/pkg/apis/podresources/v1/api.proto on the wire:
    package v1, service PodResourcesLister, and the field numbers PreStartContainer reads."""
    committed = descriptor_pb2.FileDescriptorProto.FromString(podresources_pb2.DESCRIPTOR.serialized_pb)
    fresh = descriptor_pb2.FileDescriptorProto.FromString(proto_descriptor("podresources"))
    assert committed == fresh, "deviceplugin/api stubs are stale: run python -m deviceplugin.api.generate"
    grpc_src = (REPO / "deviceplugin" / "api" / "podresources_pb2_grpc.py").read_text()
    for m in ("List", "GetAllocatableResources", "Get"):
        assert f"/v1.PodResourcesLister/{m}" in grpc_src
    fields = {(m.name, f.name): f.number for m in fresh.message_type for f in m.field}
    assert fields[("ListPodResourcesResponse", "pod_resources")] == 1
    assert fields[("PodResources", "name")] == 1 and fields[("PodResources", "namespace")] == 2
    assert fields[("PodResources", "containers")] == 3
    assert fields[("ContainerResources", "name")] == 1 and fields[("ContainerResources", "devices")] == 2
    assert (
        fields[("ContainerDevices", "resource_name")] == 1 and fields[("ContainerDevices", "device_ids")] == 2
    )


# Field numbers of k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto: the wire contract.
UPSTREAM_FIELDS = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5},
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}


def test_wire_compatible_with_the_kubelet_api():
    d = api_pb2.DESCRIPTOR
    assert d.package == "v1beta1"
    for msg, fields in UPSTREAM_FIELDS.items():
        got = {f.name: f.number for f in d.message_types_by_name[msg].fields}
        assert got == fields, msg
    assert [m.name for m in d.services_by_name["Registration"].methods] == ["Register"]
    assert [m.name for m in d.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert (
        d.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].output_type.name
        == "ListAndWatchResponse"
    )
    assert hasattr(api_pb2_grpc, "RegistrationStub") and hasattr(api_pb2_grpc, "DevicePluginServicer")


def _found(cfg):
    nvml = FakeNvml(cfg)
    init_nvml(nvml)
    return nvml, discover(nvml)


def test_discovery_reports_every_field():
    _, d = _found({"gpus": 8, "numa_nodes": 2})
    assert len(d.gpus) == 8 and not d.skipped
    g = d.gpus[5]
    assert (g.index, g.model, g.mem_mib, g.sm_count, g.numa_node) == (5, "NVIDIA H200", 143771, 132, 1)
    assert g.uuid.startswith("GPU-") and g.pci_bus_id.startswith("00000000:")
    # The same config names the same GPUs after a restart (assignments refer to UUIDs).
    assert [x.uuid for x in _found({"gpus": 8})[1].gpus] == [x.uuid for x in d.gpus]


def test_mig_gpu_and_failing_gpu_are_skipped_with_reasons():
    _, d = _found({"gpus": 4, "mig": [1], "faults": {"errors": {2: {"sm_count": "NotSupported"}}}})
    assert [g.index for g in d.gpus] == [0, 3]
    assert len(d.skipped) == 2
    assert "MIG mode is enabled" in d.skipped[0]
    assert "NVMLError_NotSupported" in d.skipped[1] and "index 2" in d.skipped[1]


def test_no_driver_is_one_clear_error():
    with pytest.raises(NvmlUnavailable, match="DriverNotLoaded.*NVIDIA driver installed"):
        init_nvml(FakeNvml({"faults": {"init": "DriverNotLoaded"}}))
    with pytest.raises(FakeConfigError, match="unknown NVML error"):
        FakeNvml({"faults": {"init": "NoSuchError"}})


def test_cli_without_driver_prints_one_line_and_exits_nonzero(tmp_path):
    cfg = tmp_path / "nodriver.yaml"
    cfg.write_text("gpus: 2\nfaults:\n  init: DriverNotLoaded\n")
    r = cli("--discover", "--nvml-module", "fake_nvml", "--nvml-config", str(cfg))
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "NVML is not available" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_discover_table_and_json(tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("gpus: 3\nmodel: NVIDIA H100 80GB HBM3\nmemory_mib: 81559\nsm_count: 132\nmig: [2]\n")
    r = cli("--discover", "--nvml-module", "fake_nvml", "--nvml-config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "NVIDIA H100 80GB HBM3" in r.stdout and "81559" in r.stdout and "skipped:" in r.stdout
    r = cli("--discover", "--json", "--nvml-module", "fake_nvml", "--nvml-config", '{"gpus": 3, "mig": [2]}')
    import json

    out = json.loads(r.stdout)
    assert [g["index"] for g in out["gpus"]] == [0, 1] and len(out["skipped"]) == 1


def _watch(nvml, probe_s=0.1):
    _, d = None, discover(nvml)
    state = DeviceState(d.gpus)
    w = HealthWatcher(nvml, state, probe_interval_s=probe_s, wait_s=0.05)
    w.start()
    return state, w


def _until(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.slow
def test_cli_nvml_module_errors_are_one_line():
    for args, msg in (
        (("--nvml-module", "no_such_module"), "--nvml-module no_such_module: No module named"),
        (("--nvml-module", "json"), "has no make_nvml(config) function"),
        (("--nvml-module", "fake_nvml", "--nvml-config", "gpus: [oops"), "fake NVML config"),
        (("--nvml-config", "x"), "--nvml-config needs --nvml-module"),
    ):
        r = cli("--discover", *args)
        assert r.returncode == 1 and msg in r.stderr, (args, r.stderr)
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_fake_nvml_is_not_in_the_product_package():
    assert not (REPO / "deviceplugin" / "fake_nvml.py").exists()
    r = cli("--discover", "--help")
    assert "--fake" not in r.stdout


def test_xids_mark_unhealthy_except_application_errors():
    nvml = FakeNvml({"gpus": 3})
    init_nvml(nvml)
    state, w = _watch(nvml)
    try:
        for xid in (13, 31, 43, 45, 68, 109):
            nvml.inject_xid(0, xid)
        nvml.inject_xid(1, 79)
        assert _until(lambda: not state.health_map()[nvml.uuid(1)])
        time.sleep(0.3)  # the application XIDs were delivered before 79, and ignored
        h = state.health_map()
        assert h[nvml.uuid(0)] and h[nvml.uuid(2)]
        assert state.gpus()[1].unhealthy_reason == "XID 79"
    finally:
        w.stop()


def test_gpu_falling_off_the_bus_is_reported_not_crashed_on():
    nvml = FakeNvml(
        {
            "gpus": 2,
            "faults": {"lost": [{"gpu": 1, "after_s": 0.2}], "xids": [{"gpu": 0, "xid": 48, "after_s": 0.1}]},
        }
    )
    init_nvml(nvml)
    state, w = _watch(nvml)
    try:
        assert _until(lambda: not any(state.health_map().values()))
        reasons = {g.index: g.unhealthy_reason for g in state.gpus()}
        assert reasons == {0: "XID 48", 1: "GPU is lost (fell off the bus)"}
        assert w._thread is not None and w._thread.is_alive()
    finally:
        w.stop()


def test_listandwatch_for_8_h200_is_a_few_kib():
    nvml = FakeNvml({"gpus": 8, "numa_nodes": 2})
    init_nvml(nvml)
    state = DeviceState(discover(nvml).gpus)
    msg = list_response(state)
    assert len(msg.devices) == 8 * contract.SLOTS_PER_GPU
    assert msg.ByteSize() < 8 * 1024
    assert {d.topology.nodes[0].ID for d in msg.devices} == {0, 1}
    assert all(len(d.ID) <= 63 for d in msg.devices)  # kubelet's limit on device IDs


def test_inventory_labels_and_annotation_round_trip():
    nvml = FakeNvml({"gpus": 2, "model": "NVIDIA H100 80GB HBM3"})
    init_nvml(nvml)
    state = DeviceState(discover(nvml).gpus, ("GPU-x: MIG",))
    labels, ann = node_patch(state, "hami-core")
    assert labels == {
        contract.LABEL_GPU_NODE: "true",
        contract.LABEL_GPU_MODEL: "NVIDIA-H100-80GB-HBM3",
        contract.LABEL_GPU_COUNT: "2",
    }
    inv = contract.decode_inventory(ann[contract.ANN_INVENTORY], "n")
    assert [g.mem_mib for g in inv.gpus] == [143771, 143771] and inv.skipped == ("GPU-x: MIG",)
    assert model_label("  weird/model name!! ") == "weird-model-name"


def test_example_fake_config_loads_and_describes_an_8_x_h200_node():
    nvml = FakeNvml.from_file(HERE / "fake-node.example.yaml")
    init_nvml(nvml)
    d = discover(nvml)
    assert len(d.gpus) == 8 and {g.mem_mib for g in d.gpus} == {143771}


def test_reservations_count_init_containers_as_running_alone():
    from deviceplugin.metrics import reserved_by_gpu
    from gpupack.contract import ANN_ASSIGNMENT, Assignment, GPUShare

    def pod(uid, phase="Running", node="n"):
        a = Assignment(
            uid,
            node,
            "online",
            {
                "init": (GPUShare("G0", 0, 9000, 50),),
                "a": (GPUShare("G0", 0, 3000, 20),),
                "b": (GPUShare("G0", 0, 4000, 20), GPUShare("G1", 1, 4000, 20)),
            },
        )
        return {
            "metadata": {
                "uid": uid,
                "name": uid,
                "namespace": "d",
                "annotations": {ANN_ASSIGNMENT: a.to_json()},
            },
            "spec": {
                "nodeName": node,
                "initContainers": [{"name": "init"}],
                "containers": [{"name": "a"}, {"name": "b"}],
            },
            "status": {"phase": phase},
        }

    got = reserved_by_gpu([pod("1"), pod("2", phase="Succeeded"), pod("3", node="other")], "n")
    assert got == {"G0": (9000, 50), "G1": (4000, 20)}


def test_real_nvml_discovery_or_one_clear_error_without_a_driver():
    from deviceplugin.nvml_facade import PynvmlFacade

    nvml = PynvmlFacade()
    try:
        nvml.init()
    except Exception:
        with pytest.raises(NvmlUnavailable, match="NVML is not available: NVMLError_"):
            init_nvml(PynvmlFacade())
        return
    # A real driver: discovery must describe every GPU it offers completely.
    try:
        d = discover(nvml)
        for g in d.gpus:
            assert g.uuid.startswith(("GPU-", "MIG-")) and g.mem_mib > 0 and g.sm_count > 0 and g.model
            assert g.pci_bus_id
        assert len(d.gpus) + len(d.skipped) == nvml.device_count()
    finally:
        nvml.shutdown()
