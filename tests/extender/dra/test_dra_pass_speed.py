"""The allocator's per-pass caches (parsed slices, claims, node facts) change no decision: a
sequence of gated pods gets the same node and GPUs whether all are placed in one pass, one pass per
arrival with warm caches, or one pass per arrival with every cache dropped (a full rebuild)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from kubernetes import client

from draplugin.slices import resource_slice
from extender.controllers.dra.claims import GATE
from extender.controllers.dra.controller import DraAllocator
from extender.controllers.dra.devices import slice_devices
from gpupack.contract import GPUInfo
from gpupack.core.policies import get_policy

CLASSES = {"gpupack-online": "online", "gpupack-offline": "offline"}
NODES, GPUS, PODS = 12, 4, 60


class _Writes:
    """Stands in for the API writes: answers as the API server would, records each allocation."""

    def __init__(self) -> None:
        self.rv = 100
        self.placed: list[tuple[str, str, list[str]]] = []

    def allocate(self, claim: dict[str, Any], results: list[dict[str, Any]], node: str, pod: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        self.rv += 1
        out = copy.deepcopy(claim)
        out["metadata"]["resourceVersion"] = str(self.rv)
        sel = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        }
        out["status"] = {"allocation": {"devices": {"results": results}, "nodeSelector": sel}}
        self.placed.append((pod["metadata"]["name"], node, [r["device"] for r in results]))
        return out

    def ungate(self, pod: dict[str, Any], pin: str | None = None) -> dict[str, Any]:
        self.rv += 1
        out = copy.deepcopy(pod)
        out["metadata"]["resourceVersion"] = str(self.rv)
        out["spec"].pop("schedulingGates", None)
        return out


def _claim(i: int) -> dict[str, Any]:
    cls = "gpupack-offline" if i % 5 == 0 else "gpupack-online"
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if i % 7 == 3:
        exactly["count"] = 2  # whole GPUs
    else:
        exactly["capacity"] = {"requests": {"memory": f"{4 + (i * 3) % 30}Gi", "sm": str(10 + (i * 13) % 60)}}
    return {"metadata": {"name": f"c{i}", "namespace": "ns", "uid": f"c-{i}", "resourceVersion": "1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}  # fmt: skip


def _pod(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"p{i:03d}", "namespace": "ns", "uid": f"u-{i}", "resourceVersion": "1",
                         "creationTimestamp": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z"},
            "spec": {"schedulingGates": [{"name": GATE}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": f"c{i}"}],
                     "containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}]}}  # fmt: skip


def _allocator() -> tuple[DraAllocator, _Writes]:
    alloc = DraAllocator(client.ApiClient(), get_policy("bestfit"), CLASSES)
    writes = _Writes()
    alloc.writer = writes  # type: ignore[assignment]
    for n in range(NODES):
        alloc.store.nodes.put({"metadata": {"name": f"n{n}", "resourceVersion": "1"},
                               "status": {"allocatable": {"cpu": "16", "memory": "256Gi", "pods": "110"}}})  # fmt: skip
        gpus = [
            GPUInfo(uuid=f"G{n}-{j}", index=j, model="A100", mem_mib=81920, sm_count=108) for j in range(GPUS)
        ]
        alloc.store.slices.put({**resource_slice(f"n{n}", gpus), "metadata": {"name": f"s{n}", "uid": f"s{n}", "resourceVersion": "1"}})  # fmt: skip
    return alloc, writes


def _arrive(alloc: DraAllocator, i: int) -> None:
    alloc.store.claims.put(_claim(i))
    alloc.store.pods.put(_pod(i))


def test_cached_passes_place_every_pod_as_a_full_rebuild_per_pod_does() -> None:
    one_pass, w1 = _allocator()
    for i in range(PODS):
        _arrive(one_pass, i)
    one_pass.one_pass()

    warm, w2 = _allocator()
    for i in range(PODS):
        _arrive(warm, i)
        warm.one_pass()

    cold, w3 = _allocator()
    for i in range(PODS):
        _arrive(cold, i)
        cold._slice_cache, cold._parsed_cache, cold._facts_cache, cold._needs_cache = {}, {}, {}, {}
        cold.one_pass()

    assert len(w3.placed) > PODS // 2  # the sequence places many pods (some may not fit: CPU)
    assert w1.placed == w2.placed == w3.placed
    # a pod refused in the cold run (no room) is refused in the others too
    assert set(one_pass.retry) == set(warm.retry) == set(cold.retry)


def test_a_pass_copy_of_a_device_is_the_parsed_device_uncharged() -> None:
    gpus = [GPUInfo(uuid=f"G{j}", index=j, model="A100", mem_mib=81920, sm_count=108) for j in range(2)]
    s = {**resource_slice("n0", gpus), "metadata": {"name": "s", "uid": "s", "resourceVersion": "1"}}
    cache: dict[tuple[str, str], Any] = {}
    first = slice_devices([s], None, cache)
    again = slice_devices([s], cache)
    assert again == first == {"n0": [replace(d, holders={}) for d in cache[("s", "1")]]}
    again["n0"][0].holders["x"] = (1, 1)
    again["n0"][0].sm_used = 5
    assert slice_devices([s], cache) == first  # charging a pass's copy leaves the cache untouched


def test_a_device_becomes_the_cores_gpu_field_by_field() -> None:
    from decimal import Decimal

    from extender.controllers.dra.devices import Device
    from extender.controllers.dra.placement import _gpu
    from gpupack.core.model import GPU

    d = Device("n0", "gpu-1", 1, "A100", 81920, False, "", Decimal(1), Decimal(0), 90000, 30, True, "offline", {"a": (9, 3)})  # fmt: skip
    g = _gpu(d)
    want = GPU(uuid="gpu-1", index=1, model="A100", mem_mib=81920, healthy=False, mem_used=81920,
               milli_used=300, pod_class="offline", exclusive=True, holders={"a": (9, 3)})  # fmt: skip
    assert g == want and g.holders is not d.holders
