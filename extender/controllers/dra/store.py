"""The controller's picture of the cluster: every Node, Pod, ResourceSlice and ResourceClaim, kept
by list-then-watch (one thread per kind), bounded by the live objects. Any change wakes the
allocator. Objects are plain API JSON dicts. What the allocator writes it also puts here from the
write's answer (put, newer resourceVersion wins), so its next decision sees it before the watch does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client

log = logging.getLogger("gpupack.extender.dra")
WATCH_TIMEOUT_S = 240


def _key(obj: dict[str, Any]) -> str:
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name', '')}"


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class Kind:
    """One kind's objects, listed then watched by a daemon thread."""

    def __init__(self, name: str, list_fn: Callable[..., Any], changed: Callable[[], None]) -> None:
        self.name, self.list_fn, self.changed = name, list_fn, changed
        self.objs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.synced = threading.Event()
        self.stopped = threading.Event()

    def values(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.objs.values())

    def get(self, key: str) -> dict[str, Any] | None:
        with self.lock:
            return self.objs.get(key)

    def put(self, obj: dict[str, Any]) -> None:
        with self.lock:
            old = self.objs.get(_key(obj))
            if old is None or _rv(obj) >= _rv(old):
                self.objs[_key(obj)] = obj

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"dra-watch-{self.name}", daemon=True).start()

    def _list(self) -> str:
        resp = self.list_fn(_preload_content=False, _request_timeout=60)
        body = json.loads(resp.data)
        with self.lock:
            self.objs = {_key(o): o for o in body.get("items") or []}
        self.synced.set()
        self.changed()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _run(self) -> None:
        backoff = 0.5
        while not self.stopped.is_set():
            try:
                rv = self._list()
                while not self.stopped.is_set():
                    rv = self._watch(rv)
                    if not rv:
                        break  # expired: list again
                backoff = 0.5
            except Exception as e:  # the API server restarts, a watch breaks: list again, backed off
                log.warning(
                    "DRA allocator: watching %s failed (%s); listing again in %.1fs", self.name, e, backoff
                )
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _watch(self, rv: str) -> str:
        resp = self.list_fn(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                            timeout_seconds=WATCH_TIMEOUT_S, _preload_content=False,
                            _request_timeout=WATCH_TIMEOUT_S + 30)  # fmt: skip
        try:
            for line in resp:
                ev = json.loads(line)
                obj, kind = ev.get("object") or {}, ev.get("type")
                if kind == "ERROR":
                    return ""
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind == "BOOKMARK":
                    continue
                with self.lock:
                    if kind == "DELETED":
                        self.objs.pop(_key(obj), None)
                    else:
                        self.objs[_key(obj)] = obj
                self.changed()
        finally:
            resp.release_conn()
        return rv


class Store:
    def __init__(self, api: client.ApiClient, changed: Callable[[], None]) -> None:
        core, res = client.CoreV1Api(api), client.ResourceV1Api(api)
        self.nodes = Kind("nodes", core.list_node, changed)
        self.pods = Kind("pods", core.list_pod_for_all_namespaces, changed)
        self.slices = Kind("resourceslices", res.list_resource_slice, changed)
        self.claims = Kind("resourceclaims", res.list_resource_claim_for_all_namespaces, changed)
        self.kinds = (self.nodes, self.pods, self.slices, self.claims)

    def start(self) -> None:
        for k in self.kinds:
            k.start()

    def stop(self) -> None:
        for k in self.kinds:
            k.stopped.set()

    def wait_synced(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        return all(k.synced.wait(max(0.0, end - time.monotonic())) for k in self.kinds)
