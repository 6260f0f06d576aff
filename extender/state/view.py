"""The extender's picture of the cluster: GPU inventory per node and what gpupack pods hold, and
(with `track_host`) each node's CPU and memory, allocatable and requested by every pod on it.

Built only from Kubernetes objects (Node inventory/reservation annotations, Pod assignment
annotations), so a restarted extender rebuilds exactly what it had. Pure state: the watch loops
(`extender/state/sync.py`) and the bind step feed it; nothing here does I/O.

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
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeGuard

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_PENDING,
    Assignment,
    ContractError,
    Reservation,
    decode_allocation,
    decode_assignment,
)
from gpupack.core.model import ClusterState, Node, Placement, PlacementError, PodRequest

from . import reservations as resv
from .bind_locks import BindLocks
from .host_ledger import HostLedger
from .hostuse import (
    NO_HOST_USE,
    HostUse,
    pod_host_request,
)
from .journal import Journal
from .node_book import NodeBook
from .records import (
    TERMINAL,
    NodeInfo,
    PodInfo,
    charged_from_assignment,
    foreign_assignment,
    init_names,
    pod_slots,
)
from .view_upkeep import NodeGoneHooks

log = logging.getLogger("gpupack.extender.view")


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
        self.changed = threading.Condition(self.lock)
        self.state = ClusterState()
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodInfo] = {}
        self.consumed: dict[str, set[str]] = {}  # node -> reservation ids consumed by live pods
        self.synced = threading.Event()
        # (kind, message) for corrupt annotations and conflicts; the metrics layer counts them
        self.on_problem = on_problem or (lambda kind, msg: None)
        # (node, why) when a change may let waiting pods fit (see room_grew); called under the
        # lock from the watch and bind threads, so it must not block (the Requeuer only flags).
        self.on_room: Callable[[str, str], None] = lambda node, why: None
        self.problems: dict[str, str] = {}  # object -> last problem, for status and readiness
        self.journal = Journal()  # the order nodes changed in (their versions)
        self.reserved: set[str] = set()  # nodes with defrag reservations: their answers depend on time
        self.slot_use: dict[str, dict[str, int]] = {}  # node -> pod key -> `gpupack.io/gpu` slots
        self.host = HostLedger(self)  # host resources in use per node (with track_host)
        self.locks = BindLocks(self)  # pending handoffs, binds in progress, expected binds, doubts
        self.node_book = NodeBook(self)  # Node objects into `nodes` and `state.nodes`
        # told (view lock held) of each node deleted, so that what the answer caches keep per
        # node goes with it (view_upkeep.py)
        self.gone_hooks = NodeGoneHooks()

    def node_gone(self, name: str) -> None:
        """A node was deleted: what is kept of it anywhere goes. View lock held."""
        for k in [k for k in self.problems if k.startswith(f"node/{name}/")]:
            del self.problems[k]
        if not self.slot_use.get(name):
            self.slot_use.pop(name, None)  # pods still charged there keep theirs (the node may return)
        if not self.consumed.get(name):
            self.consumed.pop(name, None)
        self.gone_hooks.fire(name)

    # --- nodes ---------------------------------------------------------------------------------
    def problem(self, kind: str, obj: str, msg: str) -> None:
        if self.problems.get(obj) != msg:
            log.warning("%s", msg)
        self.problems[obj] = msg
        self.on_problem(kind, msg)

    def apply_node(self, obj: dict[str, Any]) -> None:
        self.node_book.apply(obj)

    def delete_node(self, name: str) -> None:
        self.node_book.delete(name)

    def replace_nodes(self, objs: Iterable[dict[str, Any]]) -> None:
        self.node_book.replace(objs)

    def replace_node_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        self.node_book.replace_pages(pages)

    def bump(self, node: str) -> None:
        """A change on `node` that can change a fit there: it gets a new version."""
        info = self.nodes.get(node)
        if info is not None:
            self.journal.touch(info)

    # --- lists ----------------------------------------------------------------------------------
    def apply_pod_pages(
        self, pages: Iterable[list[dict[str, Any]]], apply: Callable[[dict[str, Any]], None]
    ) -> set[str]:
        """Apply a list's pages, the lock held per page (the view stays usable between pages); the
        keys of the pods listed."""
        seen: set[str] = set()
        whole = False
        if not self.synced.is_set():
            # the first list: no verb is answered before it ends, so nodes are counted once at its end
            with self.lock:
                whole = self.host.hold()
        try:
            for page in pages:
                with self.lock, self.host.deferred():
                    for o in page:
                        m = o.get("metadata") or {}
                        seen.add(f"{m.get('namespace') or 'default'}/{m.get('name')}")
                        apply(o)
        finally:
            if whole:
                with self.lock:
                    self.host.flush()
        return seen

    # --- pods ----------------------------------------------------------------------------------
    def charge(self, p: PodInfo) -> None:
        """Put a pod's assignment on its node; a conflict is reported and charged anyway."""
        self.slot_use.setdefault(p.node, {})[p.key] = p.slots
        node = self.state.nodes.get(p.node)
        if node is None:
            return  # the node is not (yet) known; charged when it appears
        placement, charged, problems = charged_from_assignment(node, p.assignment, p.init_names)
        for msg in problems:
            self.problem("assignment-gpu-missing", f"pod/{p.key}", f"pod {p.key}: {msg}")
        req = PodRequest(key=p.key, pod_class=p.assignment.pod_class, uid=p.uid)
        try:
            self.state.place(req, placement, charged)
        except PlacementError as e:
            # Already on the GPU per the API: account for it, so nothing more lands there.
            self.problem("conflict", f"pod/{p.key}", f"pod {p.key}: assignment conflicts with others: {e}")
            self._force_place(node, req, placement, charged)
        if p.assignment.reservation:
            self.consumed.setdefault(p.node, set()).add(p.assignment.reservation)
        self.host.recount(p.node)
        self.bump(p.node)

    def _force_place(
        self, node: Node, req: PodRequest, placement: Placement, charged: dict[int, tuple[int, int, bool]]
    ) -> None:
        for idx, (mem, milli, ex) in charged.items():
            node.gpus[idx].charge(req.key, mem, milli, ex, req.pod_class)
        self.state.pods[req.key] = (req, placement, charged)

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
            if not use:
                del self.slot_use[p.node]  # one entry per node with pods, not per node that had one
        if p.assignment.reservation:
            ids = self.consumed.get(p.node)
            if ids is not None:
                ids.discard(p.assignment.reservation)
                if not ids:
                    del self.consumed[p.node]
        self.locks.unindex(p.node, key)
        self.host.recount(p.node)
        self.bump(p.node)
        if freed:
            # kube-scheduler retries its parked pods on the pod's deletion itself, but that retry
            # can reach this extender before its watch has freed the GPUs, and is not repeated.
            self.on_room(p.node, "pod-left")

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
        if raw is None and not deleted and phase not in TERMINAL:
            raw = charge_from_record(self, key, obj, ann)
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
                self.problem("corrupt-assignment", f"pod/{key}", str(e))
            why = foreign_assignment(a, uid, str((obj.get("spec") or {}).get("nodeName") or "")) if a else ""
            if why:  # not charged: the device plugin will not serve it either
                self.problem("foreign-assignment", f"pod/{key}", f"pod {key}: {why}; not charged")
                a = None
        with self.lock:
            if deleted or phase in TERMINAL:
                # what was reported of the pod goes with it: a pod that was never charged (its
                # assignment unreadable or another pod's) has nothing else to release
                self.problems.pop(f"pod/{key}", None)
                self.locks.forget_pod(uid)
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
                    self.problem("stripped-assignment", f"pod/{key}", f"pod {key} lost its {ANN_ASSIGNMENT} "
                                  "annotation while running; its share stays held until it ends")  # fmt: skip
                if not (alive and old is not None and (old.assumed or stripped)):
                    self.locks.doubtful.pop(key, None)
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
            self.locks.doubtful.pop(key, None)  # the watch shows what the pod holds: no doubt left
            info = PodInfo(
                key=key,
                uid=uid,
                node=a.node,
                assignment=a,
                assignment_raw=raw,
                init_names=init_names(obj),
                handoff=str(ann.get(ANN_HANDOFF, "")),
                deleting=meta.get("deletionTimestamp") is not None,
                bound_node=bound,
                slots=pod_slots(obj),
                resource_version=str(meta.get("resourceVersion") or ""),
                host=pod_host_request(obj) if self.track_host else HostUse(),
            )
            self._release(key, freed=False)
            self.pods[key] = info
            self.charge(info)
            self.locks.index_pending(info)
            self.changed.notify_all()

    def _holds(self, old: PodInfo | None, uid: str, raw: str) -> TypeGuard[PodInfo]:
        """Whether `old` is this pod (`uid`) with the assignment `raw` charged. View lock held."""
        return old is not None and old.uid == uid and old.assignment_raw == raw and old.key in self.state.pods

    def _refresh(self, old: PodInfo, obj: dict[str, Any]) -> None:
        """An event of a pod with the assignment `old` holds: only its handoff, deletion, node and
        version can have changed (the rest of a pod's spec is immutable). View lock held."""
        meta = obj.get("metadata") or {}
        self.locks.doubtful.pop(old.key, None)  # the watch shows what the pod holds: no doubt left
        old.handoff = str((meta.get("annotations") or {}).get(ANN_HANDOFF, ""))
        old.deleting, old.assumed = meta.get("deletionTimestamp") is not None, False
        old.bound_node = str((obj.get("spec") or {}).get("nodeName") or "") or old.bound_node
        old.resource_version = str(meta.get("resourceVersion") or "")
        self.locks.index_pending(old)
        self.changed.notify_all()

    def delete_pod(self, obj: dict[str, Any]) -> None:
        self.apply_pod(obj, deleted=True)

    def replace_pods(self, objs: Iterable[dict[str, Any]]) -> None:
        """A fresh list: apply it and drop confirmed pods that are gone (assumed ones stay)."""
        seen = self.apply_pod_pages([list(objs)], self.apply_pod)
        with self.lock:
            self._drop_unlisted(seen)
            self.changed.notify_all()

    def _drop_unlisted(self, seen: set[str]) -> None:
        # an assumed pod's Binding may postdate the list; a doubtful one is the janitor's to settle
        for key in [k for k, p in self.pods.items() if k not in seen and not p.assumed]:
            self._release(key)
        # a pod deleted while the watch was away: what was reported of it goes too
        gone = [
            k for k in self.problems if k.startswith("pod/") and k[4:] not in seen and k[4:] not in self.pods
        ]
        for obj in gone:
            del self.problems[obj]

    # --- the assigned-pod watch: every pod with a node, not terminal -------------------------------
    def apply_assigned(self, obj: dict[str, Any]) -> None:
        """An ADDED/MODIFIED event of the assigned-pod watch: the pod's assignment (a gpupack pod)
        and, with `track_host`, its CPU/memory on its node."""
        if self.track_host:
            self.host.apply_pod(obj)
        self.apply_pod(obj)

    def delete_assigned(self, obj: dict[str, Any]) -> None:
        """A DELETED event: the pod was deleted or ended (Succeeded/Failed leave the selection). The
        watch selects on the node name, which never changes once set, so it means nothing else."""
        if self.track_host:
            self.host.apply_pod(obj, deleted=True)
        self.apply_pod(obj, deleted=True)

    def replace_assigned_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        """A fresh list of the assigned pods: apply it, and drop what is missing from it."""
        seen = self.apply_pod_pages(pages, self.apply_assigned)
        with self.lock:
            if self.track_host:
                self.host.drop_unlisted(seen)
            self._drop_unlisted(seen)
            self.changed.notify_all()

    # --- the bind step's reservation -------------------------------------------------------------
    def assume(
        self, key: str, uid: str, a: Assignment, init_names: frozenset[str], slots: int = 0,
        host: HostUse = NO_HOST_USE, inflight: bool = True,
    ) -> None:  # fmt: skip
        """Hold an assignment this process is about to write; PlacementError if it no longer fits.
        `host`: the pod's CPU/memory request, charged on the node from now on (see HostLedger.recount).
        `inflight` false: held for a bind still queued for its node, whose Binding is not posted
        yet: the pod cannot be admitted by a kubelet, so its handoff locks no node until then."""
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
            self.host.recount(a.node)
            if inflight:
                self.locks.inflight.add(key)  # until mark_bound, unassume or the bind's end
            if a.reservation:
                self.consumed.setdefault(a.node, set()).add(a.reservation)
            self.locks.index_pending(info)
            self.bump(a.node)
            self.changed.notify_all()

    def unassume(self, key: str, uid: str, a: Assignment) -> None:
        """Undo :meth:`assume` after a Binding that did not take effect (only if it is still ours)."""
        with self.lock:
            p = self.pods.get(key)
            if p is not None and p.uid == uid and p.assignment_raw == a.to_json():
                self._release(key)
            self.locks.inflight.discard(key)
            self.changed.notify_all()

    def mark_bound(self, key: str, node: str) -> None:
        with self.lock:
            p = self.pods.get(key)
            if p is not None:
                p.bound_node = node
            self.locks.inflight.discard(key)

    # --- queries -------------------------------------------------------------------------------
    def version(self, node: str) -> int:
        info = self.nodes.get(node)
        return -1 if info is None else info.version

    def active_reservations(self, node: str, now: datetime) -> list[Reservation]:
        info = self.nodes.get(node)
        if info is None or not info.reservations:
            return []
        return resv.active(info.reservations, now, self.consumed.get(node, set()))

    def slots_free(self, node: str) -> int:
        info = self.nodes.get(node)
        if info is None:
            return 0
        return info.slots - sum(self.slot_use.get(node, {}).values())

    # --- Bindings whose outcome is unknown ---------------------------------------------------------

    def resolve_doubtful(self, key: str, uid: str, pod: dict[str, Any] | None) -> None:
        """`pod`: the pod as found once no late Binding of it can land any more (None: gone). Bound
        with the assignment held for it: the charge stays (the watch confirms it); otherwise the
        held assignment is released, and what the pod holds instead (if bound) is charged."""
        with self.lock:
            doubt = self.locks.doubtful.get(key)
            if doubt is None or doubt[0] != uid:
                return
            del self.locks.doubtful[key]
            p = self.pods.get(key)
            meta = (pod or {}).get("metadata") or {}
            node = str(((pod or {}).get("spec") or {}).get("nodeName") or "")
            raw = (meta.get("annotations") or {}).get(ANN_ASSIGNMENT)
            if p is not None and p.uid == uid and p.assumed and p.assignment_raw == doubt[2]:
                if node and raw == p.assignment_raw:
                    p.bound_node = node
                    self.locks.index_pending(p)
                else:
                    self._release(key)
            if pod is not None and node and raw and raw != doubt[2]:
                self.apply_pod(pod)  # bound with another assignment: charge what it holds
            self.changed.notify_all()

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


def charge_from_record(view: ClusterView, key: str, obj: dict[str, Any], ann: dict[str, Any]) -> str | None:
    """A bound pod without its assignment (removed by an account trusted to write it): the
    shares its containers were handed, from the device plugin's allocation record, as an
    assignment to charge (None: no record of them). So the share outlives the removal across
    restarts too. The record is checked like an assignment (this pod's UID, its node), and only
    gpupack's accounts may write it (docs/contract.md §7)."""
    rec = ann.get(ANN_ALLOCATED)
    if rec is None or not (obj.get("spec") or {}).get("nodeName"):
        return None
    try:
        held = decode_allocation(rec, key)
    except ContractError as e:
        view.problem("corrupt-assignment", f"pod/{key}", str(e))
        return None
    if held is None or not held.containers:
        return None  # an older plugin's record names containers only
    view.problem("stripped-assignment", f"pod/{key}", f"pod {key} lost its {ANN_ASSIGNMENT} annotation "
                 f"while running; its share is charged from its {ANN_ALLOCATED} record")  # fmt: skip
    return held.to_json()
