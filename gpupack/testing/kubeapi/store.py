"""Object storage with a global resourceVersion, per-resource event history and indexes.

Stored objects are treated as immutable: every write stores a fresh dict, so readers (lists,
watches, history) can hold references without copying and serialise outside the lock.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

from .errors import expired
from .resources import RESOURCES, Resource
from .selectors import field_value

Obj = dict[str, Any]

# Fields with an equality index, so per-node pod listings stay cheap with tens of thousands of pods.
INDEXED_FIELDS: dict[str, tuple[str, ...]] = {"pods": ("spec.nodeName",)}


class WatchEvent(NamedTuple):
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj
    old: Obj | None  # previous version, so selector watches can turn MODIFIED into ADDED/DELETED
    raw: bytes  # obj as JSON


def encode(obj: Obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class ResourceStore:
    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.objects: dict[str, dict[str, Obj]] = {}  # namespace ("" if cluster-scoped) -> name -> obj
        # JSON of every current object, encoded once per write: lists and watches of tens of
        # thousands of objects then cost a join, not a json.dumps of the whole store.
        self.raw: dict[tuple[str, str], bytes] = {}
        self.history: list[WatchEvent] = []
        self.base = 0  # absolute position of history[0]
        self.compacted_rv = 0  # events at or below this resourceVersion are gone
        self.index: dict[str, dict[str, dict[tuple[str, str], None]]] = {
            f: {} for f in INDEXED_FIELDS.get(resource.key, ())
        }

    def _index_add(self, obj: Obj) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        for f, idx in self.index.items():
            idx.setdefault(field_value(obj, f), {})[key] = None

    def _index_remove(self, obj: Obj) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        for f, idx in self.index.items():
            bucket = idx.get(field_value(obj, f))
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    del idx[field_value(obj, f)]


class Store:
    def __init__(self, history_limit: int = 10_000) -> None:
        # One condition for everything: writers notify, watchers wait on it.
        self.cond = threading.Condition(threading.RLock())
        self.rv = 0
        self.history_limit = history_limit
        self.resources: dict[str, ResourceStore] = {r.key: ResourceStore(r) for r in RESOURCES}

    def rs(self, resource: Resource) -> ResourceStore:
        return self.resources[resource.key]

    # --- reads (caller holds cond) -----------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> Obj | None:
        return self.rs(resource).objects.get(namespace if resource.namespaced else "", {}).get(name)

    def items(self, resource: Resource, namespace: str | None = None) -> list[Obj]:
        objects = self.rs(resource).objects
        if namespace is not None and resource.namespaced:
            return list(objects.get(namespace, {}).values())
        out: list[Obj] = []
        for bucket in objects.values():
            out.extend(bucket.values())
        return out

    def raw_items(self, resource: Resource, objs: list[Obj]) -> list[bytes]:
        raw = self.rs(resource).raw
        return [raw[(o["metadata"].get("namespace", ""), o["metadata"]["name"])] for o in objs]

    def raw_get(self, resource: Resource, namespace: str, name: str) -> bytes | None:
        return self.rs(resource).raw.get((namespace if resource.namespaced else "", name))

    def items_by_field(
        self, resource: Resource, field: str, value: str, namespace: str | None
    ) -> list[Obj] | None:
        """Objects whose indexed `field` equals `value`; None when the field has no index."""
        rs = self.rs(resource)
        idx = rs.index.get(field)
        if idx is None:
            return None
        out = []
        for ns, name in idx.get(value, {}):
            if namespace is None or ns == namespace:
                out.append(rs.objects[ns][name])
        return out

    def count(self, resource: Resource) -> int:
        return sum(len(b) for b in self.rs(resource).objects.values())

    # --- writes (caller holds cond) ----------------------------------------------------------

    def put(self, resource: Resource, obj: Obj, old: Obj | None) -> Obj:
        """Store `obj` (a dict nobody else holds) as the new version; returns it, stamped."""
        rs = self.rs(resource)
        self.rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self.rv)
        ns = meta.get("namespace", "") if resource.namespaced else ""
        if old is not None:
            rs._index_remove(old)
        rs.objects.setdefault(ns, {})[meta["name"]] = obj
        rs._index_add(obj)
        raw = rs.raw[(ns, meta["name"])] = encode(obj)
        self._record(rs, WatchEvent(self.rv, "MODIFIED" if old is not None else "ADDED", obj, old, raw))
        return obj

    def remove(self, resource: Resource, obj: Obj) -> Obj:
        """Delete `obj`; returns the deleted object stamped with the deletion's resourceVersion."""
        rs = self.rs(resource)
        meta = obj["metadata"]
        ns = meta.get("namespace", "") if resource.namespaced else ""
        bucket = rs.objects.get(ns, {})
        bucket.pop(meta["name"], None)
        rs.raw.pop((ns, meta["name"]), None)
        if not bucket:
            rs.objects.pop(ns, None)
        rs._index_remove(obj)
        self.rv += 1
        gone = dict(obj)
        gone["metadata"] = dict(meta, resourceVersion=str(self.rv))
        self._record(rs, WatchEvent(self.rv, "DELETED", gone, obj, encode(gone)))
        return gone

    def _record(self, rs: ResourceStore, event: WatchEvent) -> None:
        rs.history.append(event)
        if len(rs.history) > self.history_limit + self.history_limit // 8:
            drop = len(rs.history) - self.history_limit
            rs.compacted_rv = rs.history[drop - 1].rv
            del rs.history[:drop]
            rs.base += drop
        self.cond.notify_all()

    # --- watch support (caller holds cond) ---------------------------------------------------

    def start_position(self, resource: Resource, rv: int) -> int:
        """Absolute history position of the first event after `rv`; 410 Expired if compacted."""
        rs = self.rs(resource)
        if rv < rs.compacted_rv:
            raise expired(rv, rs.compacted_rv)
        return rs.base + bisect.bisect_right(rs.history, rv, key=lambda e: e.rv)

    def events_from(self, resource: Resource, position: int) -> tuple[list[WatchEvent], int]:
        rs = self.rs(resource)
        if position < rs.base:
            raise expired(0, rs.compacted_rv)
        events = rs.history[position - rs.base :]
        return events, position + len(events)

    def compact(self, resources: Iterable[ResourceStore] | None = None) -> int:
        """Drop all retained history, as etcd compaction does; older watches then get 410."""
        for rs in resources or self.resources.values():
            rs.base += len(rs.history)
            rs.history = []
            rs.compacted_rv = self.rv
        return self.rv
