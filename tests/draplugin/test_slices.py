"""The ResourceSlice body (draplugin/slices.py): its fixed shape, health, and names."""

from __future__ import annotations

import copy

from draplugin import slices
from gpupack.contract import GPUInfo


def _gpu(i: int, **kw: object) -> GPUInfo:
    base: dict[str, object] = {
        "uuid": f"GPU-{i:04d}", "index": i, "model": "NVIDIA H200", "mem_mib": 143771, "sm_count": 132,
        "numa_node": i // 4, "pci_bus_id": f"00000000:{i:02x}:00.0",
    }  # fmt: skip
    base.update(kw)
    return GPUInfo(**base)  # type: ignore[arg-type]


def test_one_device_per_gpu_with_attributes_and_capacities() -> None:
    body = slices.resource_slice(
        "node-a", [_gpu(1), _gpu(0)], generation=3, node_uid="u-1", driver_version="550.54.15"
    )
    spec = body["spec"]
    assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "ResourceSlice"
    assert body["metadata"]["name"] == "node-a-gpu.gpupack.io"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "u-1"}
    ]
    assert spec["driver"] == "gpu.gpupack.io" and spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    d = spec["devices"][1]
    assert d["allowMultipleAllocations"] is True
    assert d["attributes"]["uuid"] == {"string": "GPU-0001"}
    assert d["attributes"]["model"] == {"string": "NVIDIA H200"}
    assert d["attributes"]["index"] == {"int": 1}
    assert d["attributes"]["smCount"] == {"int": 132}
    assert d["attributes"]["numaNode"] == {"int": 0}
    assert d["attributes"]["driverVersion"] == {"string": "550.54.15"}
    assert d["attributes"]["healthy"] == {"bool": True}
    assert d["capacity"]["memory"] == {
        "value": "143771Mi",
        "requestPolicy": {"default": "143771Mi", "validRange": {"min": "1Mi", "step": "1Mi"}},
    }
    assert d["capacity"]["sm"] == {
        "value": "100",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }
    assert "taints" not in d


def test_unhealthy_gpu_is_tainted_and_marked() -> None:
    d = slices.resource_slice("n", [_gpu(0, healthy=False, unhealthy_reason="XID 79")])["spec"]["devices"][0]
    assert d["attributes"]["healthy"] == {"bool": False}
    assert d["taints"] == [{"key": "gpu.gpupack.io/unhealthy", "value": "true", "effect": "NoSchedule"}]


def test_long_names_stay_within_the_api_limits() -> None:
    node = "n" * 253
    body = slices.resource_slice(node, [_gpu(0, model="M" * 300, uuid="GPU-" + "u" * 300)])
    assert len(body["metadata"]["name"]) <= 253
    attrs = body["spec"]["devices"][0]["attributes"]
    assert len(attrs["model"]["string"]) <= 64 and len(attrs["uuid"]["string"]) <= 64


def test_devices_equal_decides_a_generation_bump() -> None:
    a = slices.resource_slice("n", [_gpu(0)], generation=1)
    b = slices.resource_slice("n", [_gpu(0)], generation=2)
    c = slices.resource_slice("n", [_gpu(0, healthy=False)], generation=1)
    assert slices.devices_equal(a, b)
    assert not slices.devices_equal(a, c)


def test_holds_attribute_names_the_class_a_gpu_holds() -> None:
    body = slices.resource_slice(
        "n", [_gpu(0), _gpu(1), _gpu(2)], holds={"gpu-0": "online", "gpu-2": "bogus"}
    )
    holds = [d["attributes"]["holds"] for d in body["spec"]["devices"]]
    assert holds == [{"string": "online"}, {"string": ""}, {"string": "mixed"}]


def test_cdi_holds_from_the_prepared_claims(tmp_path) -> None:
    from draplugin import cdi

    def claim(uid: str, cls: str, device: str) -> cdi.PreparedClaim:
        return cdi.PreparedClaim(
            uid, "ns", "c", cls, (cdi.PreparedDevice("gpu", "n", device, "GPU-x", 1, 0, "", {"A": "1"}),)
        )

    cdi.write(tmp_path, claim("00000000-0000-0000-0000-000000000001", "online", "gpu-0"))
    cdi.write(tmp_path, claim("00000000-0000-0000-0000-000000000002", "online", "gpu-0"))
    cdi.write(tmp_path, claim("00000000-0000-0000-0000-000000000003", "offline", "gpu-1"))
    cdi.write(tmp_path, claim("00000000-0000-0000-0000-000000000004", "online", "gpu-1"))
    assert cdi.holds(tmp_path) == {"gpu-0": "online", "gpu-1": "mixed"}


def test_the_servers_canonical_quantities_are_the_same_devices() -> None:
    """The API server writes 81920Mi back as 80Gi and adds a taint's timeAdded: not a change (else
    every sync would bump the pool's generation)."""
    from draplugin.publish import published_devices

    ours = slices.resource_slice("n", [_gpu(0, mem_mib=81920, healthy=False)])
    server = copy.deepcopy(ours)
    dev = server["spec"]["devices"][0]
    dev["capacity"]["memory"]["value"] = "80Gi"
    dev["capacity"]["memory"]["requestPolicy"]["default"] = "80Gi"
    dev["taints"][0]["timeAdded"] = "2026-12-07T21:09:57Z"
    assert published_devices(server) == published_devices(ours)
    dev["capacity"]["memory"]["value"] = "40Gi"
    assert published_devices(server) != published_devices(ours)
