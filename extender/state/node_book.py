"""The view's nodes: each Node object's gpupack inventory, reservations, slots, host allocatable,
labels and schedulability, as NodeInfo records and the packing core's Nodes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from gpupack.contract import (
    ANN_INVENTORY,
    ANN_RESERVATIONS,
    ContractError,
    decode_inventory,
    decode_reservations,
)
from gpupack.core.model import Node

from .hostuse import allocatable_host, grew
from .records import (
    NodeInfo,
    allocatable_slots,
    blocking_taints,
    kubelet_contradiction,
    node_from_inventory,
    node_ready,
    room_grew,
)
from .view_shared import ViewShared


class NodeBook:
    """Part of the cluster view (ClusterView.node_book); its lock guards it. The records it keeps
    are the view's `nodes`, and the core's Nodes its `state.nodes`."""

    def __init__(self, view: ViewShared) -> None:
        self.view = view

    def apply(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            return
        ann = meta.get("annotations") or {}
        labels = dict(meta.get("labels") or {})
        unsched = bool((obj.get("spec") or {}).get("unschedulable"))
        inv_raw = ann.get(ANN_INVENTORY)
        res_raw = ann.get(ANN_RESERVATIONS)
        slots = allocatable_slots(obj)
        taints, ready = blocking_taints(obj), node_ready(obj)
        alloc, pods_allowed = allocatable_host(obj)
        with self.view.lock:
            info = self.view.nodes.get(name)
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
                        self.view.on_room(name, why)
                return
            before = replace(info) if info is not None else None
            if info is None:
                info = NodeInfo(name)
                self.view.nodes[name] = info
            info.taints, info.ready = taints, ready
            why = room_grew(before, replace(info, unschedulable=unsched, slots=slots, reservations_raw=res_raw),
                            inv_raw, labels)  # fmt: skip
            rebuild = inv_raw != info.inventory_raw or name not in self.view.state.nodes
            if (
                not why
                and self.view.track_host
                and (grew(info.allocatable, alloc) or pods_allowed > info.pods_allowed)
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
                        self.view.problems.pop(f"node/{name}/inventory", None)
                    except ContractError as e:
                        info.inventory_error = str(e)
                        self.view.problem("corrupt-inventory", f"node/{name}/inventory", str(e))
                info.gpu_indexes = [g.index for g in sorted(inv.gpus, key=lambda g: g.index)] if inv else []
                info.slots_per_gpu = inv.slots_per_gpu if inv else info.slots_per_gpu
                self._rebuild(name, node_from_inventory(name, inv, unsched, labels))
            else:
                node = self.view.state.nodes[name]
                node.schedulable, node.labels = not unsched, labels
                self.view.host.recount(name)
            self._check_kubelet(name, info)
            if res_raw != info.reservations_raw:
                info.reservations_raw = res_raw
                info.reservations, info.reservations_error = (), ""
                if res_raw:
                    try:
                        info.reservations = tuple(decode_reservations(res_raw, name))
                        self.view.problems.pop(f"node/{name}/reservations", None)
                    except ContractError as e:
                        info.reservations_error = str(e)
                        self.view.problem("corrupt-reservations", f"node/{name}/reservations", str(e))
            if info.reservations:
                self.view.reserved.add(name)
            else:
                self.view.reserved.discard(name)
            self.view.journal.touch(info)
            if why:
                self.view.on_room(name, why)
            self.view.changed.notify_all()

    def _check_kubelet(self, name: str, info: NodeInfo) -> None:
        """The inventory against the kubelet's own count (records.kubelet_contradiction): both
        change on their own (the plugin publishes, the kubelet reports its allocatable), so each
        update of either is checked."""
        healthy = sum(1 for g in self.view.state.nodes[name].gpus if g.healthy)
        was, info.inventory_conflict = (
            info.inventory_conflict,
            kubelet_contradiction(name, healthy, info.slots_per_gpu, info.slots),
        )
        if info.inventory_conflict:
            if info.inventory_conflict != was:
                self.view.problem(
                    "inventory-contradicts-kubelet", f"node/{name}/kubelet", info.inventory_conflict
                )
        elif was:
            self.view.problems.pop(f"node/{name}/kubelet", None)

    def delete(self, name: str) -> None:
        with self.view.lock:
            info = self.view.nodes.pop(name, None)
            if info is not None:
                self.view.journal.touch(info)
            self.view.reserved.discard(name)
            node = self.view.state.nodes.pop(name, None)
            if node is not None:
                self._uncharge(name)
            if info is not None or node is not None:
                self.view.node_gone(name)
            self.view.changed.notify_all()

    def _on(self, name: str) -> list[str]:
        """Keys of the pods charged on node `name`: every pod record is in the view's per-node
        slot index (charge, assume), so this does not walk the cluster's pods."""
        return list(self.view.slot_use.get(name, ()))

    def _uncharge(self, name: str) -> None:
        state = self.view.state.pods
        for key in self._on(name):
            held = state.get(key)
            if held is not None and held[1].node == name:
                del state[key]

    def _rebuild(self, name: str, node: Node) -> None:
        self._uncharge(name)
        self.view.state.nodes[name] = node
        for key in self._on(name):
            p = self.view.pods.get(key)
            if p is not None and p.node == name:
                self.view.charge(p)
        self.view.host.recount(name)

    def replace(self, objs: Iterable[dict[str, Any]]) -> None:
        self.replace_pages([list(objs)])

    def replace_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        seen: set[str] = set()
        for page in pages:
            with self.view.lock:
                for o in page:
                    seen.add((o.get("metadata") or {}).get("name") or "")
                    self.apply(o)
        with self.view.lock:
            for name in [n for n in self.view.nodes if n not in seen]:
                self.delete(name)
