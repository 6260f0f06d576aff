"""The few Kubernetes API calls the extender makes, over the official client, as raw JSON.

Raw JSON (`_preload_content=False`) because the client's model deserialisation costs more than
the scheduling decision itself, and the view works on API-shaped dicts anyway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import orjson
from kubernetes import client
from kubernetes.client.rest import ApiException

from gpupack import kubeclient

MERGE_PATCH = "application/merge-patch+json"
# Namespaces' labels read from the API server and kept for `ns_ttl_s`, at most this many.
NS_CACHE_MAX = 10_000
# Every call on the bind path is bounded: a bind makes at most a lease read, a pod read and a
# Binding (a few more when that Binding's outcome must be found out), and must answer within
# kube-scheduler's extender httpTimeout (15 s).
API_TIMEOUT_S = 2.0
API_CONNECTIONS = 128  # at least the extender's request threads (see api_client)
# Every pod on a node that still holds its requests there (what kube-scheduler counts): the node's
# CPU and memory in use. A pod that ends (Succeeded/Failed) leaves this selection as DELETED.
ASSIGNED_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (or $KUBECONFIG). Binds run
    concurrently, one per request thread, over this one client: the pool holds API_CONNECTIONS."""
    return kubeclient.api_client(kubeconfig, connections=API_CONNECTIONS)


class NamespaceUnreadable(Exception):
    """A namespace's labels could not be read (not: it has none)."""


_Bounded = kubeclient.bounded


def _unbound(scheduler_name: str) -> str:
    return f"spec.schedulerName={scheduler_name},spec.nodeName="


def _collect(pages: Iterator[tuple[list[dict[str, Any]], str]]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    last = ""
    for page, rv in pages:
        items.extend(page)
        last = rv
    return {"metadata": {"resourceVersion": last}, "items": items}


def _json(resp: Any) -> Any:
    # orjson, as the watch (sync.py): the first list of a large cluster's pods and the preemption
    # pass's list of every unscheduled pod spent most of their CPU in the standard library's decoder
    data = resp.data
    return orjson.loads(data) if data else None


def _object(resp: Any) -> dict[str, Any]:
    """An answer that is one object (a Pod, a Lease): typed as such, not checked."""
    return cast(dict[str, Any], _json(resp))


class Kube:
    def __init__(
        self,
        api: client.ApiClient,
        ns_ttl_s: float = 60.0,
        page: int = 1000,
        timeout_s: float = API_TIMEOUT_S,
    ) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.coordination = client.CoordinationV1Api(api)
        self.page = page
        self.core = client.CoreV1Api(api)
        self._ns_cache: dict[str, tuple[float, dict[str, str]]] = {}
        self._ns_lock = threading.Lock()
        self.ns_ttl_s = ns_ttl_s
        # Namespace labels as a watch keeps them (name -> labels; None until a Sync lists them).
        # With it a filter reads a pod's namespace from memory: a GET there stalled kube-scheduler's
        # serial cycle once a minute per namespace (~170 ms in a 500-pod burst at 1,000 nodes, the
        # API server busy with binds), and a class label changed on a namespace took up to a
        # minute to count.
        self._ns_watched: dict[str, dict[str, str]] | None = None

    def tracked_sizes(self) -> dict[str, int]:
        """Namespaces kept: read ones (short-lived, at most NS_CACHE_MAX) and watched ones."""
        with self._ns_lock:
            read = len(self._ns_cache)
        return {"kube.ns_read": read, "kube.ns_watched": len(self._ns_watched or ())}

    # --- reads ----------------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return _object(
            _Bounded(self.core.read_namespaced_pod)(
                name, namespace, _preload_content=False, _request_timeout=self.timeout_s
            )
        )

    def read_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return _object(
            _Bounded(self.coordination.read_namespaced_lease)(
                name, namespace, _preload_content=False, _request_timeout=self.timeout_s
            )
        )

    def unscheduled_pods(self, scheduler_name: str, cached: bool = False) -> list[dict[str, Any]]:
        """Pods of `scheduler_name` not bound to a node yet (all namespaces). `cached`: from the API
        server's watch cache (resourceVersion 0: maybe a moment old, but no etcd read of every pod),
        for lists repeated as often as every few seconds."""
        out: list[dict[str, Any]] = []
        for items, _rv in self.pending_pod_pages(scheduler_name, cached, _request_timeout=(10, 60)):
            out.extend(items)
        return out

    def pages(self, fn: Any, **kw: Any) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """A full list in pages of `page` items, yielded as (items, resourceVersion) so a caller
        can apply them one page at a time (50,000 pods at once would sit in memory twice). The
        API server keeps the pages consistent with the first one."""
        token = None
        while True:
            page = _json(fn(limit=self.page, _continue=token, _preload_content=False, **kw)) or {}
            meta = page.get("metadata") or {}
            yield list(page.get("items") or []), str(meta.get("resourceVersion") or "")
            token = meta.get("continue")
            if not token:
                return

    def pending_pod_pages(
        self, scheduler_name: str, cached: bool = True, **kw: Any
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """The pods of `scheduler_name` not bound to a node yet, in pages (see `pages`). `cached`
        (the default): from the API server's watch cache (resourceVersion 0); from etcd, the
        selection reads every pod of the cluster to find the few waiting."""
        if cached:
            kw["resource_version"] = "0"
        return self.pages(
            self.core.list_pod_for_all_namespaces, field_selector=_unbound(scheduler_name), **kw
        )

    def watch_pending_pods(self, scheduler_name: str, resource_version: str, timeout_s: int) -> Any:
        return self._watch(
            self.core.list_pod_for_all_namespaces,
            resource_version,
            timeout_s,
            field_selector=_unbound(scheduler_name),
        )

    def assigned_pod_pages(self) -> Iterator[tuple[list[dict[str, Any]], str]]:
        return self.pages(self.core.list_pod_for_all_namespaces, field_selector=ASSIGNED_PODS)

    def node_pages(self) -> Iterator[tuple[list[dict[str, Any]], str]]:
        return self.pages(self.core.list_node)

    def list_pods(self) -> dict[str, Any]:
        """Every pod with a node, not terminal: gpupack's bound pods among them (see ASSIGNED_PODS)."""
        return _collect(self.assigned_pod_pages())

    def list_nodes(self) -> dict[str, Any]:
        return _collect(self.node_pages())

    def watch_assigned_pods(self, resource_version: str, timeout_s: int) -> Any:
        return self._watch(
            self.core.list_pod_for_all_namespaces, resource_version, timeout_s, field_selector=ASSIGNED_PODS
        )

    def watch_nodes(self, resource_version: str, timeout_s: int) -> Any:
        return self._watch(self.core.list_node, resource_version, timeout_s)

    @staticmethod
    def _watch(
        list_fn: Any,
        resource_version: str,
        timeout_s: int,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> Any:
        # The read timeout outlives the server-side one, so a quiet watch ends cleanly, not in error.
        return list_fn(
            label_selector=label_selector,
            field_selector=field_selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            _preload_content=False,
            _request_timeout=(10, timeout_s + 30),
        )

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        """Labels of a namespace: from the namespace watch when one runs (see
        :meth:`replace_namespace_pages`), else (and for a namespace the watch has not delivered
        yet: created a moment ago) read and cached briefly; {} when it does not exist. Any other
        failure raises NamespaceUnreadable and is not cached: a namespace's labels set its pods'
        default class, so "unknown" must never become "no labels" (an offline namespace's pod
        recorded online)."""
        watched = self._ns_watched
        if watched is not None:
            hit_labels = watched.get(namespace)
            if hit_labels is not None:
                return hit_labels
        now = time.monotonic()
        with self._ns_lock:
            hit = self._ns_cache.get(namespace)
            if hit is not None and now - hit[0] < self.ns_ttl_s:
                return hit[1]
        try:
            ns = (
                _json(
                    _Bounded(self.core.read_namespace)(
                        namespace, _preload_content=False, _request_timeout=self.timeout_s
                    )
                )
                or {}
            )
            labels = dict((ns.get("metadata") or {}).get("labels") or {})
        except ApiException as e:
            if e.status != 404:
                raise NamespaceUnreadable(
                    f"cannot read namespace {namespace} (its labels set the pod's default class): "
                    f"{e.status} {e.reason}; the pod is retried"
                ) from e
            labels = {}
        with self._ns_lock:
            if len(self._ns_cache) >= NS_CACHE_MAX:
                # Only namespaces the watch has not delivered are read (every one, without a
                # watch): expired reads go first, and if all are fresh, all of them
                for name in [n for n, (at, _) in self._ns_cache.items() if now - at >= self.ns_ttl_s]:
                    del self._ns_cache[name]
                if len(self._ns_cache) >= NS_CACHE_MAX:
                    self._ns_cache.clear()
            self._ns_cache[namespace] = (now, labels)
        return labels

    # The namespace watch (Sync runs it): what it delivers wins over a read of the same namespace,
    # which is kept in the short-lived cache only, so an older read never overwrites a newer event.
    def replace_namespace_pages(self, pages: Iterator[list[dict[str, Any]]]) -> None:
        fresh: dict[str, dict[str, str]] = {}
        for items in pages:
            for obj in items:
                meta = obj.get("metadata") or {}
                if meta.get("name"):
                    fresh[str(meta["name"])] = dict(meta.get("labels") or {})
        self._ns_watched = fresh

    def apply_namespace(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if meta.get("name") and self._ns_watched is not None:
            self._ns_watched[str(meta["name"])] = dict(meta.get("labels") or {})

    def delete_namespace(self, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        if self._ns_watched is not None:
            self._ns_watched.pop(str(name), None)
        with self._ns_lock:
            self._ns_cache.pop(str(name), None)

    def watched_namespaces(self) -> frozenset[str]:
        """The namespaces the watch has delivered (empty while no watch has listed them)."""
        return frozenset(self._ns_watched or ())

    def namespace_pages(self) -> Iterator[tuple[list[dict[str, Any]], str]]:
        return self.pages(self.core.list_namespace)

    def watch_namespaces(self, resource_version: str, timeout_s: int) -> Any:
        return self._watch(self.core.list_namespace, resource_version, timeout_s)

    # --- writes ---------------------------------------------------------------------------------
    def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str | None],
        labels: dict[str, str | None],
        resource_version: str | None,
    ) -> dict[str, Any]:
        """JSON merge patch of annotations/labels; with resource_version, 409 if the pod changed."""
        meta: dict[str, Any] = {"annotations": annotations, "labels": labels}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return _object(
            _Bounded(self.core.patch_namespaced_pod)(
                name,
                namespace,
                {"metadata": meta},
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self.timeout_s,
            )
        )

    def bind(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: dict[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        """POST the pod's Binding. The API server copies the Binding's annotations onto the pod in the
        same write that sets its node, and checks the uid and (when given) the resourceVersion
        as preconditions (409 when either differs, or the pod is bound already)."""
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(
                name=name,
                namespace=namespace,
                uid=uid or None,
                resource_version=resource_version or None,
                annotations=annotations or None,
            ),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        # The response is a Status the client's model cannot always deserialise; do not try. Its
        # bytes are read all the same: only a response read to its end gives its connection back to
        # the pool; left unread, each bind cost the next API call a new TLS connection.
        _Bounded(self.core.create_namespaced_pod_binding)(
            name, namespace, body, _preload_content=False, _request_timeout=self.timeout_s
        ).drain_conn()
