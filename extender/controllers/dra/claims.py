"""What a pod's gpupack claims ask, read from tenant-written ResourceClaims: pure, no I/O.

Every field is hostile: a claim is taken only in the shape gpupack can place exactly (ExactCount
requests of a gpupack DeviceClass, optional `capacity.requests` of `memory` and `sm`, an optional
selector on the GPU model in the one form below); anything else is a ClaimError naming why, and the
pod stays gated with that reason (allocating it partly, or by guessing a CEL expression, could break
the class rule). Counts and quantities are bounded before any arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from gpupack.contract import ContractError, parse_quantity

DRIVER = "gpu.gpupack.io"
GATE = "gpupack.io/dra-allocate"
FINALIZER = "resource.kubernetes.io/delete-protection"  # what kube-scheduler puts on claims it allocates
MAX_CLAIMS = 4  # gpupack claims one pod may name
MAX_REQUESTS = 8  # requests over all of them
MAX_COUNT = 16  # GPUs one request may ask
MAX_MODELS = 16
MIB = 1 << 20
_MODEL_SEL = re.compile(
    r'^\s*device\.attributes\["gpu\.gpupack\.io"\]\.model\s*(?:==\s*("(?:[^"\\]{1,64})")|in\s*\[([^\]]{0,2048})\])\s*$'
)
_MODEL = re.compile(r'^\s*"([^"\\]{1,64})"\s*$')


class ClaimError(ValueError):
    """A claim gpupack cannot allocate as written (the message says why, for the pod's Event)."""


@dataclass(frozen=True)
class Ask:
    """One request of a gpupack claim: `count` GPUs, each whole (mem_mib and sm_pct None) or a
    share of `mem_mib` MiB (None: the device's default, its whole memory) and `sm_pct` percent."""

    claim: str  # the claim's name
    request: str
    device_class: str
    pod_class: str  # online / offline
    count: int
    mem_mib: int | None = None
    sm_pct: int | None = None
    models: frozenset[str] | None = None

    @property
    def whole(self) -> bool:
        return self.mem_mib is None and self.sm_pct is None


def _d(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _l(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _models(selectors: list[Any], where: str) -> frozenset[str] | None:
    models: frozenset[str] | None = None
    if len(selectors) > 4:
        raise ClaimError(f"{where}: more than 4 selectors")
    for s in selectors:
        expr = _d(_d(s).get("cel")).get("expression")
        m = _MODEL_SEL.match(expr) if isinstance(expr, str) and len(expr) <= 4096 else None
        if not m:
            raise ClaimError(
                f'{where}: gpupack places only selectors of the form device.attributes["{DRIVER}"].model '
                f'in ["..."] (or == "...")'
            )
        items = [m.group(1)] if m.group(1) else m.group(2).split(",")
        if len(items) > MAX_MODELS:
            raise ClaimError(f"{where}: more than {MAX_MODELS} models")
        got = set()
        for it in items:
            mm = _MODEL.match(it)
            if not mm:
                raise ClaimError(f"{where}: a model selector's list holds something other than quoted names")
            got.add(mm.group(1))
        models = frozenset(got) if models is None else models & got
    return models


def _amount(v: Any, what: str, unit: int) -> int:
    """A capacity request in whole units (MiB for memory, percent for sm), rounded up as the
    requestPolicy's 1-unit step does; bounded before conversion."""
    try:
        q = parse_quantity(v, what)
    except ContractError as e:
        raise ClaimError(str(e)) from e
    if q < 0 or q > Decimal(1 << 50):
        raise ClaimError(f"{what}: {str(v)[:40]} is out of range")
    return int((q / unit).to_integral_value(ROUND_CEILING))


def _ask(claim: str, req: Mapping[str, Any], classes: Mapping[str, str]) -> Ask | None:
    name = str(req.get("name") or "")[:64]
    where = f"claim {claim[:64]} request {name}"
    if "firstAvailable" in req:
        firsts = _l(req.get("firstAvailable"))
        if any(_d(f).get("deviceClassName") in classes for f in firsts):
            raise ClaimError(f"{where}: firstAvailable is not placed by gpupack; name one gpupack class")
        return None
    ex = _d(req.get("exactly"))
    cls = ex.get("deviceClassName")
    if cls not in classes:
        return None
    if ex.get("adminAccess"):
        raise ClaimError(f"{where}: adminAccess is not placed by gpupack")
    if ex.get("tolerations"):
        raise ClaimError(f"{where}: tolerations are not placed by gpupack")
    if ex.get("allocationMode", "ExactCount") != "ExactCount":
        raise ClaimError(f"{where}: only allocationMode ExactCount is placed by gpupack")
    count = ex.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise ClaimError(f"{where}: count must be 1 to {MAX_COUNT}")
    models = _models(_l(ex.get("selectors")), where)
    asked = _d(_d(ex.get("capacity")).get("requests"))
    unknown = sorted(str(k)[:20] for k in asked if k not in ("memory", "sm"))
    if unknown:
        raise ClaimError(f"{where}: gpupack GPUs have no capacity {', '.join(unknown)}")
    mem = _amount(asked["memory"], f"{where} memory", MIB) if "memory" in asked else None
    sm = _amount(asked["sm"], f"{where} sm", 1) if "sm" in asked else None
    if mem is not None and mem < 1:
        mem = 1  # the slice's validRange minimum
    if sm is not None and sm > 100:
        raise ClaimError(f"{where}: sm {sm} is more than a GPU's 100 percent")
    return Ask(claim, name, str(cls), classes[str(cls)], count, mem, sm, models)


def claim_asks(claim: Mapping[str, Any], classes: Mapping[str, str]) -> list[Ask]:
    """The claim's gpupack requests ([] when it has none); `classes` maps the gpupack DeviceClass
    names to online/offline. ClaimError for a claim gpupack cannot place as written, including
    one mixing gpupack requests with others (gpupack would leave part of it to the scheduler)
    or with constraints or config (which gpupack does not evaluate)."""
    meta, spec = _d(claim.get("metadata")), _d(claim.get("spec"))
    name = str(meta.get("name") or "")
    devices = _d(spec.get("devices"))
    reqs = _l(devices.get("requests"))
    if len(reqs) > MAX_REQUESTS:
        if any(_d(_d(r).get("exactly")).get("deviceClassName") in classes for r in reqs):
            raise ClaimError(f"claim {name[:64]}: more than {MAX_REQUESTS} requests")
        return []
    asks, others = [], 0
    for r in reqs:
        a = _ask(name, _d(r), classes)
        if a is None:
            others += 1
        else:
            asks.append(a)
    if asks and others:
        raise ClaimError(f"claim {name[:64]}: mixes gpupack requests with others; use separate claims")
    if asks and (devices.get("constraints") or devices.get("config")):
        raise ClaimError(f"claim {name[:64]}: constraints and config are not placed by gpupack")
    if asks and len({a.pod_class for a in asks}) > 1:
        raise ClaimError(f"claim {name[:64]}: asks both online and offline GPUs")
    return asks


def pod_claim_names(pod: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """(pod claim entry name, ResourceClaim name or None while its template's claim is not made
    yet) for each of the pod's claims."""
    spec, status = _d(pod.get("spec")), _d(pod.get("status"))
    made = {
        str(_d(s).get("name")): _d(s).get("resourceClaimName")
        for s in _l(status.get("resourceClaimStatuses"))
    }
    out: list[tuple[str, str | None]] = []
    for pc in _l(spec.get("resourceClaims")):
        pc = _d(pc)
        entry = str(pc.get("name") or "")
        if pc.get("resourceClaimName"):
            out.append((entry, str(pc["resourceClaimName"])))
        elif entry in made:
            v = made[entry]
            out.append((entry, str(v) if v else ""))  # "": the template made no claim (none needed)
        else:
            out.append((entry, None))
    return out


def gated(pod: Mapping[str, Any]) -> bool:
    return any(_d(g).get("name") == GATE for g in _l(_d(pod.get("spec")).get("schedulingGates")))
