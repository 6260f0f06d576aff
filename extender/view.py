"""The extender's picture of the cluster: GPU inventory per node and what gpupack pods hold, and
(with `track_host`) each node's CPU and memory, allocatable and requested by every pod on it.

Built only from Kubernetes objects (Node inventory/reservation annotations, Pod assignment
annotations), so a restarted extender rebuilds exactly what it had. Pure state: the watch loops
(`extender/sync.py`) and the bind step feed it; nothing here does I/O.

Two kinds of pod records:
- confirmed: seen in the API with an assignment annotation;
- assumed: placed by this process's bind before the API has echoed the Binding (which carries the
  annotation) back. An event without the annotation for an assumed pod is older than that
  Binding and is ignored, so a late event can never free a GPU that a bind just took (the
  kube-scheduler's "assumed pod" idea).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import ROUND_CEILING, ROUND_FLOOR
from typing import Any, NamedTuple, TypeGuard

from gpupack import handoff
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    ANN_RESERVATIONS,
    HANDOFF_PENDING,
    RES_GPU,
    Assignment,
    ContractError,
    NodeInventory,
    Reservation,
    decode_assignment,
    decode_inventory,
    decode_reservations,
    parse_quantity,
)
from gpupack.core.fit import holds, pod_charge
from gpupack.core.model import FULL, GPU, ClusterState, Node, Placement, PlacementError, PodRequest, Share
from gpupack.handoff import PodView

from . import reservations as resv

log = logging.getLogger("gpupack.extender.view")

TERMINAL = ("Succeeded", "Failed")
JOURNAL_MAX = 200_000
MIB = 1024 * 1024


class HostUse(NamedTuple):
    """Host resources a pod requests (or a node has allocatable), as kube-scheduler's
    NodeResourcesFit counts them: CPU (milli), memory and ephemeral storage (bytes), and every
    other resource it checks (hugepages-*, extended resources outside gpupack.io) by name, sorted,
    as whole units (Quantity.Value(), rounded up)."""

    cpu_milli: int = 0
    mem_bytes: int = 0
    eph_bytes: int = 0
    other: tuple[tuple[str, int], ...] = ()


class HostPod(NamedTuple):
    """What the extender keeps of an assigned pod (any pod, gpupack's or not) for its node's host
    resources: a 50,000-pod cluster costs a few MiB, not its full Pod objects."""

    uid: str
    node: str
    use: HostUse


NO_HOST_USE = HostUse()
# Resources the container API names without a domain that NodeResourcesFit checks as scalars.
_HUGEPAGES = "hugepages-"
_GPUPACK_GROUP = RES_GPU.split("/", 1)[0] + "/"


def _amount(raw: Any, scale: int, rounding: str) -> int:
    """A quantity times `scale`, rounded as kube-scheduler does (requests: MilliValue rounds up);
    an unreadable one counts 0 (the API server validated it, so none should be)."""
    if raw is None:
        return 0
    try:
        q = parse_quantity(raw, "quantity")
    except ContractError:
        return 0
    return max(0, int((q * scale).to_integral_value(rounding=rounding)))


def _counted_other(name: str) -> bool:
    """Whether NodeResourcesFit checks `name` as a scalar resource for gpupack's profile: hugepages
    and every resource with a domain (extended resources) except gpupack's own, which its
    ignoredResourceGroups skips and the extender accounts per GPU."""
    return name.startswith(_HUGEPAGES) or ("/" in name and not name.startswith(_GPUPACK_GROUP))


def _resources_use(req: Any, lim: Any, rounding: str = ROUND_CEILING) -> HostUse:
    """The host resources of one resource list pair (requests, limits): the API server defaults a
    missing request to its limit, so a limit alone is read as it would have been."""
    req = req if isinstance(req, dict) else {}
    lim = lim if isinstance(lim, dict) else {}
    cpu = req.get("cpu", lim.get("cpu"))
    mem = req.get("memory", lim.get("memory"))
    eph = req.get("ephemeral-storage", lim.get("ephemeral-storage"))
    names = sorted(n for n in {*req, *lim} if isinstance(n, str) and _counted_other(n))
    other = tuple((n, _amount(req.get(n, lim.get(n)), 1, rounding)) for n in names)
    return HostUse(_amount(cpu, 1000, rounding), _amount(mem, 1, rounding), _amount(eph, 1, rounding), other)


def _container_use(c: Any) -> HostUse:
    if not isinstance(c, dict):
        return NO_HOST_USE
    res = c.get("resources") or {}
    if not isinstance(res, dict):
        return NO_HOST_USE
    return _resources_use(res.get("requests"), res.get("limits"))


def _merge_other(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...], add: bool
) -> tuple[tuple[str, int], ...]:
    if not b:
        return a
    if not a:
        return b
    d = dict(a)
    for k, v in b:
        d[k] = d.get(k, 0) + v if add else max(d.get(k, 0), v)
    return tuple(sorted(d.items()))


def _host_plus(a: HostUse, b: HostUse) -> HostUse:
    return HostUse(a.cpu_milli + b.cpu_milli, a.mem_bytes + b.mem_bytes, a.eph_bytes + b.eph_bytes,
                   _merge_other(a.other, b.other, True))  # fmt: skip


def _host_max(a: HostUse, b: HostUse) -> HostUse:
    return HostUse(max(a.cpu_milli, b.cpu_milli), max(a.mem_bytes, b.mem_bytes), max(a.eph_bytes, b.eph_bytes),
                   _merge_other(a.other, b.other, False))  # fmt: skip


def pod_host_request(obj: Any) -> HostUse:
    """A pod's host resource request as kube-scheduler computes it (k8s.io/component-helpers
    resource.PodRequests): per resource, max(sum of app containers plus restartable (sidecar) init
    containers, the largest init container plus the sidecars started before it), plus the pod's
    overhead."""
    spec = (obj.get("spec") or {}) if isinstance(obj, dict) else {}
    if not isinstance(spec, dict):
        return NO_HOST_USE
    app = NO_HOST_USE
    for c in spec.get("containers") or []:
        app = _host_plus(app, _container_use(c))
    side = init = NO_HOST_USE
    for c in spec.get("initContainers") or []:
        u = _container_use(c)
        if isinstance(c, dict) and c.get("restartPolicy") == "Always":
            side = _host_plus(side, u)
            init = _host_max(init, side)
        else:
            init = _host_max(init, _host_plus(u, side))
    use = _host_max(_host_plus(app, side), init)
    over = spec.get("overhead")
    if isinstance(over, dict) and over:
        use = _host_plus(use, _resources_use(over, None))
    return use


def ram_mib(mem_bytes: int) -> int:
    """Requested bytes as the core's whole MiB, rounded up (never less than is asked)."""
    return -(-mem_bytes // MIB)


def _grew(before: HostUse, after: HostUse) -> bool:
    """Whether any resource of `after` exceeds `before`'s."""
    if (
        after.cpu_milli > before.cpu_milli
        or after.mem_bytes > before.mem_bytes
        or after.eph_bytes > before.eph_bytes
    ):
        return True
    had = dict(before.other)
    return any(v > had.get(k, 0) for k, v in after.other)


def _allocatable_host(obj: dict[str, Any]) -> tuple[HostUse, int]:
    """A node's allocatable host resources and how many pods it allows (status.allocatable)."""
    alloc = (obj.get("status") or {}).get("allocatable") or {}
    return _resources_use(alloc, None, ROUND_FLOOR), _amount(alloc.get("pods"), 1, ROUND_FLOOR)


@dataclass
class NodeInfo:
    name: str
    inventory_raw: str | None = None
    inventory_error: str = ""
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
    host: HostUse = HostUse()  # its CPU/memory request, charged on `node` (see ClusterView.host_pods)

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


def _allocatable_slots(obj: dict[str, Any]) -> int:
    raw = ((obj.get("status") or {}).get("allocatable") or {}).get(RES_GPU)
    if raw is None:
        return 0
    try:
        return int(str(raw))
    except ValueError:
        return 0


def _blocking_taints(obj: dict[str, Any]) -> frozenset[tuple[str, str, str]]:
    taints = (obj.get("spec") or {}).get("taints") or []
    return frozenset(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in taints
        if isinstance(t, dict) and t.get("effect") in ("NoSchedule", "NoExecute")
    )


def _ready(obj: dict[str, Any]) -> bool:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _gpu_room(inv_raw: str | None) -> tuple[int, int, int]:
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
    Requeuer in framework.py)."""
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
        before, after = _gpu_room(old.inventory_raw), _gpu_room(inv_raw)
        if any(a > b for a, b in zip(after, before, strict=True)):
            return "inventory-grew"
    if any(old.labels.get(k) != v for k, v in labels.items()):
        return "labels-changed"  # a pod's node selector or GPU model may match now
    if old.reservations and new.reservations_raw != old.reservations_raw:
        return "reservations-changed"
    return ""


def _init_names(pod: dict[str, Any]) -> frozenset[str]:
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or [] if isinstance(spec, dict) else []
    return frozenset(c.get("name", "") for c in inits if isinstance(c, dict))


class ClusterView:
    """Thread-safe cluster state. Every public method takes the lock."""

    def __init__(
        self, on_problem: Callable[[str, str], None] | None = None, track_host: bool = False
    ) -> None:
        self.lock = threading.RLock()
        # Host CPU/memory in the core's Nodes (cpu_milli/ram_mib allocatable, cpu_used/ram_used
        # requested by every non-terminal pod assigned there), so the policy's CPU terms see them.
        # Off, the core treats CPU and memory as not tracked and node_resources_fit is not run
        # (then kube-scheduler's NodeResourcesFit filter must be on).
        self.track_host = track_host
        # Assigned pods of the whole cluster (a second, field-selected watch): pod key -> HostPod.
        # A gpupack pod not in it yet (assumed, or its Binding not echoed) is charged from its
        # PodInfo instead; by key and uid, never both (see _host_recount).
        self.host_pods: dict[str, HostPod] = {}
        self.host_by_node: dict[str, set[str]] = {}
        # CPU-only pods this process binds (no assignment, so no PodInfo): pod key -> (HostPod, Binding
        # posted), charged from assume_host until the assigned-pod watch shows them (then from there).
        self.host_assumed: dict[str, tuple[HostPod, bool]] = {}
        self.host_assumed_by_node: dict[str, set[str]] = {}
        self.changed = threading.Condition(self.lock)
        self.state = ClusterState()
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodInfo] = {}
        self.pending_by_node: dict[str, set[str]] = {}
        self.consumed: dict[str, set[str]] = {}  # node -> reservation ids consumed by live pods
        self.synced = threading.Event()
        # (kind, message) for corrupt annotations and conflicts; the metrics layer counts them
        self.on_problem = on_problem or (lambda kind, msg: None)
        # (node, why) when a change may let waiting pods fit (see room_grew); called under the
        # lock from the watch and bind threads, so it must not block (the Requeuer only flags).
        self.on_room: Callable[[str, str], None] = lambda node, why: None
        self.problems: dict[str, str] = {}  # object -> last problem, for status and readiness
        # Every change that can change a fit, in order: journal[i - journal_base] is the node
        # changed at sequence number i. The extender's per-shape answers only re-examine the nodes
        # named since their own position. A node's version is the sequence number of its last
        # change, so versions never repeat, not even for a node deleted and created again.
        self.journal: list[str] = []
        self.journal_base = 0
        self.reserved: set[str] = set()  # nodes with defrag reservations: their answers depend on time
        self.slot_use: dict[str, dict[str, int]] = {}  # node -> pod key -> `gpupack.io/gpu` slots
        self.inflight: set[str] = set()  # pods this process is binding now (assumed, Binding not answered)
        # Pods whose Binding got no answer and whose fate could not be found out yet: pod key ->
        # (uid, the Binding's resourceVersion precondition, its assignment). It stays charged, and
        # counts as a pending handoff, until the janitor settles them (Extender.settle_doubtful).
        self.doubtful: dict[str, tuple[str, str, str]] = {}  # key -> (uid, rv, assignment held)
        # node -> pod key -> uid of every bind request this process holds, from its arrival on (before
        # it reads the pod, queues for the node or writes anything): filter steers the next pods
        # away from these nodes at once, not only once the assignment is written.
        self.claims: dict[str, dict[str, str]] = {}
        # pod uid -> (until when, key, nodes): where kube-scheduler will most likely bind a pod this
        # process has just prioritized (its top-scored nodes, when only a few share the top). The
        # scheduler starts the bind and its next pod's filter at the same moment, so that filter
        # can overtake the bind; it steers away from these nodes as from a bind in progress.
        self.expected: dict[str, tuple[float, str, tuple[str, ...]]] = {}

    # --- nodes ---------------------------------------------------------------------------------
    def _problem(self, kind: str, obj: str, msg: str) -> None:
        if self.problems.get(obj) != msg:
            log.warning("%s", msg)
        self.problems[obj] = msg
        self.on_problem(kind, msg)

    def apply_node(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            return
        ann = meta.get("annotations") or {}
        labels = dict(meta.get("labels") or {})
        unsched = bool((obj.get("spec") or {}).get("unschedulable"))
        inv_raw = ann.get(ANN_INVENTORY)
        res_raw = ann.get(ANN_RESERVATIONS)
        slots = _allocatable_slots(obj)
        taints, ready = _blocking_taints(obj), _ready(obj)
        alloc, pods_allowed = _allocatable_host(obj)
        with self.lock:
            info = self.nodes.get(name)
            if (
                info is not None
                and info.slots == slots
                and info.inventory_raw == inv_raw
                and info.reservations_raw == res_raw
                and info.unschedulable == unsched
                and info.labels == labels
                and info.allocatable == alloc
                and info.pods_allowed == pods_allowed
            ):
                # heartbeats and status updates: nothing gpupack's fit reads changed
                if info.taints != taints or info.ready != ready:
                    was = replace(info)
                    info.taints, info.ready = taints, ready
                    if why := room_grew(was, info, inv_raw, labels):
                        self.on_room(name, why)
                return
            before = replace(info) if info is not None else None
            if info is None:
                info = NodeInfo(name)
                self.nodes[name] = info
            info.taints, info.ready = taints, ready
            why = room_grew(before, replace(info, unschedulable=unsched, slots=slots, reservations_raw=res_raw),
                            inv_raw, labels)  # fmt: skip
            rebuild = inv_raw != info.inventory_raw or name not in self.state.nodes
            if (
                not why
                and self.track_host
                and (_grew(info.allocatable, alloc) or pods_allowed > info.pods_allowed)
            ):
                why = "allocatable-grew"
            info.unschedulable, info.labels, info.slots, info.allocatable = unsched, labels, slots, alloc
            info.pods_allowed = pods_allowed
            if rebuild:
                info.inventory_raw = inv_raw
                inv = None
                info.inventory_error = ""
                if inv_raw is not None:
                    try:
                        inv = decode_inventory(inv_raw, name)
                        self.problems.pop(f"node/{name}/inventory", None)
                    except ContractError as e:
                        info.inventory_error = str(e)
                        self._problem("corrupt-inventory", f"node/{name}/inventory", str(e))
                info.gpu_indexes = [g.index for g in sorted(inv.gpus, key=lambda g: g.index)] if inv else []
                self._rebuild_node(name, node_from_inventory(name, inv, unsched, labels))
            else:
                node = self.state.nodes[name]
                node.schedulable, node.labels = not unsched, labels
                self._host_recount(name)
            if res_raw != info.reservations_raw:
                info.reservations_raw = res_raw
                info.reservations, info.reservations_error = (), ""
                if res_raw:
                    try:
                        info.reservations = tuple(decode_reservations(res_raw, name))
                        self.problems.pop(f"node/{name}/reservations", None)
                    except ContractError as e:
                        info.reservations_error = str(e)
                        self._problem("corrupt-reservations", f"node/{name}/reservations", str(e))
            if info.reservations:
                self.reserved.add(name)
            else:
                self.reserved.discard(name)
            self._touch(info)
            if why:
                self.on_room(name, why)
            self.changed.notify_all()

    def delete_node(self, name: str) -> None:
        with self.lock:
            info = self.nodes.pop(name, None)
            if info is not None:
                self._touch(info)
            self.reserved.discard(name)
            node = self.state.nodes.pop(name, None)
            if node is not None:
                for key in [k for k, (_, p, _) in self.state.pods.items() if p.node == name]:
                    self.state.pods.pop(key, None)
            self.changed.notify_all()

    def _rebuild_node(self, name: str, node: Node) -> None:
        for key in [k for k, (_, p, _) in self.state.pods.items() if p.node == name]:
            self.state.pods.pop(key, None)
        self.state.nodes[name] = node
        for p in self.pods.values():
            if p.node == name:
                self._charge(p)
        self._host_recount(name)

    # --- host resources ---------------------------------------------------------------------------
    def _host_recount(self, name: str) -> bool:
        """Set the node's requested host resources and pod count (NodeInfo.requested, pod_count)
        and the core Node's CPU/memory from its allocatable and the pods assigned to it; True when
        any of them changed. A gpupack pod the assigned-pod watch shows already (same uid, same
        node) is counted from there, else from its PodInfo: binds charge at assume time, before any
        watch has seen them, and nothing is counted twice."""
        node = self.state.nodes.get(name)
        info = self.nodes.get(name)
        if node is None or info is None or not self.track_host:
            return False
        uses: list[HostUse] = [self.host_pods[k].use for k in self.host_by_node.get(name, ())]
        for k in self.slot_use.get(name, ()):
            p = self.pods.get(k)
            if p is None or p.node != name:
                continue
            hp = self.host_pods.get(k)
            if hp is not None and hp.uid == p.uid and hp.node == name:
                continue
            uses.append(p.host)
        for k in self.host_assumed_by_node.get(name, ()):
            a = self.host_assumed[k][0]
            hp = self.host_pods.get(k)
            if hp is not None and hp.uid == a.uid and hp.node == name:
                continue
            uses.append(a.use)
        requested = NO_HOST_USE
        for u in uses:
            requested = _host_plus(requested, u)
        changed = requested != info.requested or len(uses) != info.pod_count
        info.requested, info.pod_count = requested, len(uses)
        new = (
            info.allocatable.cpu_milli,
            info.allocatable.mem_bytes // MIB,
            requested.cpu_milli,
            ram_mib(requested.mem_bytes),
        )
        if new == (node.cpu_milli, node.ram_mib, node.cpu_used, node.ram_used):
            return changed
        node.cpu_milli, node.ram_mib, node.cpu_used, node.ram_used = new
        return True

    def apply_host_pod(self, obj: dict[str, Any], deleted: bool = False) -> None:
        """An event of the assigned-pod watch (every pod with a node, not terminal)."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            return
        key = f"{meta.get('namespace') or 'default'}/{name}"
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        gone = deleted or not node or (obj.get("status") or {}).get("phase") in TERMINAL
        new = None if gone else HostPod(str(meta.get("uid") or ""), node, pod_host_request(obj))
        with self.lock:
            old = self.host_pods.get(key)
            if old == new:
                return
            if old is not None:
                keys = self.host_by_node.get(old.node)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.host_by_node[old.node]
                del self.host_pods[key]
            if new is not None:
                self.host_pods[key] = new
                self.host_by_node.setdefault(new.node, set()).add(key)
            touched = {x.node for x in (old, new) if x is not None}
            assumed = self.host_assumed.get(key)
            if assumed is not None and assumed[0].uid == str(meta.get("uid") or ""):
                # the watch shows the pod now (or its end): its charge is counted from host_pods
                touched.add(assumed[0].node)
                self._drop_host_assumed(key)
            for n in touched:
                ni = self.nodes.get(n)
                if ni is None:
                    continue
                before, count = ni.requested, ni.pod_count
                if self._host_recount(n):
                    self._bump(n)
                    if ni.pod_count < count or _grew(ni.requested, before):
                        # kube-scheduler retries parked pods on a pod's deletion, but that retry can
                        # reach this extender before this watch has freed the CPU
                        self.on_room(n, "host-freed")
            self.changed.notify_all()

    def delete_host_pod(self, obj: dict[str, Any]) -> None:
        self.apply_host_pod(obj, deleted=True)

    def _apply_pod_pages(
        self, pages: Iterable[list[dict[str, Any]]], apply: Callable[[dict[str, Any]], None]
    ) -> set[str]:
        """Apply a list's pages, the lock held per page (the view stays usable between pages); the
        keys of the pods listed."""
        seen: set[str] = set()
        for page in pages:
            with self.lock:
                for o in page:
                    m = o.get("metadata") or {}
                    seen.add(f"{m.get('namespace') or 'default'}/{m.get('name')}")
                    apply(o)
        return seen

    def replace_host_pod_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        """A fresh list of the assigned pods: apply it and drop the pods missing from it."""
        seen = self._apply_pod_pages(pages, self.apply_host_pod)
        with self.lock:
            self._drop_unlisted_host(seen)
            self.changed.notify_all()

    def _drop_unlisted_host(self, seen: set[str]) -> None:
        for key in [k for k in self.host_pods if k not in seen]:
            ns, _, name = key.partition("/")
            self.apply_host_pod({"metadata": {"namespace": ns, "name": name}}, deleted=True)
        # a bound CPU-only pod missing from it has ended, or was bound after the list's snapshot
        # (then the watch that resumes from it shows the pod, and charges it from host_pods)
        for key in [k for k, (_, bound) in self.host_assumed.items() if bound and k not in seen]:
            node = self.host_assumed[key][0].node
            self._drop_host_assumed(key)
            if self._host_recount(node):
                self._bump(node)

    # --- CPU-only pods this process binds ---------------------------------------------------------
    def _drop_host_assumed(self, key: str) -> None:
        hp, _ = self.host_assumed.pop(key)
        keys = self.host_assumed_by_node.get(hp.node)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.host_assumed_by_node[hp.node]

    def assume_host(self, key: str, uid: str, node: str, use: HostUse) -> None:
        """Charge a CPU-only pod's CPU/memory on `node` from now on, before its Binding is posted:
        the next filter must see it before the assigned-pod watch does (see host_assumed)."""
        with self.lock:
            if node not in self.state.nodes:
                raise PlacementError(f"node {node} is not known")
            if key in self.host_assumed:
                old = self.host_assumed[key][0].node
                self._drop_host_assumed(key)
                self._host_recount(old)
                self._bump(old)
            self.host_assumed[key] = (HostPod(uid, node, use), False)
            self.host_assumed_by_node.setdefault(node, set()).add(key)
            self._host_recount(node)
            self._bump(node)
            self.changed.notify_all()

    def host_bound(self, key: str, uid: str) -> None:
        """The Binding of a CPU-only pod charged by assume_host went through."""
        with self.lock:
            a = self.host_assumed.get(key)
            if a is not None and a[0].uid == uid:
                self.host_assumed[key] = (a[0], True)

    def unassume_host(self, key: str, uid: str) -> None:
        """Undo assume_host after a failed Binding (only if it is still this pod's)."""
        with self.lock:
            a = self.host_assumed.get(key)
            if a is None or a[0].uid != uid:
                return
            self._drop_host_assumed(key)
            if self._host_recount(a[0].node):
                self.on_room(a[0].node, "host-freed")
            self._bump(a[0].node)
            self.changed.notify_all()

    # --- pods ----------------------------------------------------------------------------------
    def _charge(self, p: PodInfo) -> None:
        """Put a pod's assignment on its node; a conflict is reported and charged anyway."""
        self.slot_use.setdefault(p.node, {})[p.key] = p.slots
        node = self.state.nodes.get(p.node)
        if node is None:
            return  # the node is not (yet) known; charged when it appears
        placement, charged, problems = charged_from_assignment(node, p.assignment, p.init_names)
        for msg in problems:
            self._problem("assignment-gpu-missing", f"pod/{p.key}", f"pod {p.key}: {msg}")
        req = PodRequest(key=p.key, pod_class=p.assignment.pod_class, uid=p.uid)
        try:
            self.state.place(req, placement, charged)
        except PlacementError as e:
            # Already on the GPU per the API: account for it, so nothing more lands there.
            self._problem("conflict", f"pod/{p.key}", f"pod {p.key}: assignment conflicts with others: {e}")
            self._force_place(node, req, placement, charged)
        if p.assignment.reservation:
            self.consumed.setdefault(p.node, set()).add(p.assignment.reservation)
        self._host_recount(p.node)
        self._bump(p.node)

    def _force_place(self, node: Node, req: PodRequest, placement: Placement, charged: dict) -> None:
        for idx, (mem, milli, ex) in charged.items():
            node.gpus[idx].charge(req.key, mem, milli, ex, req.pod_class)
        self.state.pods[req.key] = (req, placement, charged)

    def _touch(self, info: NodeInfo) -> None:
        seq = self.journal_base + len(self.journal)
        info.version = seq + 1
        self.journal.append(info.name)
        if len(self.journal) > JOURNAL_MAX:
            # Readers further behind than what is kept start over from a full pass.
            drop = len(self.journal) // 2
            del self.journal[:drop]
            self.journal_base += drop

    def changed_since(self, pos: int) -> list[str] | None:
        """Nodes changed from sequence number `pos` on (repeats possible); None when the journal
        no longer reaches back that far."""
        if pos < self.journal_base:
            return None
        return self.journal[pos - self.journal_base :]

    @property
    def seq(self) -> int:
        """The sequence number the next change will get."""
        return self.journal_base + len(self.journal)

    def _bump(self, node: str) -> None:
        info = self.nodes.get(node)
        if info is not None:
            self._touch(info)

    def _release(self, key: str, freed: bool = True) -> None:
        """Take a pod's charge off its node; `freed`: its GPUs are free for others now (not when
        it is about to be charged again), which may let waiting pods fit (see on_room)."""
        p = self.pods.pop(key, None)
        if p is None:
            return
        self.state.release(key)
        use = self.slot_use.get(p.node)
        if use is not None:
            use.pop(key, None)
        if p.assignment.reservation:
            ids = self.consumed.get(p.node)
            if ids is not None:
                ids.discard(p.assignment.reservation)
        pend = self.pending_by_node.get(p.node)
        if pend is not None:
            pend.discard(key)
        self._host_recount(p.node)
        self._bump(p.node)
        if freed:
            # kube-scheduler retries its parked pods on the pod's deletion itself, but that retry
            # can reach this extender before its watch has freed the GPUs, and is not repeated.
            self.on_room(p.node, "pod-left")

    def _index_pending(self, p: PodInfo) -> None:
        pend = self.pending_by_node.setdefault(p.node, set())
        if p.pending:
            pend.add(p.key)
        else:
            pend.discard(p.key)

    def apply_pod(self, obj: dict[str, Any], deleted: bool = False) -> None:
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace") or "default", meta.get("name")
        if not isinstance(name, str) or not name:
            return
        key = f"{ns}/{name}"
        uid = str(meta.get("uid") or "")
        phase = (obj.get("status") or {}).get("phase", "")
        ann = meta.get("annotations") or {}
        raw = ann.get(ANN_ASSIGNMENT)
        a = None
        if raw is not None and not deleted and phase not in TERMINAL:
            with self.lock:
                old = self.pods.get(key)
                if self._holds(old, uid, raw):
                    # the assignment held already (a handoff or status update): nothing to decode
                    self._refresh(old, obj)
                    return
            try:
                a = decode_assignment(raw, key)
                self.problems.pop(f"pod/{key}", None)
            except ContractError as e:
                self._problem("corrupt-assignment", f"pod/{key}", str(e))
        with self.lock:
            old = self.pods.get(key)
            if a is None and old is None:
                return  # not a gpupack pod (the watch shows every assigned pod), or gone already
            if a is None:
                alive = old is not None and old.uid == uid and not deleted and phase not in TERMINAL
                # An assumed pod's older events lack the annotation our bind is writing. A bound,
                # running pod whose assignment vanished still uses its GPU: only gpupack may remove
                # it (admission), so keep the share until the pod ends rather than over-commit.
                stripped = alive and raw is None and bool((obj.get("spec") or {}).get("nodeName"))
                if stripped and old is not None and not old.assumed:
                    self._problem("stripped-assignment", f"pod/{key}", f"pod {key} lost its {ANN_ASSIGNMENT} "
                                  "annotation while running; its share stays held until it ends")  # fmt: skip
                if not (alive and old is not None and (old.assumed or stripped)):
                    self.doubtful.pop(key, None)
                    self._release(key)
                self.changed.notify_all()
                return
            assert raw is not None
            bound = str((obj.get("spec") or {}).get("nodeName") or "")
            if old is not None and old.assumed and old.uid == uid and old.assignment_raw != raw and not bound:
                return  # an unbound pod's old record (the Binding being posted replaces it)
            if self._holds(old, uid, raw):  # charged since the check before decoding
                self._refresh(old, obj)
                return
            self.doubtful.pop(key, None)  # the watch shows what the pod holds: no doubt left
            info = PodInfo(
                key=key,
                uid=uid,
                node=a.node,
                assignment=a,
                assignment_raw=raw,
                init_names=_init_names(obj),
                handoff=str(ann.get(ANN_HANDOFF, "")),
                deleting=meta.get("deletionTimestamp") is not None,
                bound_node=bound,
                slots=pod_slots(obj),
                resource_version=str(meta.get("resourceVersion") or ""),
                host=pod_host_request(obj) if self.track_host else HostUse(),
            )
            self._release(key, freed=False)
            self.pods[key] = info
            self._charge(info)
            self._index_pending(info)
            self.changed.notify_all()

    def _holds(self, old: PodInfo | None, uid: str, raw: str) -> TypeGuard[PodInfo]:
        """Whether `old` is this pod (`uid`) with the assignment `raw` charged. View lock held."""
        return old is not None and old.uid == uid and old.assignment_raw == raw and old.key in self.state.pods

    def _refresh(self, old: PodInfo, obj: dict[str, Any]) -> None:
        """An event of a pod with the assignment `old` holds: only its handoff, deletion, node and
        version can have changed (the rest of a pod's spec is immutable). View lock held."""
        meta = obj.get("metadata") or {}
        self.doubtful.pop(old.key, None)  # the watch shows what the pod holds: no doubt left
        old.handoff = str((meta.get("annotations") or {}).get(ANN_HANDOFF, ""))
        old.deleting, old.assumed = meta.get("deletionTimestamp") is not None, False
        old.bound_node = str((obj.get("spec") or {}).get("nodeName") or "") or old.bound_node
        old.resource_version = str(meta.get("resourceVersion") or "")
        self._index_pending(old)
        self.changed.notify_all()

    def delete_pod(self, obj: dict[str, Any]) -> None:
        self.apply_pod(obj, deleted=True)

    def replace_pods(self, objs: Iterable[dict[str, Any]]) -> None:
        """A fresh list: apply it and drop confirmed pods that are gone (assumed ones stay)."""
        seen = self._apply_pod_pages([list(objs)], self.apply_pod)
        with self.lock:
            self._drop_unlisted(seen)
            self.changed.notify_all()

    def _drop_unlisted(self, seen: set[str]) -> None:
        # an assumed pod's Binding may postdate the list; a doubtful one is the janitor's to settle
        for key in [k for k, p in self.pods.items() if k not in seen and not p.assumed]:
            self._release(key)

    # --- the assigned-pod watch: every pod with a node, not terminal -------------------------------
    def apply_assigned(self, obj: dict[str, Any]) -> None:
        """An ADDED/MODIFIED event of the assigned-pod watch: the pod's assignment (a gpupack pod)
        and, with `track_host`, its CPU/memory on its node."""
        if self.track_host:
            self.apply_host_pod(obj)
        self.apply_pod(obj)

    def delete_assigned(self, obj: dict[str, Any]) -> None:
        """A DELETED event: the pod was deleted or ended (Succeeded/Failed leave the selection). The
        watch selects on the node name, which never changes once set, so it means nothing else."""
        if self.track_host:
            self.apply_host_pod(obj, deleted=True)
        self.apply_pod(obj, deleted=True)

    def replace_assigned_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        """A fresh list of the assigned pods: apply it, and drop what is missing from it."""
        seen = self._apply_pod_pages(pages, self.apply_assigned)
        with self.lock:
            if self.track_host:
                self._drop_unlisted_host(seen)
            self._drop_unlisted(seen)
            self.changed.notify_all()

    def replace_nodes(self, objs: Iterable[dict[str, Any]]) -> None:
        self.replace_node_pages([list(objs)])

    def replace_node_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        seen: set[str] = set()
        for page in pages:
            with self.lock:
                for o in page:
                    seen.add((o.get("metadata") or {}).get("name") or "")
                    self.apply_node(o)
        with self.lock:
            for name in [n for n in self.nodes if n not in seen]:
                self.delete_node(name)

    # --- the bind step's reservation -------------------------------------------------------------
    def assume(
        self, key: str, uid: str, a: Assignment, init_names: frozenset[str], slots: int = 0,
        host: HostUse = NO_HOST_USE,
    ) -> None:  # fmt: skip
        """Hold an assignment this process is about to write; PlacementError if it no longer fits.
        `host`: the pod's CPU/memory request, charged on the node from now on (see _host_recount)."""
        with self.lock:
            node = self.state.nodes.get(a.node)
            if node is None:
                raise PlacementError(f"node {a.node} is not known")
            old = self.pods.get(key)
            if old is not None:
                self._release(key, freed=False)  # a re-bind of the same pod replaces its earlier one
            raw = a.to_json()
            placement, charged, problems = charged_from_assignment(node, a, init_names)
            if problems:
                raise PlacementError("; ".join(problems))
            self.state.place(PodRequest(key=key, pod_class=a.pod_class, uid=uid), placement, charged)
            info = PodInfo(
                key, uid, a.node, a, raw, init_names, HANDOFF_PENDING, False, assumed=True, slots=slots,
                host=host if self.track_host else HostUse(),
            )  # fmt: skip
            self.pods[key] = info
            self.slot_use.setdefault(a.node, {})[key] = slots
            self._host_recount(a.node)
            self.inflight.add(key)  # until mark_bound, unassume or the bind's end
            if a.reservation:
                self.consumed.setdefault(a.node, set()).add(a.reservation)
            self._index_pending(info)
            self._bump(a.node)
            self.changed.notify_all()

    def unassume(self, key: str, uid: str, a: Assignment) -> None:
        """Undo :meth:`assume` after a Binding that did not take effect (only if it is still ours)."""
        with self.lock:
            p = self.pods.get(key)
            if p is not None and p.uid == uid and p.assignment_raw == a.to_json():
                self._release(key)
            self.inflight.discard(key)
            self.changed.notify_all()

    def mark_bound(self, key: str, node: str) -> None:
        with self.lock:
            p = self.pods.get(key)
            if p is not None:
                p.bound_node = node
            self.inflight.discard(key)

    # --- queries -------------------------------------------------------------------------------
    def version(self, node: str) -> int:
        info = self.nodes.get(node)
        return -1 if info is None else info.version

    def active_reservations(self, node: str, now: datetime) -> list[Reservation]:
        info = self.nodes.get(node)
        if info is None or not info.reservations:
            return []
        return resv.active(info.reservations, now, self.consumed.get(node, set()))

    def _may_be_admitted(self, p: PodInfo) -> bool:
        """Whether the kubelet may admit this assigned pod on its node: bound there, or being bound
        by this process, or its Binding's fate unknown. A pod with an assignment but no node (left
        by an extender before the one-write Binding) never will, and locks nothing."""
        return bool(p.bound_node) or p.key in self.inflight or p.key in self.doubtful

    def blocking_handoff(self, node: str, exclude_uid: str) -> handoff.PodView | None:
        """The pending handoff that keeps another pod off `node`. Only a pod the kubelet may admit
        there counts (see _may_be_admitted)."""
        with self.lock:
            views = [
                p.pod_view()
                for k in self.pending_by_node.get(node, ())
                if (p := self.pods.get(k)) is not None and self._may_be_admitted(p)
            ]
        return handoff.blocking_handoff(views, node, exclude_uid=exclude_uid)

    def claim(self, node: str, key: str, uid: str) -> None:
        """A bind of pod `key` to `node` has arrived (see `claims`)."""
        with self.lock:
            self.claims.setdefault(node, {})[key] = uid
            self.expected.pop(uid, None)

    def expect(self, uid: str, key: str, nodes: tuple[str, ...], until: float) -> None:
        """Pod `uid` will most likely be bound to one of `nodes` before `until` (see `expected`)."""
        with self.lock:
            if nodes:
                self.expected[uid] = (until, key, nodes)
            else:
                self.expected.pop(uid, None)

    def unclaim(self, node: str, key: str) -> None:
        with self.lock:
            c = self.claims.get(node)
            if c is not None:
                c.pop(key, None)
                if not c:
                    del self.claims[node]

    def locked_nodes(
        self, exclude_uid: str, now: float | None = None, handoffs: bool = True
    ) -> dict[str, str]:
        """node -> key of the pod whose pending handoff blocks a bind there (see blocking_handoff;
        not with `handoffs` false: a CPU-only pod's bind never waits for one), of a bind that has
        arrived for it and is still in progress (see `claims`), or of a pod expected to be bound
        there any moment (see `expected`, with `now` on time.monotonic())."""
        out: dict[str, str] = {}
        with self.lock:
            if self.expected and now is not None:
                for uid, (until, key, nodes) in list(self.expected.items()):
                    if until <= now:
                        del self.expected[uid]
                    elif uid != exclude_uid:
                        out.update(dict.fromkeys(nodes, key))
            for node, binds in self.claims.items():
                for k, uid in binds.items():
                    if uid != exclude_uid or not uid:
                        out[node] = k
                        break
            for node, keys in self.pending_by_node.items() if handoffs else ():
                for k in keys:
                    p = self.pods.get(k)
                    if p is not None and p.pending and p.uid != exclude_uid and self._may_be_admitted(p):
                        out[node] = k
                        break
        return out

    def slots_free(self, node: str) -> int:
        info = self.nodes.get(node)
        if info is None:
            return 0
        return info.slots - sum(self.slot_use.get(node, {}).values())

    # --- Bindings whose outcome is unknown ---------------------------------------------------------
    def hold_doubtful(self, key: str, uid: str, rv: str) -> None:
        """Keep the assumed assignment of `key` charged: its Binding may yet have taken effect."""
        with self.lock:
            p = self.pods.get(key)
            if p is not None and p.uid == uid:
                self.doubtful[key] = (uid, rv, p.assignment_raw)

    def doubtful_items(self) -> list[tuple[str, str, str]]:
        """(pod key, uid, the doubtful Binding's resourceVersion precondition) of each doubt held."""
        with self.lock:
            return [(k, uid, rv) for k, (uid, rv, _raw) in self.doubtful.items()]

    def resolve_doubtful(self, key: str, uid: str, pod: dict[str, Any] | None) -> None:
        """`pod`: the pod as found once no late Binding of it can land any more (None: gone). Bound
        with the assignment held for it: the charge stays (the watch confirms it); otherwise the
        held assignment is released, and what the pod holds instead (if bound) is charged."""
        with self.lock:
            doubt = self.doubtful.get(key)
            if doubt is None or doubt[0] != uid:
                return
            del self.doubtful[key]
            p = self.pods.get(key)
            meta = (pod or {}).get("metadata") or {}
            node = str(((pod or {}).get("spec") or {}).get("nodeName") or "")
            raw = (meta.get("annotations") or {}).get(ANN_ASSIGNMENT)
            if p is not None and p.uid == uid and p.assumed and p.assignment_raw == doubt[2]:
                if node and raw == p.assignment_raw:
                    p.bound_node = node
                    self._index_pending(p)
                else:
                    self._release(key)
            if pod is not None and node and raw and raw != doubt[2]:
                self.apply_pod(pod)  # bound with another assignment: charge what it holds
            self.changed.notify_all()

    def pending_bound(self) -> list[PodInfo]:
        """Pods bound to a node whose handoff is still pending."""
        with self.lock:
            return [
                replace(p)
                for keys in self.pending_by_node.values()
                for k in keys
                if (p := self.pods.get(k)) is not None and p.pending and p.bound_node
            ]

    def forget(self, key: str, uid: str) -> None:
        """Drop a pod's assignment from the view (its annotations were just removed by us)."""
        with self.lock:
            p = self.pods.get(key)
            if p is not None and p.uid == uid:
                self._release(key)
            self.changed.notify_all()

    def largest_gpu_mib(self) -> int:
        with self.lock:
            return max((g.mem_mib for n in self.state.nodes.values() for g in n.gpus), default=0)

    def snapshot_pods_on(self, node: str) -> list[PodInfo]:
        with self.lock:
            return [replace(p) for p in self.pods.values() if p.node == node]
