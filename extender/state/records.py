"""The records the cluster view keeps per node and per gpupack pod, and how they are read from
Node and Pod objects (inventory, assignment, slots, taints, readiness)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpupack import handoff
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_PENDING,
    RES_GPU,
    SLOTS_PER_GPU,
    Assignment,
    ContractError,
    NodeInventory,
    Reservation,
    decode_inventory,
)
from gpupack.core.fit import holds, pod_charge
from gpupack.core.model import FULL, GPU, Node, Placement, Share
from gpupack.handoff import PodView

from .hostuse import HostUse

TERMINAL = ("Succeeded", "Failed")  # pod phases: the pod holds nothing any more


@dataclass
class NodeInfo:
    name: str
    inventory_raw: str | None = None
    inventory_error: str = ""
    # the inventory lists more healthy GPUs than the kubelet's gpupack.io/gpu allocatable has room
    # for (kubelet_contradiction): no GPU pod goes there until they agree
    inventory_conflict: str = ""
    slots_per_gpu: int = SLOTS_PER_GPU  # the inventory's, to read `slots` in GPUs
    reservations_raw: str | None = None
    reservations: tuple[Reservation, ...] = ()
    reservations_error: str = ""
    unschedulable: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    gpu_indexes: list[int] = field(default_factory=list)  # position in Node.gpus -> NVML index
    # `gpupack.io/gpu` slots the kubelet offers (status.allocatable): 0 when the device plugin is
    # not registered there (never started, or gone), whatever the inventory annotation says.
    slots: int = 0
    version: int = 0  # bumped on every change that can change a fit on this node
    # What kube-scheduler's own filters read and gpupack's fit does not: watched only so that a
    # change that lets waiting pods on (see ClusterView.on_room) is noticed.
    taints: frozenset[tuple[str, str, str]] = frozenset()
    ready: bool = False
    allocatable: HostUse = HostUse()  # status.allocatable cpu (milli), memory (bytes), ...
    pods_allowed: int = 0  # status.allocatable pods
    # (with track_host) what every pod on the node requests, and how many pods there are: what
    # kube-scheduler's NodeResourcesFit compares with allocatable (see node_resources.py)
    requested: HostUse = HostUse()
    pod_count: int = 0


@dataclass
class PodInfo:
    key: str
    uid: str
    node: str  # the assignment's node (spec.nodeName may still be empty right after bind)
    assignment: Assignment
    assignment_raw: str
    init_names: frozenset[str]
    handoff: str
    deleting: bool
    assumed: bool = False
    bound_node: str = ""  # spec.nodeName
    slots: int = 0  # `gpupack.io/gpu` slots the kubelet charges the pod (see pod_slots)
    resource_version: str = ""
    host: HostUse = HostUse()  # its CPU/memory request, charged on `node` (see HostLedger.pods)

    @property
    def pending(self) -> bool:
        # a bound pod being deleted may still be mid-admission on its node: it keeps the lock until
        # gone or terminal (handoff.is_pending_handoff), or until the stale-handoff limit resolves it
        return self.handoff == HANDOFF_PENDING and (not self.deleting or bool(self.bound_node))

    def pod_view(self) -> PodView:  # not handoff.PodView: the class has a field named handoff
        ns, name = self.key.split("/", 1)
        return handoff.PodView(
            namespace=ns,
            name=name,
            uid=self.uid,
            node_name=self.bound_node or self.node,
            phase="Pending",
            deleting=self.deleting,
            annotations={ANN_ASSIGNMENT: self.assignment_raw, ANN_HANDOFF: self.handoff},
        )


def foreign_assignment(a: Assignment, uid: str, bound_node: str) -> str:
    """Why `a` is not this pod's to be charged (empty when it is): written for another pod UID, or
    for another node than the one the pod is bound to. Only gpupack's scheduler writes assignments
    (admission), and it binds each pod to its assignment's node; anything else was forged or
    copied, and the device plugin will not serve it, so the extender must not charge it either."""
    if a.pod_uid != uid:
        return f"its {ANN_ASSIGNMENT} was written for pod UID {a.pod_uid!r}, the pod is {uid!r}"
    if bound_node and a.node != bound_node:
        return f"its {ANN_ASSIGNMENT} is for node {a.node!r}, the pod is bound to {bound_node!r}"
    return ""


def node_from_inventory(
    name: str, inv: NodeInventory | None, unschedulable: bool, labels: dict[str, str]
) -> Node:
    """The packing core's Node. Its GPU `index` is the position in the list (the core indexes
    GPUs by position); the device's own index is kept in NodeInfo.gpu_indexes."""
    gpus = []
    if inv is not None:
        for pos, g in enumerate(sorted(inv.gpus, key=lambda g: g.index)):
            gpus.append(GPU(g.uuid, pos, g.model, g.mem_mib, g.sm_count, g.healthy))
    return Node(name, gpus, labels=labels, schedulable=not unschedulable)


def charged_from_assignment(
    node: Node, a: Assignment, init_names: frozenset[str]
) -> tuple[Placement, dict[int, tuple[int, int, bool]], list[str]]:
    """Placement and per-GPU charge an assignment stands for, plus problems (unknown GPUs).

    App containers add up per GPU; an init container whose GPUs all carry app containers runs
    before them and is charged max(init, app) there (see gpupack.core.fit), otherwise it adds up.
    The bind path uses this too, so a live extender and a restarted one charge the same.
    """
    pos = {g.uuid: i for i, g in enumerate(node.gpus)}
    problems: list[str] = []
    containers: dict[str, tuple[Share, ...]] = {}
    for cname, shares in a.containers.items():
        out = []
        for s in shares:
            i = pos.get(s.uuid)
            if i is None:
                problems.append(f"GPU {s.uuid} of container {cname} is not in node {node.name}'s inventory")
                continue
            g = node.gpus[i]
            mem, milli = (g.mem_mib, FULL) if s.exclusive else (s.mem_mib, s.sm_pct * 10)
            out.append(Share(i, mem, milli, s.exclusive))
        containers[cname] = tuple(out)
    charged = pod_charge(
        [holds(shares) for cname, shares in containers.items() if cname not in init_names],
        [holds(shares) for cname, shares in containers.items() if cname in init_names],
    )
    return Placement(node.name, containers), charged, problems


def pod_slots(obj: Any) -> int:
    """`gpupack.io/gpu` slots the kubelet charges a pod: init containers run one at a time before
    the app containers, so max(sum over app containers, largest init container)."""
    try:
        cs = handoff.pod_view(obj).containers
        app = sum(c.gpu_count() for c in cs if not c.init)
        init = max((c.gpu_count() for c in cs if c.init), default=0)
    except ContractError:
        return 0
    return max(app, init)


def allocatable_slots(obj: dict[str, Any]) -> int:
    raw = ((obj.get("status") or {}).get("allocatable") or {}).get(RES_GPU)
    if raw is None:
        return 0
    try:
        return int(str(raw))
    except ValueError:
        return 0


def kubelet_contradiction(name: str, healthy: int, slots_per_gpu: int, slots: int) -> str:
    """Why node `name`'s inventory contradicts its kubelet ("" when it does not): it lists more
    healthy GPUs than the kubelet's `gpupack.io/gpu` allocatable divided by the slots per GPU. The
    kubelet counts the device plugin's healthy device IDs of this node only, so an inventory written
    by anyone else (another node's plugin token, a forged 8-GPU node) shows here. A node without
    slots is `no-slots` already (the plugin not registered yet)."""
    if slots <= 0 or healthy * slots_per_gpu <= slots:
        return ""
    return (
        f"node {name}: its gpupack.io/inventory annotation lists {healthy} healthy GPU(s), but its kubelet"
        f" offers {slots} {RES_GPU} slot(s), room for {slots // slots_per_gpu} GPU(s) at {slots_per_gpu}"
        " a GPU; no GPU pod goes there until they agree (an inventory the node's own device plugin did"
        " not write, or a GPU the kubelet has not yet seen recover)"
    )


def blocking_taints(obj: dict[str, Any]) -> frozenset[tuple[str, str, str]]:
    taints = (obj.get("spec") or {}).get("taints") or []
    return frozenset(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in taints
        if isinstance(t, dict) and t.get("effect") in ("NoSchedule", "NoExecute")
    )


def node_ready(obj: dict[str, Any]) -> bool:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def gpu_room(inv_raw: str | None) -> tuple[int, int, int]:
    """Healthy GPUs, their MiB and the largest one's, as the inventory annotation says (0s when
    it is absent or unreadable): what grows when a node can take more."""
    if not inv_raw:
        return 0, 0, 0
    try:
        inv = decode_inventory(inv_raw, "")
    except ContractError:
        return 0, 0, 0
    mems = [g.mem_mib for g in inv.gpus if g.healthy]
    return len(mems), sum(mems), max(mems, default=0)


def room_grew(old: NodeInfo | None, new: NodeInfo, inv_raw: str | None, labels: dict[str, str]) -> str:
    """Why a node's update may let pods on that did not fit before ("" if it cannot): kube-scheduler
    v1.28 retries its parked pods on such node events only when a pre-check passes, and that
    pre-check counts gpupack's resources as missing on every node, ignored by the profile or not (see
    Requeuer in requeue.py)."""
    if old is None:
        return "node-added"
    if old.unschedulable and not new.unschedulable:
        return "node-uncordoned"
    if new.ready and not old.ready:
        return "node-ready"
    if old.taints - new.taints:
        return "taint-removed"
    if new.slots > old.slots:
        return "slots-grew"
    if inv_raw != old.inventory_raw:
        before, after = gpu_room(old.inventory_raw), gpu_room(inv_raw)
        if any(a > b for a, b in zip(after, before, strict=True)):
            return "inventory-grew"
    if any(old.labels.get(k) != v for k, v in labels.items()):
        return "labels-changed"  # a pod's node selector or GPU model may match now
    if old.reservations and new.reservations_raw != old.reservations_raw:
        return "reservations-changed"
    return ""


def init_names(pod: dict[str, Any]) -> frozenset[str]:
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or [] if isinstance(spec, dict) else []
    return frozenset(c.get("name", "") for c in inits if isinstance(c, dict))
