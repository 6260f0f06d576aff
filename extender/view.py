"""The extender's picture of the cluster: GPU inventory per node and what gpupack pods hold.

Built only from Kubernetes objects (Node inventory/reservation annotations, Pod assignment
annotations), so a restarted extender rebuilds exactly what it had. Pure state: the watch loops
(`extender/sync.py`) and the bind step feed it; nothing here does I/O.

Two kinds of pod records:
- confirmed: seen in the API with an assignment annotation;
- assumed: placed by this process's bind before the API has echoed the annotation back. An event
  without the annotation for an assumed pod is older than our PATCH and is ignored, so a late
  event can never free a GPU that a bind just took (the kube-scheduler's "assumed pod" idea).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

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
)
from gpupack.core.model import FULL, GPU, ClusterState, Node, Placement, PlacementError, PodRequest, Share

from . import reservations as resv

log = logging.getLogger("gpupack.extender.view")

TERMINAL = ("Succeeded", "Failed")
JOURNAL_MAX = 200_000


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

    @property
    def pending(self) -> bool:
        # a bound pod being deleted may still be mid-admission on its node: it keeps the lock until
        # gone or terminal (handoff.is_pending_handoff), or until the stale-handoff limit resolves it
        return self.handoff == HANDOFF_PENDING and (not self.deleting or bool(self.bound_node))

    def pod_view(self) -> handoff.PodView:
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
    app: dict[int, tuple[int, int, bool]] = {}
    inits = []
    for cname, shares in containers.items():
        if cname in init_names:
            inits.append(shares)
            continue
        for s in shares:
            m, k, e = app.get(s.gpu_index, (0, 0, False))
            app[s.gpu_index] = (m + s.mem_mib, k + s.milli, e or s.exclusive)
    charged = dict(app)
    peak: dict[int, tuple[int, int, bool]] = {}
    for shares in inits:
        rides = bool(shares) and all(s.gpu_index in app for s in shares)
        for s in shares:
            if rides:
                m, k, e = peak.get(s.gpu_index, (0, 0, False))
                peak[s.gpu_index] = (max(m, s.mem_mib), max(k, s.milli), e or s.exclusive)
            else:
                m, k, e = charged.get(s.gpu_index, (0, 0, False))
                charged[s.gpu_index] = (m + s.mem_mib, k + s.milli, e or s.exclusive)
    for i, (pm, pk, pe) in peak.items():
        m, k, e = charged.get(i, (0, 0, False))
        charged[i] = (max(m, pm), max(k, pk), e or pe)
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


def request_slots(pod: PodRequest) -> int:
    app = sum(c.gpus for c in pod.containers)
    return max(app, max((c.gpus for c in pod.init_containers), default=0))


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
    pre-check counts gpupack's ignoredByScheduler resources as missing on every node (see
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

    def __init__(self, on_problem: Callable[[str, str], None] | None = None) -> None:
        self.lock = threading.RLock()
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
        self.inflight: set[str] = set()  # pods this process is binding now (between PATCH and Binding)
        # node -> pod key -> uid of every bind request this process holds, from its arrival on (before
        # it reads the pod, queues for the node or writes anything): filter steers the next pods
        # away from these nodes at once, not only once the assignment is written.
        self.claims: dict[str, dict[str, str]] = {}
        # pod uid -> (until when, key, nodes): where kube-scheduler will most likely bind a pod this
        # process has just prioritized (its top-scored nodes, when only a few share the top). The
        # scheduler starts the bind and its next pod's filter at the same moment, so that filter
        # can overtake the bind; it steers away from these nodes as from a bind in progress.
        self.expected: dict[str, tuple[float, str, tuple[str, ...]]] = {}
        # Charged pods the label-filtered watch or list stopped showing although nothing says they are
        # gone (their gpupack.io/managed label was removed): pod key -> uid. They keep their share
        # until a GET finds them gone, replaced or terminal (Sync confirms them).
        self.unconfirmed: dict[str, str] = {}
        self.to_confirm = threading.Event()

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
        with self.lock:
            info = self.nodes.get(name)
            if (
                info is not None
                and info.slots == slots
                and info.inventory_raw == inv_raw
                and info.reservations_raw == res_raw
                and info.unschedulable == unsched
                and info.labels == labels
            ):
                # heartbeats and status updates: nothing gpupack's fit reads changed
                if info.taints != taints or info.ready != ready:
                    before = replace(info)
                    info.taints, info.ready = taints, ready
                    if why := room_grew(before, info, inv_raw, labels):
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
            info.unschedulable, info.labels, info.slots = unsched, labels, slots
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
        self._bump(p.node)

    def _force_place(self, node: Node, req: PodRequest, placement: Placement, charged: dict) -> None:
        for idx, (mem, milli, ex) in charged.items():
            g = node.gpus[idx]
            if ex:
                g.exclusive = True
                g.mem_used, g.milli_used = g.mem_mib, FULL
            else:
                g.mem_used += mem
                g.milli_used += milli
            g.pod_class = g.pod_class or req.pod_class
            g.holders[req.key] = (g.mem_mib if ex else mem, FULL if ex else milli)
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
            try:
                a = decode_assignment(raw, key)
                self.problems.pop(f"pod/{key}", None)
            except ContractError as e:
                self._problem("corrupt-assignment", f"pod/{key}", str(e))
        with self.lock:
            old = self.pods.get(key)
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
                    self.unconfirmed.pop(key, None)
                    self._release(key)
                self.changed.notify_all()
                return
            assert raw is not None
            bound = str((obj.get("spec") or {}).get("nodeName") or "")
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
            )
            if old is not None and old.assumed and old.uid == uid and old.assignment_raw != raw:
                return  # an event from before our bind's PATCH (an earlier assignment)
            self.unconfirmed.pop(key, None)  # seen (labelled) again
            if old is not None and old.uid == uid and old.assignment_raw == raw and key in self.state.pods:
                old.handoff, old.deleting, old.assumed = info.handoff, info.deleting, False
                old.bound_node = bound or old.bound_node
                old.resource_version = info.resource_version
                self._index_pending(old)
            else:
                self._release(key, freed=False)
                self.pods[key] = info
                self._charge(info)
                self._index_pending(info)
            self.changed.notify_all()

    def delete_pod(self, obj: dict[str, Any]) -> None:
        self.apply_pod(obj, deleted=True)

    def left_watch(self, obj: dict[str, Any]) -> None:
        """A DELETED event of the pod watch. It selects on gpupack.io/managed, so DELETED also means
        "no longer labelled", and then carries the pod's last labelled state: the two look the
        same. A pod that may still run on its node keeps its share until a GET confirms it gone
        (see `unconfirmed`; Sync asks at once)."""
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        with self.lock:
            p = self.pods.get(key)
            if (
                p is not None
                and p.uid == str(meta.get("uid") or "")
                and (obj.get("status") or {}).get("phase", "") not in TERMINAL
                # the extender's own rollback of an unbound pod removes both: nothing holds a GPU
                and (
                    (obj.get("spec") or {}).get("nodeName")
                    or ANN_ASSIGNMENT in (meta.get("annotations") or {})
                )
            ):
                self.unconfirmed[key] = p.uid
                self.to_confirm.set()
                return
        self.delete_pod(obj)

    def confirm_gone(self, key: str, uid: str) -> None:
        """A GET found this unconfirmed pod gone, replaced (another uid) or terminal: free its share."""
        with self.lock:
            if self.unconfirmed.get(key) == uid:
                del self.unconfirmed[key]
                p = self.pods.get(key)
                if p is not None and p.uid == uid:
                    self._release(key)
                self.changed.notify_all()

    def replace_pods(self, objs: Iterable[dict[str, Any]]) -> None:
        """A fresh list: apply it and drop confirmed pods that are gone (assumed ones stay)."""
        self.replace_pod_pages([list(objs)])

    def replace_pod_pages(self, pages: Iterable[list[dict[str, Any]]], confirm_missing: bool = False) -> None:
        """Like replace_pods, a page at a time; the view stays usable between pages. With
        `confirm_missing` (a label-filtered list), charged pods missing from it are not released
        but left to a GET (see `unconfirmed`)."""
        seen: set[str] = set()
        for page in pages:
            with self.lock:
                for o in page:
                    m = o.get("metadata") or {}
                    seen.add(f"{m.get('namespace') or 'default'}/{m.get('name')}")
                    self.apply_pod(o)
        with self.lock:
            for key in [k for k, p in self.pods.items() if k not in seen and not p.assumed]:
                if confirm_missing:  # gone, or only unlabelled: a GET tells which
                    self.unconfirmed[key] = self.pods[key].uid
                    self.to_confirm.set()
                else:
                    self._release(key)
            self.changed.notify_all()

    def replace_nodes(self, objs: Iterable[dict[str, Any]]) -> None:
        self.replace_node_pages([list(objs)])

    def replace_node_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        seen: set[str] = set()
        for page in pages:
            with self.lock:
                for o in page:
                    seen.add((o.get("metadata") or {}).get("name"))
                    self.apply_node(o)
        with self.lock:
            for name in [n for n in self.nodes if n not in seen]:
                self.delete_node(name)

    # --- the bind step's reservation -------------------------------------------------------------
    def assume(self, key: str, uid: str, a: Assignment, init_names: frozenset[str], slots: int = 0) -> None:
        """Hold an assignment this process is about to write; PlacementError if it no longer fits."""
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
                key, uid, a.node, a, raw, init_names, HANDOFF_PENDING, False, assumed=True, slots=slots
            )
            self.pods[key] = info
            self.slot_use.setdefault(a.node, {})[key] = slots
            self.inflight.add(key)  # until mark_bound, unassume or the bind's end
            if a.reservation:
                self.consumed.setdefault(a.node, set()).add(a.reservation)
            self._index_pending(info)
            self._bump(a.node)
            self.changed.notify_all()

    def unassume(self, key: str, uid: str, a: Assignment) -> None:
        """Undo :meth:`assume` after a failed PATCH/Binding (only if it is still ours)."""
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

    def blocking_handoff(self, node: str, exclude_uid: str) -> handoff.PodView | None:
        """The pending handoff that keeps another pod off `node`. Only a pod the kubelet may admit
        there counts: one bound to it, or one this process is binding now. A pending pod with
        no nodeName that no bind here is working on will never be admitted (its bind failed and the
        rollback too, or its extender died between the PATCH and the Binding): it locks nothing,
        and :meth:`stale_unbound` hands it to the janitor."""
        with self.lock:
            views = [
                p.pod_view()
                for k in self.pending_by_node.get(node, ())
                if (p := self.pods.get(k)) is not None and (p.bound_node or k in self.inflight)
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

    def locked_nodes(self, exclude_uid: str, now: float | None = None) -> dict[str, str]:
        """node -> key of the pod whose pending handoff blocks a bind there (see blocking_handoff),
        of a bind that has arrived for it and is still in progress (see `claims`), or of a pod
        expected to be bound there any moment (see `expected`, with `now` on time.monotonic())."""
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
            for node, keys in self.pending_by_node.items():
                for k in keys:
                    p = self.pods.get(k)
                    if (
                        p is not None
                        and p.pending
                        and p.uid != exclude_uid
                        and (p.bound_node or k in self.inflight)
                    ):
                        out[node] = k
                        break
        return out

    def slots_free(self, node: str) -> int:
        info = self.nodes.get(node)
        if info is None:
            return 0
        return info.slots - sum(self.slot_use.get(node, {}).values())

    def stale_unbound(self) -> list[PodInfo]:
        """Pods holding an assignment with handoff pending but no nodeName, bound by nobody here."""
        with self.lock:
            return [
                replace(p)
                for keys in self.pending_by_node.values()
                for k in keys
                if (p := self.pods.get(k)) is not None
                and p.pending
                and not p.bound_node
                and k not in self.inflight
            ]

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
