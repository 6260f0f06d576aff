"""Host resources in use per node (with `track_host`): every assigned pod's CPU, memory and other
resources as kube-scheduler's NodeResourcesFit counts them, from the assigned-pod watch, and the
CPU-only pods this process binds until that watch shows them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gpupack.core.model import PlacementError

from .hostuse import MIB, NO_HOST_USE, HostPod, HostUse, grew, host_plus, pod_host_request, ram_mib
from .records import TERMINAL
from .view_shared import ViewShared


class HostLedger:
    """Part of the cluster view (ClusterView.host); its lock guards it."""

    def __init__(self, view: ViewShared) -> None:
        self.view = view
        # Assigned pods of the whole cluster (a second, field-selected watch): pod key -> HostPod.
        # A gpupack pod not in it yet (assumed, or its Binding not echoed) is charged from its
        # PodInfo instead; by key and uid, never both (see recount).
        self.pods: dict[str, HostPod] = {}
        self.by_node: dict[str, set[str]] = {}
        # CPU-only pods this process binds (no assignment, so no PodInfo): pod key -> (HostPod, Binding
        # posted), charged from `assume` until the assigned-pod watch shows them (then from there).
        self.assumed: dict[str, tuple[HostPod, bool]] = {}
        self.assumed_by_node: dict[str, set[str]] = {}
        # while a list's page is applied (see deferred): node -> its count before the page
        self._deferred: dict[str, tuple[HostUse, int]] | None = None

    def tracked_sizes(self) -> dict[str, int]:
        """Entries per map (nested ones counted); view lock held."""
        return {
            "host.pods": len(self.pods),
            "host.by_node": len(self.by_node) + sum(map(len, self.by_node.values())),
            "host.assumed": len(self.assumed),
            "host.assumed_by_node": len(self.assumed_by_node) + sum(map(len, self.assumed_by_node.values())),
        }

    def recount(self, name: str) -> bool:
        """Set the node's requested host resources and pod count (NodeInfo.requested, pod_count)
        and the core Node's CPU/memory from its allocatable and the pods assigned to it; True when
        any of them changed. A gpupack pod the assigned-pod watch shows already (same uid, same
        node) is counted from there, else from its PodInfo: binds charge at assume time, before any
        watch has seen them, and nothing is counted twice."""
        node = self.view.state.nodes.get(name)
        info = self.view.nodes.get(name)
        if node is None or info is None or not self.view.track_host:
            return False
        if self._deferred is not None:
            self._deferred.setdefault(name, (info.requested, info.pod_count))
            return False
        uses: list[HostUse] = [self.pods[k].use for k in self.by_node.get(name, ())]
        for k in self.view.slot_use.get(name, ()):
            p = self.view.pods.get(k)
            if p is None or p.node != name:
                continue
            hp = self.pods.get(k)
            if hp is not None and hp.uid == p.uid and hp.node == name:
                continue
            uses.append(p.host)
        for k in self.assumed_by_node.get(name, ()):
            a = self.assumed[k][0]
            hp = self.pods.get(k)
            if hp is not None and hp.uid == a.uid and hp.node == name:
                continue
            uses.append(a.use)
        requested = NO_HOST_USE
        for u in uses:
            requested = host_plus(requested, u)
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

    def hold(self) -> bool:
        """Count each node once, at `flush`, not once per pod: a node's count sums all its pods, so
        applying its pods one by one cost the square of the pods a node holds. False when already
        held (the holder flushes). View lock held."""
        if self._deferred is not None:
            return False
        self._deferred = {}
        return True

    def flush(self) -> None:
        """Count the nodes changed since `hold`, then as apply_pod would: a new version, and room
        if any was freed. View lock held."""
        todo, self._deferred = self._deferred or {}, None
        for n, (before, count) in todo.items():
            if self.recount(n):
                self.view.bump(n)
                ni = self.view.nodes[n]
                if ni.pod_count < count or grew(ni.requested, before):
                    self.view.on_room(n, "host-freed")

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """hold ... flush (nothing when held already). View lock held."""
        mine = self.hold()
        try:
            yield
        finally:
            if mine:
                self.flush()

    def apply_pod(self, obj: dict[str, Any], deleted: bool = False) -> None:
        """An event of the assigned-pod watch (every pod with a node, not terminal)."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            return
        key = f"{meta.get('namespace') or 'default'}/{name}"
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        gone = deleted or not node or (obj.get("status") or {}).get("phase") in TERMINAL
        new = None if gone else HostPod(str(meta.get("uid") or ""), node, pod_host_request(obj))
        with self.view.lock:
            old = self.pods.get(key)
            if old == new:
                return
            if old is not None:
                keys = self.by_node.get(old.node)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.by_node[old.node]
                del self.pods[key]
            if new is not None:
                self.pods[key] = new
                self.by_node.setdefault(new.node, set()).add(key)
            touched = {x.node for x in (old, new) if x is not None}
            assumed = self.assumed.get(key)
            if assumed is not None and assumed[0].uid == str(meta.get("uid") or ""):
                # the watch shows the pod now (or its end): its charge is counted from `pods`
                touched.add(assumed[0].node)
                self._drop_assumed(key)
            for n in touched:
                ni = self.view.nodes.get(n)
                if ni is None:
                    continue
                before, count = ni.requested, ni.pod_count
                if self.recount(n):
                    self.view.bump(n)
                    if ni.pod_count < count or grew(ni.requested, before):
                        # kube-scheduler retries parked pods on a pod's deletion, but that retry can
                        # reach this extender before this watch has freed the CPU
                        self.view.on_room(n, "host-freed")
            self.view.changed.notify_all()

    def delete_pod(self, obj: dict[str, Any]) -> None:
        self.apply_pod(obj, deleted=True)

    def replace_pages(self, pages: Iterable[list[dict[str, Any]]]) -> None:
        """A fresh list of the assigned pods: apply it and drop the pods missing from it."""
        seen = self.view.apply_pod_pages(pages, self.apply_pod)
        with self.view.lock:
            self.drop_unlisted(seen)
            self.view.changed.notify_all()

    def drop_unlisted(self, seen: set[str]) -> None:
        for key in [k for k in self.pods if k not in seen]:
            ns, _, name = key.partition("/")
            self.apply_pod({"metadata": {"namespace": ns, "name": name}}, deleted=True)
        # a bound CPU-only pod missing from it has ended, or was bound after the list's snapshot
        # (then the watch that resumes from it shows the pod, and charges it from `pods`)
        for key in [k for k, (_, bound) in self.assumed.items() if bound and k not in seen]:
            node = self.assumed[key][0].node
            self._drop_assumed(key)
            if self.recount(node):
                self.view.bump(node)

    def _drop_assumed(self, key: str) -> None:
        hp, _ = self.assumed.pop(key)
        keys = self.assumed_by_node.get(hp.node)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.assumed_by_node[hp.node]

    def assume(self, key: str, uid: str, node: str, use: HostUse) -> None:
        """Charge a CPU-only pod's CPU/memory on `node` from now on, before its Binding is posted:
        the next filter must see it before the assigned-pod watch does (see host_assumed)."""
        with self.view.lock:
            if node not in self.view.state.nodes:
                raise PlacementError(f"node {node} is not known")
            if key in self.assumed:
                old = self.assumed[key][0].node
                self._drop_assumed(key)
                self.recount(old)
                self.view.bump(old)
            self.assumed[key] = (HostPod(uid, node, use), False)
            self.assumed_by_node.setdefault(node, set()).add(key)
            self.recount(node)
            self.view.bump(node)
            self.view.changed.notify_all()

    def bound(self, key: str, uid: str) -> None:
        """The Binding of a CPU-only pod charged by `assume` went through."""
        with self.view.lock:
            a = self.assumed.get(key)
            if a is not None and a[0].uid == uid:
                self.assumed[key] = (a[0], True)

    def unassume(self, key: str, uid: str) -> None:
        """Undo `assume` after a failed Binding (only if it is still this pod's)."""
        with self.view.lock:
            a = self.assumed.get(key)
            if a is None or a[0].uid != uid:
                return
            self._drop_assumed(key)
            if self.recount(a[0].node):
                self.view.on_room(a[0].node, "host-freed")
            self.view.bump(a[0].node)
            self.view.changed.notify_all()
