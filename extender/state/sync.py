"""List-and-watch loops that keep a :class:`ClusterView` current.

Nodes: all of them (a few thousand objects at most; heartbeats are dropped early by the view).
Pods: one watch of every non-terminal pod with a node. A gpupack pod carries its assignment from
the write that binds it (the Binding sets both), so this is every pod that holds GPUs; of the
others the view keeps (with `track_host`) only key, uid, node and CPU/memory request, for each
node's CPU and memory in use. The field selection is exact (a pod's node never changes once
set), so a pod leaving it has been deleted or has ended.
Namespaces: their labels, which set a pod's default class (read by every filter; a namespace the
watch has not delivered yet is read from the API server, see :meth:`Kube.namespace_labels`).
Each loop resumes from the last resourceVersion (bookmarks included) and relists on 410 Gone; the
view stays readable throughout.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from ..api.kube import Kube
from .view import ClusterView

log = logging.getLogger("gpupack.extender.sync")


class Gone(Exception):
    """The watch's resourceVersion is too old: relist."""


class Watcher:
    def __init__(
        self,
        kind: str,
        list_fn: Callable[[], Iterator[tuple[list[dict[str, Any]], str]]],
        watch_fn: Callable[[str, int], Any],
        replace: Callable[[Iterator[list[dict[str, Any]]]], None],
        apply: Callable[[dict[str, Any]], None],
        delete: Callable[[dict[str, Any]], None],
        stop: threading.Event,
        watch_timeout_s: int = 300,
        on_event: Callable[[str, str], None] | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        self.kind = kind
        # called before each event is applied: the event waits while kube-scheduler waits for a
        # verb (VerbActivity.wait_quiet), as its view update can
        self.pause = pause
        self.list_fn, self.watch_fn = list_fn, watch_fn
        self.replace, self.apply, self.delete = replace, apply, delete
        self.stop = stop
        self.watch_timeout_s = watch_timeout_s
        self.listed = threading.Event()
        self.rv = ""
        self.relists = 0
        self.on_event = on_event or (lambda kind, what: None)

    def relist(self) -> None:
        rv = [""]

        def pages() -> Iterator[list[dict[str, Any]]]:
            for items, page_rv in self.list_fn():
                rv[0] = page_rv
                yield items

        self.replace(pages())
        self.rv = rv[0]
        self.relists += 1
        self.on_event(self.kind, "relist")
        self.listed.set()

    def watch_once(self) -> None:
        resp = self.watch_fn(self.rv, self.watch_timeout_s)
        try:
            for line in _lines(resp):
                if self.stop.is_set():
                    return
                if not line.strip():
                    continue
                if self.pause is not None:
                    self.pause()
                ev = orjson.loads(line)
                typ, obj = ev.get("type"), ev.get("object") or {}
                if typ == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", "410 Gone"))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if typ == "BOOKMARK":
                    self.rv = str(rv or self.rv)
                    continue
                if typ == "DELETED":
                    self.delete(obj)
                elif typ in ("ADDED", "MODIFIED"):
                    self.apply(obj)
                if rv:
                    self.rv = str(rv)
        finally:
            resp.close()
            resp.release_conn()

    def run(self) -> None:
        backoff = 0.2
        while not self.stop.is_set():
            try:
                if not self.listed.is_set() or not self.rv:
                    self.relist()
                self.watch_once()
                backoff = 0.2
            except Gone as e:
                log.info("%s watch: %s; relisting", self.kind, e)
                self.rv = ""
            except ApiException as e:
                if e.status == 410:
                    self.rv = ""
                    continue
                log.warning("%s watch failed: %s %s", self.kind, e.status, e.reason)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except (HTTPError, OSError, ValueError) as e:
                log.warning("%s watch interrupted: %s", self.kind, e)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)


def _lines(resp: Any) -> Iterator[bytes]:
    """Yield complete lines (bytes, UTF-8) from a streaming urllib3 response. A chunk is split once,
    not line by line: a burst of pod events arrives as many lines per chunk."""
    buf = b""
    for chunk in resp.stream(65536, decode_content=False):
        parts = (buf + chunk).split(b"\n") if buf else chunk.split(b"\n")
        buf = parts.pop()
        yield from parts
    if buf.strip():
        yield buf


class Sync:
    """Runs the node, pod and namespace watchers in daemon threads (`pods` false: the node
    watcher only, as the webhook needs); the view is `synced` once each listed fully."""

    def __init__(
        self,
        view: ClusterView,
        kube: Kube,
        watch_timeout_s: int = 300,
        freeze_heap: bool = False,
        pods: bool = True,
        pause: Callable[[], None] | None = None,
    ) -> None:
        # `freeze_heap`: once the first lists are in, move everything alive out of the garbage
        # collector's reach (gc.freeze) before the first verb is answered. A full collection walks
        # every tracked object; at 5,000 nodes the listed cluster alone is ~200,000 of them, and a
        # full collection that a verb's allocation set off stalled that verb 40-130 ms. Frozen,
        # the stalls in verbs added up to a third to a half less (bench_extender, 5,000 nodes,
        # filter p99 19-28 ms against 34-41 ms). What is frozen is never collected as part of a
        # reference cycle, only freed by its last reference, which is how the view's nodes and
        # pods (no cycles) go. `pause`: each watcher's, before every event.
        self.freeze_heap = freeze_heap
        self.view, self.kube = view, kube
        self.stop = threading.Event()
        self.nodes = Watcher(
            "nodes",
            kube.node_pages,
            kube.watch_nodes,
            view.replace_node_pages,
            view.apply_node,
            lambda o: view.delete_node((o.get("metadata") or {}).get("name", "")),
            self.stop,
            watch_timeout_s,
            pause=pause,
        )
        self.watchers = [self.nodes]
        if pods:
            self.watchers.append(
                Watcher(
                    "pods",
                    kube.assigned_pod_pages,
                    kube.watch_assigned_pods,
                    view.replace_assigned_pages,
                    view.apply_assigned,
                    view.delete_assigned,
                    self.stop,
                    watch_timeout_s,
                    pause=pause,
                )
            )
            # the pods' default class: read by every filter, so kept here, not read on the verb path
            self.watchers.append(
                Watcher(
                    "namespaces",
                    kube.namespace_pages,
                    kube.watch_namespaces,
                    kube.replace_namespace_pages,
                    kube.apply_namespace,
                    kube.delete_namespace,
                    self.stop,
                    watch_timeout_s,
                    pause=pause,
                )
            )
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for w in self.watchers:
            t = threading.Thread(target=w.run, name=f"watch-{w.kind}", daemon=True)
            t.start()
            self.threads.append(t)
        threading.Thread(target=self._mark_ready, name="sync-ready", daemon=True).start()

    def _mark_ready(self) -> None:
        # Nodes first: pods are charged onto nodes, so the first pod list is complete only after.
        while not self.stop.is_set():
            if all(w.listed.wait(0.5) for w in self.watchers):
                if self.freeze_heap:
                    gc.collect()
                    gc.freeze()
                self.view.synced.set()
                return

    def close(self) -> None:
        self.stop.set()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return self.view.synced.wait(max(0.0, deadline - time.monotonic()))
