"""The ResourceSlice a node's GPUs are published in (resource.k8s.io/v1): pure, no I/O.

One slice per node, driver `gpu.gpupack.io`, pool = the node's name, one device per GPU named
`gpu-<NVML index>`:

- attributes: `uuid`, `model`, `driverVersion`, `pciBusID` (strings), `index`, `smCount`,
  `numaNode` (ints), `healthy` (bool). `driverVersion` is a string, not a `version` attribute:
  NVIDIA driver versions such as 535.104.05 are not semantic versions (leading zero).
- capacity `memory`, value `<MiB>Mi`, requestPolicy validRange {min 1Mi, step 1Mi} and default =
  the whole memory: a claim that names no memory consumes the whole GPU's memory, so nothing
  else fits beside it (a whole GPU), while a claim asking 20Gi consumes exactly that.
- capacity `sm` (percent of the GPU's SMs), value 100, requestPolicy validRange {min 0, max 100,
  step 1} and default 0: a claim that names no SM share reserves none and gets no SM limit
  (memory alone decides what fits, as a memory-only gpupack share does), while one asking 40
  consumes 40 of the 100 and is held to 40 %. A default of 100 would make every memory-only
  claim a whole GPU. Checked with the v1.36.2 API server and kube-scheduler
  (tests/draplugin/test_dra_cluster.py): the server accepts min 0 and the scheduler fills a GPU
  with several claims until one capacity would exceed its value.
- `allowMultipleAllocations: true` (consumable capacity, beta and on by default in 1.36).
- attribute `holds` (string): the class of the claims prepared on the GPU ("" when none). The
  DeviceClasses gpupack-online and gpupack-offline (deploy/dra/deviceclasses.yaml) select GPUs that
  hold nothing or their own class: once a GPU's first claim is prepared, the allocator gives it only
  claims of that class. Between an allocation and its prepare the attribute is not yet set; the
  plugin's prepare refuses a claim of the other class on that GPU (draplugin.claims.conflict).

An unhealthy GPU stays in the slice with `healthy: false` and a device taint
`gpu.gpupack.io/unhealthy` with effect NoSchedule (device taints, beta in 1.36): the allocator
then gives it to no new claim, and claims already on it keep running (NoSchedule, not NoExecute:
gpupack never evicts for a GPU's health; the DeviceClasses also select only healthy devices, which
is what keeps new claims off it where a server drops the taint field).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpupack.contract import GPUInfo

DRIVER = "gpu.gpupack.io"
API_VERSION = "resource.k8s.io/v1"
UNHEALTHY_TAINT = f"{DRIVER}/unhealthy"
MEMORY = "memory"
SM = "sm"
DEVICE_PREFIX = "gpu-"
# which class of claims a GPU holds: "" (none), "online", "offline", or "mixed" (both, which the
# plugin refuses to prepare; only a hand-made CDI file could cause it). The DeviceClasses select
# `holds` "" or their own class, so the allocator keeps the classes apart on GPUs already in use.
HOLDS = "holds"
MIXED = "mixed"
HOLDS_VALUES = frozenset({"", "online", "offline", MIXED})
# attribute strings are limited to 64 characters by the API server
_MAX_ATTR_STRING = 64


def device_name(index: int) -> str:
    return f"{DEVICE_PREFIX}{index}"


def slice_name(node: str) -> str:
    """One slice per node and driver. Node names are DNS subdomains of at most 253 characters; the
    suffix keeps the name unique per driver and still within 253."""
    return f"{node[: 253 - len(DRIVER) - 1]}-{DRIVER}"


def _s(value: str) -> dict[str, str]:
    return {"string": value[:_MAX_ATTR_STRING]}


def device(gpu: GPUInfo, driver_version: str = "", holds: str = "") -> dict[str, Any]:
    """One GPU as a resource.k8s.io/v1 Device; `holds`: the class of the claims prepared on it."""
    attrs: dict[str, Any] = {
        "uuid": _s(gpu.uuid),
        "model": _s(gpu.model),
        "index": {"int": gpu.index},
        "smCount": {"int": gpu.sm_count},
        "numaNode": {"int": gpu.numa_node},
        "healthy": {"bool": gpu.healthy},
        HOLDS: {"string": holds if holds in HOLDS_VALUES else MIXED},
    }
    if driver_version:
        attrs["driverVersion"] = _s(driver_version)
    if gpu.pci_bus_id:
        attrs["pciBusID"] = _s(gpu.pci_bus_id)
    mem = f"{gpu.mem_mib}Mi"
    d: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": attrs,
        "capacity": {
            MEMORY: {
                "value": mem,
                "requestPolicy": {"default": mem, "validRange": {"min": "1Mi", "step": "1Mi"}},
            },
            SM: {
                "value": "100",
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
            },
        },
        "allowMultipleAllocations": True,
    }
    if not gpu.healthy:
        d["taints"] = [{"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}]
    return d


def resource_slice(
    node: str,
    gpus: Iterable[GPUInfo],
    *,
    generation: int = 1,
    node_uid: str = "",
    driver_version: str = "",
    holds: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The whole ResourceSlice body for `node` (create or replace). `generation` is the pool's:
    bump it whenever the devices change so that consumers drop an older slice of the pool.
    `node_uid` makes the Node the slice's owner (deleted with the node). `holds`: device name -> the
    class of the claims prepared on it (absent: none)."""
    held = holds or {}
    meta: dict[str, Any] = {"name": slice_name(node), "labels": {"app.kubernetes.io/managed-by": "gpupack"}}
    if node_uid:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                device(g, driver_version, held.get(device_name(g.index), ""))
                for g in sorted(gpus, key=lambda g: g.index)
            ],
        },
    }


def devices_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two slice bodies publish the same devices (what decides a generation bump)."""
    return bool(
        a.get("spec", {}).get("devices") == b.get("spec", {}).get("devices")
        and a.get("spec", {}).get("nodeName") == b.get("spec", {}).get("nodeName")
    )
