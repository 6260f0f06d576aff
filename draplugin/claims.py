"""What NodePrepareResources makes of one ResourceClaim: pure, no I/O.

The claim is tenant-written (its spec) and scheduler-written (its status.allocation); both are
checked here as hostile input: the UID must be the one the kubelet asked for, only this driver's
results on this node's pool and known GPUs are taken, consumed capacities are clamped to the
GPU's (memory 1 MiB .. the GPU's, SM 0..100 %), and every string that ends up on disk is bounded.
A claim that does not pass gets a ClaimError with a message for `kubectl describe pod`; the other
claims of the same request are prepared as usual.

The class of a claim (online or offline) is the DeviceClass of its requests: a class named in
`offline_classes` is offline, any other online. Online and offline claims are never prepared on one
GPU at once (`conflict`): the allocator may still place them together (see docs/dra.md), and then
the second stays unprepared (the kubelet retries) until the first is gone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from decimal import Decimal, DecimalException, InvalidOperation
from typing import Any

from draplugin.cdi import PreparedClaim, PreparedDevice, check_uid
from draplugin.slices import DRIVER, MEMORY, SM
from gpupack import handoff
from gpupack.contract import GPUInfo, GPUShare

ONLINE = "online"
OFFLINE = "offline"
DEFAULT_OFFLINE_CLASSES = frozenset({"gpupack-offline"})
MAX_RESULTS = 32  # the API's own limit on a claim's allocation results
MIB = 1024 * 1024
_SUFFIX = {
    "Ki": 1024,
    "Mi": MIB,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


class ClaimError(Exception):
    """This claim cannot be prepared; the message names the claim and why."""


def parse_quantity(q: object) -> Decimal:
    """A Kubernetes quantity (`20Gi`, `40`, `1.5G`, `500m`) as a number; ValueError otherwise."""
    s = str(q).strip()
    if not s or len(s) > 64:
        raise ValueError(f"quantity {s[:64]!r}")
    mult = Decimal(1)
    for suffix, m in _SUFFIX.items():
        if s.endswith(suffix):
            s, mult = s[: -len(suffix)], Decimal(m)
            break
    else:
        if s.endswith("m"):
            s, mult = s[:-1], Decimal("0.001")
    try:
        v = Decimal(s) * mult
    except (InvalidOperation, DecimalException) as e:  # Overflow: 1e999999Gi
        raise ValueError(f"quantity {str(q)[:64]!r}") from e
    if not v.is_finite():
        raise ValueError(f"quantity {str(q)[:64]!r}")
    return v


def request_classes(claim: Mapping[str, Any]) -> dict[str, str]:
    """Request name (`req` or `req/sub` for a prioritized list's choice) -> its DeviceClass name."""
    out: dict[str, str] = {}
    for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = str(r.get("name") or "")
        exactly = r.get("exactly")
        if isinstance(exactly, Mapping):
            out[name] = str(exactly.get("deviceClassName") or "")
        for sub in r.get("firstAvailable") or []:
            out[f"{name}/{sub.get('name')}"] = str(sub.get("deviceClassName") or "")
    return out


def plan(
    claim: Mapping[str, Any],
    *,
    uid: str,
    node: str,
    gpus: Mapping[str, GPUInfo],
    enforcement: str = handoff.ENFORCE_BOTH,
    offline_classes: Iterable[str] = DEFAULT_OFFLINE_CLASSES,
) -> PreparedClaim:
    """The claim as prepared on `node`, whose GPUs are `gpus` (slice device name -> GPU)."""
    meta = claim.get("metadata") or {}
    ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    what = f"ResourceClaim {ns}/{name}"[:300]
    uid = check_uid(uid)
    if str(meta.get("uid") or "").lower() != uid:
        raise ClaimError(f"{what} has UID {str(meta.get('uid'))[:40]}, not {uid} (deleted and re-created?)")
    alloc = (claim.get("status") or {}).get("allocation")
    if not isinstance(alloc, Mapping):
        raise ClaimError(f"{what} is not allocated")
    results = [
        r
        for r in ((alloc.get("devices") or {}).get("results") or [])
        if isinstance(r, Mapping) and r.get("driver") == DRIVER
    ]
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"{what} has {len(results)} allocation results for {DRIVER}; at most {MAX_RESULTS}")
    classes = request_classes(claim)
    offline = frozenset(offline_classes)
    kinds: set[str] = set()
    picked: list[tuple[Mapping[str, Any], GPUInfo, int, int]] = []
    for r in results:
        dev, pool = str(r.get("device") or ""), str(r.get("pool") or "")
        if pool != node:
            raise ClaimError(f"{what}: device {dev[:64]} is in pool {pool[:64]}, not this node's ({node})")
        gpu = gpus.get(dev)
        if gpu is None:
            raise ClaimError(f"{what}: device {dev[:64]} is not a GPU of node {node}")
        if not gpu.healthy:
            raise ClaimError(f"{what}: GPU {dev} ({gpu.uuid}) is unhealthy ({gpu.unhealthy_reason})")
        mem, sm = _consumed(what, dev, r.get("consumedCapacity"), gpu)
        picked.append((r, gpu, mem, sm))
        kinds.add(OFFLINE if classes.get(str(r.get("request") or "")) in offline else ONLINE)
    if len(kinds) > 1:
        raise ClaimError(f"{what} asks for both online and offline GPUs; use one claim per class")
    shares = [
        GPUShare(
            uuid=gpu.uuid,
            index=gpu.index,
            mem_mib=mem,
            sm_pct=sm or 100,  # no SM share asked: no SM limit
            exclusive=mem >= gpu.mem_mib and sm in (0, 100),
        )
        for _r, gpu, mem, sm in picked
    ]
    env = handoff.container_env(shares, enforcement) if shares else {}
    devices = tuple(
        PreparedDevice(
            request=str(r.get("request") or "")[:253],
            pool=node,
            device=str(r.get("device")),
            gpu_uuid=gpu.uuid,
            mem_mib=mem,
            sm_pct=sm,
            share_id=str(r.get("shareID") or "")[:64],
            env=env,
        )
        for r, gpu, mem, sm in picked
    )
    return PreparedClaim(
        uid=uid,
        namespace=ns[:63],
        name=name[:253],
        pod_class=(kinds.pop() if kinds else ONLINE),
        devices=devices,
    )


def _consumed(what: str, dev: str, cc: object, gpu: GPUInfo) -> tuple[int, int]:
    """(memory MiB, SM percent) the allocation consumed, clamped to the GPU. No consumedCapacity
    (an allocation made without consumable capacity) is the whole GPU."""
    if not isinstance(cc, Mapping):
        return gpu.mem_mib, 0
    try:
        mem_b = parse_quantity(cc[MEMORY]) if MEMORY in cc else Decimal(gpu.mem_mib * MIB)
        sm_v = parse_quantity(cc[SM]) if SM in cc else Decimal(0)
    except ValueError as e:
        raise ClaimError(f"{what}: consumedCapacity of {dev[:64]} is not a quantity: {e}") from e
    # clamped as decimals first: a tenant's 1e999999 must never become a million-digit integer
    mem = math.ceil(max(Decimal(1), min(Decimal(gpu.mem_mib), mem_b / MIB)))
    sm = math.ceil(max(Decimal(0), min(Decimal(100), sm_v)))
    return mem, sm


def conflict(claim: PreparedClaim, others: Iterable[PreparedClaim]) -> str:
    """Why `claim` may not be prepared beside the claims prepared on this node ("" when it may):
    online and offline never share a GPU."""
    mine = {d.gpu_uuid: d.device for d in claim.devices}
    for o in others:
        if o.uid == claim.uid or o.pod_class == claim.pod_class:
            continue
        for d in o.devices:
            if d.gpu_uuid in mine:
                return (
                    f"GPU {mine[d.gpu_uuid]} ({d.gpu_uuid}) holds {o.pod_class} claim {o.namespace}/{o.name}: "
                    f"online and offline claims never share a GPU; this {claim.pod_class} claim is prepared "
                    "once that claim is unprepared (the kubelet retries)"
                )
    return ""
