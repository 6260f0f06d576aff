"""The DRA allocator's node-only option (a measurement: gpupack picks the node, kube-scheduler's
in-tree allocator the GPU): only a pin is written, never an allocation, and the devices it planned
stay booked until the scheduler has allocated the claim, so the next pod is not planned onto them."""

from __future__ import annotations

import copy
from typing import Any

from kubernetes import client

from draplugin.slices import resource_slice
from extender.controllers.dra.allocator import PIN_ANNOTATION
from extender.controllers.dra.claims import GATE
from extender.controllers.dra.controller import DraAllocator
from gpupack.contract import GPUInfo
from gpupack.core.policies import get_policy

CLASSES = {"gpupack-online": "online", "gpupack-offline": "offline"}


class _Pins:
    """Stands in for the API writes: records each ungate's pin; any allocation write fails the test
    (the Writer has no `allocate` here)."""

    def __init__(self) -> None:
        self.pins: dict[str, str | None] = {}

    def ungate(self, pod: dict[str, Any], pin: str | None = None) -> dict[str, Any]:
        self.pins[pod["metadata"]["name"]] = pin
        out = copy.deepcopy(pod)
        out["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1)
        out["spec"].pop("schedulingGates", None)
        if pin is not None:
            out["metadata"].setdefault("annotations", {})[PIN_ANNOTATION] = pin
        return out


def _claim(name: str, sm: str) -> dict[str, Any]:
    exactly = {"deviceClassName": "gpupack-online", "capacity": {"requests": {"memory": "10Gi", "sm": sm}}}
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"c-{name}", "resourceVersion": "1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}  # fmt: skip


def _pod(name: str, t: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "1",
                         "creationTimestamp": f"2026-01-01T00:00:0{t}Z"},
            "spec": {"schedulingGates": [{"name": GATE}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                     "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}}  # fmt: skip


def test_node_only_pins_without_allocating_and_books_the_planned_gpu_until_allocated() -> None:
    alloc = DraAllocator(client.ApiClient(), get_policy("bestfit"), CLASSES, node_only=True)
    pins = _Pins()
    alloc.writer = pins  # type: ignore[assignment]
    st = alloc.store
    st.nodes.put({"metadata": {"name": "n0", "resourceVersion": "1"},
                  "status": {"allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110"}}})  # fmt: skip
    gpu = GPUInfo(uuid="G0", index=0, model="A100", mem_mib=81920, sm_count=108)
    st.slices.put({**resource_slice("n0", [gpu]), "metadata": {"name": "n0-gpus", "resourceVersion": "1"}})
    for name, sm, t in (("a", "60", 1), ("b", "60", 2), ("c", "30", 3)):
        st.claims.put(_claim(name, sm))
        st.pods.put(_pod(name, t))

    alloc.one_pass()
    # a is pinned to the one node, its claim left unallocated; b (60 % beside a's planned 60 %)
    # must not be planned onto the same GPU: it stays gated with a reason; c (30 %) fits beside a
    assert pins.pins == {"a": "n0", "c": "n0"}
    assert all(not (c.get("status") or {}).get("allocation") for c in st.claims.values())
    assert alloc.retry["u-b"].reason
    assert set(alloc._planned) == {"u-a", "u-c"}

    # the scheduler allocates a's claim (on the same GPU): the booking is dropped, the real one counts
    done = _claim("a", "60")
    done["metadata"]["resourceVersion"] = "2"
    done["status"] = {"allocation": {"devices": {"results": [
        {"driver": "gpu.gpupack.io", "pool": "n0", "device": "gpu-0", "request": "gpu",
         "consumedCapacity": {"memory": "10Gi", "sm": "60"}}]}}}  # fmt: skip
    st.claims.put(done)
    snap = alloc.snapshot()
    assert set(alloc._planned) == {"u-c"}
    (dev,) = snap.devices["n0"]
    assert dev.sm_used == 90  # a's real 60 % + c's planned 30 %, nothing counted twice
