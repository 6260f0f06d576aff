"""gpupack's GPUs as DRA devices: read from ResourceSlices, what allocated claims consume of them,
and what a new allocation consumes (the requestPolicy's defaults for what a claim does not ask).
Pure, no I/O.

A device's consumption is rebuilt from every allocated claim's `consumedCapacity`, whoever
allocated it (this controller, or kube-scheduler for a pod that bypassed the gate): the claims are
the record, so a restart loses nothing. A result without consumedCapacity holds the device whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import Any

from gpupack.contract import ContractError, parse_quantity

from .claims import DRIVER, MIB

MAX_DEVICES_PER_SLICE = 128  # the API server's own bound


def _d(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _l(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _q(v: Any) -> Decimal | None:
    try:
        return parse_quantity(v, "capacity")
    except ContractError:
        return None


@dataclass
class Device:
    node: str  # the pool, which `gpupack dra-plugin` names after the node
    name: str
    index: int
    model: str
    mem_mib: int
    healthy: bool
    holds: str  # the class of the claims prepared on it, as the plugin publishes it
    mem_default: Decimal  # bytes a claim asking no memory consumes
    sm_default: Decimal
    # what allocated claims consume
    mem_used: int = 0
    sm_used: int = 0
    whole: bool = False
    pod_class: str | None = None
    holders: dict[str, tuple[int, int]] = field(default_factory=dict)


def _attr(dev: Mapping[str, Any], key: str) -> Any:
    a = _d(_d(dev.get("attributes")).get(key))
    for k in ("string", "int", "bool", "version"):
        if k in a:
            return a[k]
    return None


def slice_devices(
    slices: Iterable[Mapping[str, Any]],
    cache: dict[tuple[str, str], list[Device]] | None = None,
    seen: dict[tuple[str, str], list[Device]] | None = None,
) -> dict[str, list[Device]]:
    """node -> its gpupack devices, fresh (uncharged) each call (node-local slices of driver
    gpu.gpupack.io only; a pool's slices of an older generation are skipped, as the scheduler
    skips them). `cache`/`seen`: the parsed devices by slice (uid, resourceVersion), as in
    charge_claims."""
    newest: dict[str, int] = {}
    picked = []
    for s in slices:
        spec = _d(s.get("spec"))
        if spec.get("driver") != DRIVER or not spec.get("nodeName"):
            continue
        pool = _d(spec.get("pool"))
        gen = pool.get("generation", 0)
        gen = gen if isinstance(gen, int) else 0
        name = str(pool.get("name") or "")
        newest[name] = max(newest.get(name, gen), gen)
        meta = _d(s.get("metadata"))
        picked.append(
            (name, gen, str(spec["nodeName"]), spec, (str(meta.get("uid")), str(meta.get("resourceVersion"))))
        )
    out: dict[str, list[Device]] = {}
    for pool_name, gen, node, spec, key in picked:
        if gen != newest[pool_name] or pool_name != node:
            continue
        parsed = cache.get(key) if cache is not None else None
        if parsed is None:
            parsed = _parse_devices(node, spec)
        if seen is not None:
            seen[key] = parsed
        out.setdefault(node, []).extend(_fresh(d) for d in parsed)
    for devs in out.values():
        devs.sort(key=lambda d: d.index)
    return out


def _fresh(d: Device) -> Device:
    """An uncharged copy of a parsed device (what `replace(d, holders={})` gives for a device never
    charged, at a fraction of its cost: a pass copies every device of the cluster)."""
    return Device(
        d.node, d.name, d.index, d.model, d.mem_mib, d.healthy, d.holds, d.mem_default, d.sm_default
    )


def _parse_devices(node: str, spec: Mapping[str, Any]) -> list[Device]:
    out: list[Device] = []
    for i, dev in enumerate(_l(spec.get("devices"))[:MAX_DEVICES_PER_SLICE]):
        dev = _d(dev)
        cap = _d(dev.get("capacity"))
        mem = _q(_d(cap.get("memory")).get("value"))
        if mem is None or mem <= 0 or not dev.get("name"):
            continue
        mem_pol = _d(_d(cap.get("memory")).get("requestPolicy"))
        sm_pol = _d(_d(cap.get("sm")).get("requestPolicy"))
        idx = _attr(dev, "index")
        tainted = any(_d(t).get("effect") in ("NoSchedule", "NoExecute") for t in _l(dev.get("taints")))
        out.append(Device(
            node=node, name=str(dev["name"]), index=idx if isinstance(idx, int) else i,
            model=str(_attr(dev, "model") or ""), mem_mib=int(mem // MIB),
            healthy=_attr(dev, "healthy") is not False and not tainted,
            holds=str(_attr(dev, "holds") or ""),
            mem_default=_q(mem_pol.get("default")) or mem, sm_default=_q(sm_pol.get("default")) or Decimal(0),
        ))  # fmt: skip
    return out


Parsed = tuple[
    str, str, str, "Decimal | None", "Decimal | None", bool
]  # pool, device, request, mem, sm, has consumed


def parsed_results(claim: Mapping[str, Any]) -> list[Parsed]:
    """A claim's gpupack results with their consumedCapacity parsed (what charging a device needs)."""
    alloc = _d(_d(claim.get("status")).get("allocation"))
    out: list[Parsed] = []
    for r in _l(_d(alloc.get("devices")).get("results")):
        r = _d(r)
        if r.get("driver") != DRIVER:
            continue
        consumed = r.get("consumedCapacity")
        has = isinstance(consumed, Mapping)
        mem = _q(consumed.get("memory")) if isinstance(consumed, Mapping) else None
        sm = _q(consumed.get("sm")) if isinstance(consumed, Mapping) else None
        out.append((str(r.get("pool")), str(r.get("device")), str(r.get("request")), mem, sm, has))
    return out


def result_use(p: Parsed, dev: Device) -> tuple[int, int, bool]:
    """(MiB, SM percent, whole) one allocation result holds of `dev`, from its consumedCapacity;
    a result without it (or consuming all the memory) holds the device whole."""
    _, _, _, mem, sm, has = p
    if not has:
        return dev.mem_mib, 100, True
    mem_mib = (
        dev.mem_mib if mem is None else min(dev.mem_mib, int((mem / MIB).to_integral_value(ROUND_CEILING)))
    )
    sm_pct = 0 if sm is None else max(0, min(100, int(sm.to_integral_value(ROUND_CEILING))))
    return mem_mib, sm_pct, mem_mib >= dev.mem_mib


def charge_claims(
    devices: Mapping[str, list[Device]],
    claims: Iterable[Mapping[str, Any]],
    classes: Mapping[str, str],
    cache: dict[tuple[str, str], list[Parsed]] | None = None,
    seen: dict[tuple[str, str], list[Parsed]] | None = None,
) -> None:
    """Add every allocated claim's gpupack results to its devices (in place). `cache`: parsed
    results by (uid, resourceVersion) from the last pass; `seen` gets this pass's (so the cache
    holds only live claims)."""
    by_key = {(d.node, d.name): d for devs in devices.values() for d in devs}
    for c in claims:
        meta = _d(c.get("metadata"))
        key = (str(meta.get("uid")), str(meta.get("resourceVersion")))
        results = cache.get(key) if cache is not None else None
        if results is None:
            results = parsed_results(c)
        if seen is not None:
            seen[key] = results
        if not results:
            continue
        who = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        req_class = {
            str(_d(r).get("name")): str(_d(_d(r).get("exactly")).get("deviceClassName") or "")
            for r in _l(_d(_d(c.get("spec")).get("devices")).get("requests"))
        }
        for p in results:
            dev = by_key.get((p[0], p[1]))
            if dev is None:
                continue
            mem, sm, whole = result_use(p, dev)
            dev.mem_used += mem
            dev.sm_used += sm
            dev.whole = dev.whole or whole
            # a class the controller does not know (a claim of another DeviceClass on this driver)
            # counts as online: the stricter choice keeps offline claims off that GPU
            cls = classes.get(req_class.get(p[2].split("/")[0], ""), "online")
            if dev.pod_class is None:
                dev.pod_class = cls
            elif dev.pod_class != cls:
                dev.pod_class = "mixed"
            m0, s0 = dev.holders.get(who, (0, 0))
            dev.holders[who] = (m0 + mem, s0 + sm)


def consumed(dev: Device, mem_mib: int | None, sm_pct: int | None) -> dict[str, str]:
    """consumedCapacity of one result on `dev`: what the claim asks, else the requestPolicy's
    default (a whole GPU asks nothing and so consumes the default: all of the memory)."""
    mem = f"{mem_mib}Mi" if mem_mib is not None else _canon(dev.mem_default)
    sm = str(sm_pct) if sm_pct is not None else _canon(dev.sm_default)
    return {"memory": mem, "sm": sm}


def _canon(v: Decimal) -> str:
    if v == v.to_integral_value() and v % MIB == 0 and v >= MIB:
        return f"{int(v // MIB)}Mi"
    return str(int(v.to_integral_value(ROUND_CEILING)))
