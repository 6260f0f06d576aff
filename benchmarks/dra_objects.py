"""The DRA objects the benchmarks build (resource.k8s.io/v1, driver gpu.gpupack.io), and the check
that no device is filled past its capacity: pure, no I/O.

- a node's GPUs: the ResourceSlice `gpupack dra-plugin` publishes (draplugin/slices.py): one device
  per GPU, capacities `memory` (MiB; default the whole memory) and `sm` (percent, 100; default 0),
  `allowMultipleAllocations: true`;
- the DeviceClass `gpu.gpupack.io`: every device of that driver;
- a claim for a share (`capacity.requests`: memory and/or sm) or for N whole GPUs (count N, no
  capacity asked: each device's defaults, i.e. its whole memory, so nothing else fits beside it).

What the allocator wrote is read back from the claims' `status.allocation.devices.results`
(`consumedCapacity` per device); `capacity_overfills` sums it per device over all claims and
compares with the slice: the one invariant consumable capacity must keep.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from draplugin.slices import DRIVER, resource_slice  # what a node running `gpupack dra-plugin` publishes
from gpupack.contract import GPUInfo
from gpupack.core.model import FULL

API = "resource.k8s.io/v1"
DEVICE_CLASS = DRIVER
REQUEST = "gpu"  # the one request name of every claim here


class CapacityExceeded(AssertionError):
    """Claims consume more of a device's capacity than its slice publishes."""


def device_class() -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def node_slice(node: str, gpus: Iterable[GPUInfo], node_uid: str = "") -> dict[str, Any]:
    """The node's ResourceSlice (owned by the Node when `node_uid` is given: deleted with it)."""
    return resource_slice(node, gpus, node_uid=node_uid)


def claim_spec(
    gpus: int, mem_mib: int = 0, sm_pct: int = 0, models: Iterable[str] | None = None
) -> dict[str, Any]:
    """A ResourceClaim spec: `gpus` whole GPUs when neither `mem_mib` nor `sm_pct` is given, else one
    GPU's share of that much memory and those SMs. `models`: the GPU models allowed (any if None)."""
    exactly: dict[str, Any] = {"deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": gpus}
    if mem_mib or sm_pct:
        if gpus != 1:
            raise ValueError(f"a share is of one GPU, not {gpus}")
        asked = {"memory": f"{mem_mib}Mi"} if mem_mib else {}
        if sm_pct:
            asked["sm"] = str(sm_pct)
        exactly["capacity"] = {"requests": asked}
    if models:
        names = ", ".join(f'"{m}"' for m in sorted(models))
        exactly["selectors"] = [{"cel": {"expression": f'device.attributes["{DRIVER}"].model in [{names}]'}}]
    return {"devices": {"requests": [{"name": REQUEST, "exactly": exactly}]}}


def claim(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


def claim_template(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"spec": spec}}  # fmt: skip


def pod_claim(source: str, template: bool = False) -> dict[str, Any]:
    """The pod-level entry for its one claim (named `gpu`; containers list `{"name": "gpu"}`)."""
    return {"name": REQUEST, ("resourceClaimTemplateName" if template else "resourceClaimName"): source}


def results(claim_obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The allocation's device results of a claim (API JSON), [] while unallocated."""
    alloc = (claim_obj.get("status") or {}).get("allocation") or {}
    return list((alloc.get("devices") or {}).get("results") or [])


def device_index(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def allocated_milli(claim_obj: dict[str, Any]) -> int:
    """The GPU the claim holds, in the simulator's milli: a share its consumed SMs (x10), a device
    given whole (no SMs asked: it consumed the whole memory by default) FULL."""
    total = 0
    for r in results(claim_obj):
        sm = int(parse_quantity((r.get("consumedCapacity") or {}).get("sm", "0")))
        total += sm * 10 if sm else FULL
    return total


def capacity_overfills(slices: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]]) -> list[str]:
    """Every (device, capacity) whose consumption summed over all claims exceeds the slice's value,
    and every allocated device no slice publishes, one line each; [] when all fit. Only this
    driver's results count. A result without consumedCapacity holds the device whole: counted as
    its full capacity, so a second claim on it shows as an overfill too."""
    cap: dict[tuple[str, str], dict[str, Decimal]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != DRIVER:
            continue
        pool = (spec.get("pool") or {}).get("name", "")
        for d in spec.get("devices") or []:
            cap[(pool, d["name"])] = {
                k: parse_quantity(v["value"]) for k, v in (d.get("capacity") or {}).items()
            }
    used: dict[tuple[str, str], dict[str, Decimal]] = {}
    holders: dict[tuple[str, str], list[str]] = {}
    bad: list[str] = []
    for c in claims:
        meta = c.get("metadata") or {}
        who = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        for r in results(c):
            if r.get("driver") != DRIVER:
                continue
            key = (r.get("pool", ""), r.get("device", ""))
            if key not in cap:
                bad.append(f"claim {who}: device {key[1]} of pool {key[0]} is in no ResourceSlice")
                continue
            consumed = r.get("consumedCapacity")
            got = cap[key] if consumed is None else {k: parse_quantity(v) for k, v in consumed.items()}
            u = used.setdefault(key, {})
            for k, v in got.items():
                u[k] = u.get(k, Decimal(0)) + v
            holders.setdefault(key, []).append(who)
    for key, u in sorted(used.items()):
        for k, v in sorted(u.items()):
            limit = cap[key].get(k)
            if limit is None or v > limit:
                bad.append(f"device {key[1]} of pool {key[0]}: {k} consumed {v} > capacity {limit} "
                           f"by {len(holders[key])} claims ({', '.join(holders[key][:5])})")  # fmt: skip
    return bad


def check_capacity(slices: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]]) -> int:
    """Raise CapacityExceeded naming every overfilled device; else the number of devices in use."""
    slices, claims = list(slices), list(claims)
    bad = capacity_overfills(slices, claims)
    if bad:
        raise CapacityExceeded(f"{len(bad)} device capacities exceeded: " + "; ".join(bad[:10]))
    return len(
        {(r.get("pool"), r.get("device")) for c in claims for r in results(c) if r.get("driver") == DRIVER}
    )
