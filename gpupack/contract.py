"""The names and formats that gpupack's components and users share.

Everything that crosses a process boundary lives here: resource names users write, labels, the
annotations the extender writes for the device plugin, the node inventory the device plugin
publishes for the extender, and defrag reservations. Both sides import this module, so a format
change is one edit and a decoding error is reported the same way everywhere.

Decoders never raise on bad data from the cluster with anything but :class:`ContractError`, whose
message names the object and field, so a corrupt annotation is reported, not crashed on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

# --- user-facing API (docs/contract.md §1) --------------------------------------------------
DOMAIN = "gpupack.io"
RES_GPU = f"{DOMAIN}/gpu"  # count of GPUs per container
RES_GPU_MEM = f"{DOMAIN}/gpu-mem"  # MiB on EACH of those GPUs
RES_GPU_SM = f"{DOMAIN}/gpu-sm"  # percent of SMs on EACH GPU, 1..100
MANAGED_RESOURCES = (RES_GPU, RES_GPU_MEM, RES_GPU_SM)

LABEL_CLASS = f"{DOMAIN}/class"  # pod or namespace label: online | offline
CLASS_ONLINE = "online"
CLASS_OFFLINE = "offline"
CLASSES = (CLASS_ONLINE, CLASS_OFFLINE)

# Optional pod annotation restricting GPU models, e.g. "NVIDIA-H100-80GB-HBM3|NVIDIA-A100-SXM4-80GB".
ANN_GPU_MODELS = f"{DOMAIN}/gpu-models"

# --- node side ------------------------------------------------------------------------------
# Node label the DaemonSet selects on, and labels published for humans and nodeAffinity.
LABEL_GPU_NODE = f"{DOMAIN}/gpu-node"
LABEL_GPU_MODEL = f"{DOMAIN}/gpu-model"
LABEL_GPU_COUNT = f"{DOMAIN}/gpu-count"
# Node-template label (an autoscaler node group's nodes): MiB of each GPU, which a template node,
# having no device plugin, cannot publish in an inventory.
LABEL_GPU_MEM_MIB = f"{DOMAIN}/gpu-mem-mib"
# Node annotation: JSON NodeInventory written by the device plugin, read by the extender.
ANN_INVENTORY = f"{DOMAIN}/inventory"
# Node annotation: JSON list of Reservation written by defrag, honoured by the extender.
ANN_RESERVATIONS = f"{DOMAIN}/reservations"

# The kubelet-facing resource is a small count: SLOTS_PER_GPU device IDs per GPU, so that an
# 8 x H200 node advertises 8 * SLOTS_PER_GPU IDs (a few KiB), never one per MiB.
SLOTS_PER_GPU = 16

# --- pod side: the handoff from extender (bind) to device plugin (Allocate) -----------------
ANN_ASSIGNMENT = f"{DOMAIN}/assignment"  # JSON Assignment, written before the Binding
ANN_HANDOFF = f"{DOMAIN}/handoff"  # pending | done | failed
ANN_ALLOCATED = f"{DOMAIN}/allocated"  # JSON list of container names Allocate has served
HANDOFF_PENDING = "pending"
HANDOFF_DONE = "done"
HANDOFF_FAILED = "failed"

# Pod label the extender sets at bind, next to the assignment: its pod watch selects on it, so the
# extender's memory grows with gpupack pods only, not with every pod in the cluster.
LABEL_MANAGED = f"{DOMAIN}/managed"

# Scheduler name used by gpupack's kube-scheduler profile.
SCHEDULER_NAME = "gpupack-scheduler"

SCHEMA_VERSION = 1


class ContractError(ValueError):
    """Data that does not follow this contract; the message says which object and field."""


# --- quantities -------------------------------------------------------------------------------
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


# Bounds checked BEFORE any conversion: int() of a Decimal like 1e300000 is quadratic in its digits
# and holds the GIL for seconds, so a single request body could stall every verb. Kubernetes
# itself caps quantities well inside these (int64 scaled values, at most 63 bits).
QUANTITY_MAX_LEN = 64
QUANTITY_MAX_EXP = 30  # |decimal exponent| of the number part; with the E suffix, at most ~1e48
_QUANTITY_MAX_ABS = 10**QUANTITY_MAX_EXP


def _short(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:32]) + f"... ({len(value)} characters)"


def parse_quantity(value: Any, what: str = "quantity") -> Decimal:
    """Parse a Kubernetes quantity ("20k", "1500m", "16Gi", 3) exactly.

    The API server canonicalises numbers (20000 arrives as "20k"), so int() is never enough.
    Anything longer than QUANTITY_MAX_LEN characters or with an exponent beyond
    QUANTITY_MAX_EXP is refused before it is converted.
    """
    if isinstance(value, bool):
        raise ContractError(f"{what}: expected a quantity, got a boolean")
    if isinstance(value, int):
        if abs(value) > _QUANTITY_MAX_ABS:
            raise ContractError(
                f"{what}: an integer of {value.bit_length()} bits is out of range (at most 1e{QUANTITY_MAX_EXP})"
            )
        return Decimal(value)
    if isinstance(value, float):
        if value != value or abs(value) > _QUANTITY_MAX_ABS:
            raise ContractError(f"{what}: {value!r} is out of range (at most 1e{QUANTITY_MAX_EXP})")
        return Decimal(str(value))
    if not isinstance(value, str):
        raise ContractError(f"{what}: expected a quantity string, got {type(value).__name__}")
    if len(value) > QUANTITY_MAX_LEN:
        raise ContractError(f"{what}: {_short(value)} is longer than {QUANTITY_MAX_LEN} characters")
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ContractError(f"{what}: {_short(value)} is not a Kubernetes quantity")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as e:
        raise ContractError(f"{what}: {value!r} is not a Kubernetes quantity") from e
    if not number.is_finite() or (number and abs(number.adjusted()) > QUANTITY_MAX_EXP):
        raise ContractError(f"{what}: {value!r} is out of range (exponent beyond +-{QUANTITY_MAX_EXP})")
    return number * _SUFFIX[m.group(2)]


def parse_int_quantity(value: Any, what: str) -> int:
    """A quantity that must be a whole, non-negative number (GPU count, MiB, percent)."""
    q = parse_quantity(value, what)
    if q != q.to_integral_value():
        raise ContractError(f"{what}: {value!r} is not a whole number")
    if q < 0:
        raise ContractError(f"{what}: {value!r} is negative")
    return int(q)


# --- node inventory (device plugin -> extender) -----------------------------------------------
@dataclass(frozen=True)
class GPUInfo:
    uuid: str
    index: int
    model: str
    mem_mib: int
    sm_count: int
    healthy: bool = True
    numa_node: int = -1
    pci_bus_id: str = ""
    unhealthy_reason: str = ""


@dataclass(frozen=True)
class NodeInventory:
    gpus: tuple[GPUInfo, ...]
    slots_per_gpu: int = SLOTS_PER_GPU
    # Where enforcement comes from on this node ("hami-core", "mps", or "none").
    enforcement: str = "hami-core"
    updated: str = ""  # RFC 3339, informational
    skipped: tuple[str, ...] = ()  # GPUs not offered, with the reason (MIG mode, NVML error)

    def to_json(self) -> str:
        d = asdict(self)
        d["v"] = SCHEMA_VERSION
        return json.dumps(d, separators=(",", ":"), sort_keys=True)


def _req(d: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ContractError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ContractError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def _load_json(text: Any, where: str) -> Any:
    if not isinstance(text, str):
        raise ContractError(f"{where}: expected a JSON string")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ContractError(f"{where}: not valid JSON ({e})") from e


def decode_inventory(text: Any, node: str = "?") -> NodeInventory:
    where = f"node {node} annotation {ANN_INVENTORY}"
    d = _load_json(text, where)
    if not isinstance(d, dict):
        raise ContractError(f"{where}: expected a JSON object")
    if d.get("v") != SCHEMA_VERSION:
        raise ContractError(f"{where}: unsupported version {d.get('v')!r}")
    gpus_raw = _req(d, "gpus", list, where)
    gpus = []
    seen: set[str] = set()
    for i, g in enumerate(gpus_raw):
        w = f"{where} gpus[{i}]"
        if not isinstance(g, dict):
            raise ContractError(f"{w}: expected an object")
        info = GPUInfo(
            uuid=_req(g, "uuid", str, w),
            index=_req(g, "index", int, w),
            model=_req(g, "model", str, w),
            mem_mib=_req(g, "mem_mib", int, w),
            sm_count=_req(g, "sm_count", int, w),
            healthy=bool(g.get("healthy", True)),
            numa_node=int(g.get("numa_node", -1)) if isinstance(g.get("numa_node", -1), int) else -1,
            pci_bus_id=str(g.get("pci_bus_id", "")),
            unhealthy_reason=str(g.get("unhealthy_reason", "")),
        )
        if info.mem_mib <= 0 or info.sm_count < 0 or info.index < 0:
            raise ContractError(f"{w}: mem_mib must be positive, index and sm_count non-negative")
        if info.uuid in seen:
            raise ContractError(f"{w}: duplicate GPU uuid {info.uuid}")
        seen.add(info.uuid)
        gpus.append(info)
    slots = d.get("slots_per_gpu", SLOTS_PER_GPU)
    if not isinstance(slots, int) or slots <= 0:
        raise ContractError(f"{where}: slots_per_gpu must be a positive integer")
    return NodeInventory(
        gpus=tuple(gpus),
        slots_per_gpu=slots,
        enforcement=str(d.get("enforcement", "hami-core")),
        updated=str(d.get("updated", "")),
        skipped=tuple(str(s) for s in d.get("skipped", []) if isinstance(s, str)),
    )


# --- assignment (extender at bind -> device plugin at Allocate) --------------------------------
@dataclass(frozen=True)
class GPUShare:
    """One container's share of one GPU."""

    uuid: str
    index: int
    mem_mib: int  # reserved memory on this GPU (the whole GPU's memory when exclusive)
    sm_pct: int  # reserved SM percent (100 when exclusive)
    exclusive: bool = False


@dataclass(frozen=True)
class Assignment:
    pod_uid: str
    node: str
    pod_class: str
    # container name -> its GPU shares; init containers are listed too
    containers: dict[str, tuple[GPUShare, ...]] = field(default_factory=dict)
    bound_at: str = ""  # RFC 3339
    reservation: str = ""  # id of the defrag reservation this pod consumed, if any

    def to_json(self) -> str:
        d = {
            "v": SCHEMA_VERSION,
            "pod_uid": self.pod_uid,
            "node": self.node,
            "class": self.pod_class,
            "bound_at": self.bound_at,
            # GPUShare's fields, as asdict(s) has them (a test holds the two equal): asdict's
            # generic walk was most of encoding an assignment, on every bind
            "containers": {
                c: [
                    {
                        "uuid": s.uuid,
                        "index": s.index,
                        "mem_mib": s.mem_mib,
                        "sm_pct": s.sm_pct,
                        "exclusive": s.exclusive,
                    }
                    for s in shares
                ]
                for c, shares in self.containers.items()
            },
        }
        if self.reservation:
            d["reservation"] = self.reservation
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    def gpu_uuids(self) -> set[str]:
        return {s.uuid for shares in self.containers.values() for s in shares}


def _decode_containers(raw: dict[str, Any], where: str) -> dict[str, tuple[GPUShare, ...]]:
    """container name -> GPU shares, as assignments and reservations both carry them."""
    containers: dict[str, tuple[GPUShare, ...]] = {}
    for cname, shares_raw in raw.items():
        w = f"{where} container {cname!r}"
        if not isinstance(shares_raw, list) or not shares_raw:
            raise ContractError(f"{w}: expected a non-empty list of GPU shares")
        shares = []
        for j, s in enumerate(shares_raw):
            ws = f"{w}[{j}]"
            if not isinstance(s, dict):
                raise ContractError(f"{ws}: expected an object")
            share = GPUShare(
                uuid=_req(s, "uuid", str, ws),
                index=_req(s, "index", int, ws),
                mem_mib=_req(s, "mem_mib", int, ws),
                sm_pct=_req(s, "sm_pct", int, ws),
                exclusive=bool(s.get("exclusive", False)),
            )
            if share.mem_mib < 0 or not 0 <= share.sm_pct <= 100:
                raise ContractError(f"{ws}: mem_mib must be >= 0 and sm_pct in 0..100")
            shares.append(share)
        containers[cname] = tuple(shares)
    return containers


def _decode_class(value: Any, where: str) -> str:
    if not isinstance(value, str) or value not in CLASSES:
        raise ContractError(f"{where}: unknown class {value!r}")
    return value


def decode_assignment(text: Any, pod: str = "?") -> Assignment:
    where = f"pod {pod} annotation {ANN_ASSIGNMENT}"
    return _assignment_of(_load_json(text, where), where)


def _assignment_of(d: Any, where: str) -> Assignment:
    if not isinstance(d, dict):
        raise ContractError(f"{where}: expected a JSON object")
    if d.get("v") != SCHEMA_VERSION:
        raise ContractError(f"{where}: unsupported version {d.get('v')!r}")
    pod_class = _decode_class(_req(d, "class", str, where), where)
    containers = _decode_containers(_req(d, "containers", dict, where), where)
    return Assignment(
        pod_uid=_req(d, "pod_uid", str, where),
        node=_req(d, "node", str, where),
        pod_class=pod_class,
        containers=containers,
        bound_at=str(d.get("bound_at", "")),
        reservation=str(d.get("reservation", "")),
    )


def encode_allocated(
    served: list[str], a: Assignment, ids: Mapping[str, Collection[str]] | None = None
) -> str:
    """The device plugin's allocation record (docs/contract.md §4): the containers Allocate has
    served, in order, the GPU shares each was handed (the assignment's, for those containers) and
    the kubelet device IDs each was served with (`ids`, container -> IDs; PreStartContainer checks
    that the pod holding those IDs in the kubelet is the pod whose record claims them).
    It outlives a removed assignment: the extender rebuilds a running pod's share from it."""
    held = Assignment(
        pod_uid=a.pod_uid,
        node=a.node,
        pod_class=a.pod_class,
        containers={c: a.containers[c] for c in served if c in a.containers},
        bound_at=a.bound_at,
        reservation=a.reservation,
    )
    record: dict[str, Any] = {"v": SCHEMA_VERSION, "served": served, "held": json.loads(held.to_json())}
    if ids:
        record["ids"] = {c: sorted(ids[c]) for c in served if c in ids}
    return json.dumps(record, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class AllocationRecord:
    """`gpupack.io/allocated`, decoded. `held` is None and `ids` empty for a record of the older
    form (a list of names); `ids` lacks a container served by a plugin before it stored IDs."""

    served: list[str]
    held: Assignment | None
    ids: dict[str, frozenset[str]]


def decode_allocation_record(text: Any, pod: str = "?") -> AllocationRecord:
    where = f"pod {pod} annotation {ANN_ALLOCATED}"
    d = _load_json(text, where)
    if isinstance(d, list):  # written by device plugins before the record held the shares
        if not all(isinstance(x, str) for x in d):
            raise ContractError(f"{where}: expected a JSON list of container names")
        return AllocationRecord(d, None, {})
    if not isinstance(d, dict):
        raise ContractError(f"{where}: expected a JSON object")
    if d.get("v") != SCHEMA_VERSION:
        raise ContractError(f"{where}: unsupported version {d.get('v')!r}")
    served = _req(d, "served", list, where)
    if not all(isinstance(x, str) for x in served):
        raise ContractError(f"{where}: served: expected a list of container names")
    held = _assignment_of(_req(d, "held", dict, where), f"{where} held")
    if set(held.containers) - set(served):
        raise ContractError(f"{where}: held names containers that were not served")
    raw_ids = d.get("ids", {})
    if not isinstance(raw_ids, dict) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in raw_ids.values()
    ):
        raise ContractError(f"{where}: ids: expected an object of container name -> list of device IDs")
    if set(raw_ids) - set(served):
        raise ContractError(f"{where}: ids names containers that were not served")
    return AllocationRecord(served, held, {c: frozenset(v) for c, v in raw_ids.items()})


def decode_allocated(text: Any, pod: str = "?") -> list[str]:
    """The container names Allocate has served, in order (either form of the record)."""
    return decode_allocation_record(text, pod).served


def decode_allocation(text: Any, pod: str = "?") -> Assignment | None:
    """The GPU shares the served containers were handed (None: a record of the older form, a
    list of names only)."""
    return decode_allocation_record(text, pod).held


# --- defrag reservations (defrag -> extender) --------------------------------------------------
@dataclass(frozen=True)
class Reservation:
    """Capacity on one node held for the replacement of an evicted pod.

    The extender treats the held capacity as used by everyone except a pod that matches
    (same namespace and owner); that pod is steered to `gpus` and consumes the reservation.
    """

    id: str
    namespace: str
    owner_kind: str  # e.g. ReplicaSet, StatefulSet
    owner_name: str
    pod_class: str
    # container name -> GPU shares to hold (same shape as an Assignment's)
    containers: dict[str, tuple[GPUShare, ...]]
    expires: str  # RFC 3339; an expired reservation holds nothing
    evicted_pod: str = ""  # namespace/name of the pod whose move this serves
    # host room held too (a preemption's: the preemptor's requests), counted as requested on the
    # node for every other pod: CPU (milli), memory (bytes), pod slots
    host_cpu_milli: int = 0
    host_mem_bytes: int = 0
    host_pods: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "namespace": self.namespace,
            "owner_kind": self.owner_kind,
            "owner_name": self.owner_name,
            "class": self.pod_class,
            "containers": {c: [asdict(s) for s in sh] for c, sh in self.containers.items()},
            "expires": self.expires,
            "evicted_pod": self.evicted_pod,
        }
        if self.host_cpu_milli or self.host_mem_bytes or self.host_pods:
            out["host"] = {
                "cpu_milli": self.host_cpu_milli,
                "mem_bytes": self.host_mem_bytes,
                "pods": self.host_pods,
            }
        return out


def encode_reservations(reservations: list[Reservation]) -> str:
    return json.dumps(
        {"v": SCHEMA_VERSION, "reservations": [r.to_dict() for r in reservations]},
        separators=(",", ":"),
        sort_keys=True,
    )


def decode_reservations(text: Any, node: str = "?") -> list[Reservation]:
    where = f"node {node} annotation {ANN_RESERVATIONS}"
    d = _load_json(text, where)
    if not isinstance(d, dict) or d.get("v") != SCHEMA_VERSION:
        raise ContractError(f"{where}: expected an object with v={SCHEMA_VERSION}")
    out = []
    for i, r in enumerate(_req(d, "reservations", list, where)):
        w = f"{where} reservations[{i}]"
        if not isinstance(r, dict):
            raise ContractError(f"{w}: expected an object")
        out.append(
            Reservation(
                id=_req(r, "id", str, w),
                namespace=_req(r, "namespace", str, w),
                owner_kind=_req(r, "owner_kind", str, w),
                owner_name=_req(r, "owner_name", str, w),
                pod_class=_decode_class(r.get("class"), w),
                containers=_decode_containers(_req(r, "containers", dict, w) if "containers" in r else {}, w),
                expires=_req(r, "expires", str, w),
                evicted_pod=str(r.get("evicted_pod", "")),
                **_decode_host(r.get("host"), w),
            )
        )
    return out


def _decode_host(value: Any, where: str) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ContractError(f"{where}: host: expected an object")
    out = {}
    for key, field_name in (
        ("cpu_milli", "host_cpu_milli"),
        ("mem_bytes", "host_mem_bytes"),
        ("pods", "host_pods"),
    ):
        v = value.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ContractError(f"{where}: host.{key}: expected a non-negative integer")
        out[field_name] = v
    return out


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against a pod's labels; in policy/v1 an empty selector matches every
    pod of the namespace, a null one none."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and key in labels and labels[key] in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
