"""The HTTP front of the in-test API server: routing, watch streaming, fault injection."""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from . import errors
from .errors import ApiError
from .registry import JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH, Registry, clone
from .resources import BY_PATH, RESOURCES, Resource, lookup
from .selectors import fields_match, labels_match, make_filter, parse_field_selector, parse_label_selector
from .store import Obj, Store

_BASE_FIELDS = ("metadata.name", "metadata.namespace")
_TRUE = ("true", "1", "True")


class RequestRecord(NamedTuple):
    method: str
    path: str
    query: dict[str, str]


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int
    reason: str | None
    message: str | None
    retry_after: int | None


@dataclass
class _Delay:
    method: str
    pattern: re.Pattern[str]
    seconds: float
    times: int | None


class _Route(NamedTuple):
    resource: Resource
    namespace: str | None  # None: cluster-scoped resource, or a list across all namespaces
    name: str | None
    sub: str | None
    watch: bool


def _discovery(path: str) -> dict[str, Any] | None:
    if path in ("/version", "/version/"):
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0-gpupack-test",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2024-08-13T00:00:00Z",
            "goVersion": "go1.22.5",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if path == "/apis":
        groups = sorted({r.group for r in RESOURCES if r.group})
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                    "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"},
                }
                for g in groups
            ],
        }
    m = re.fullmatch(r"/api/v1|/apis/([^/]+)/(v1)", path)
    if m:
        group = m.group(1) or ""
        res = [r for r in RESOURCES if r.group == group]
        if not res:
            return None
        items = []
        for r in res:
            verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
            items.append(
                {
                    "name": r.plural,
                    "singularName": r.kind.lower(),
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": verbs,
                }
            )
            for sub in sorted(r.subresources):
                items.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["get", "patch", "update", "create"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": res[0].api_version,
            "resources": items,
        }
    return None


def _route(path: str) -> _Route | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch = False
    if rest and rest[0] == "watch":  # deprecated /watch/ prefix
        watch, rest = True, rest[1:]
    if not rest:
        return None
    if (
        rest[0] == "namespaces"
        and group == ""
        and (len(rest) == 2 or (len(rest) == 3 and rest[2] in ("status", "finalize")))
    ):
        res = BY_PATH.get(("", version, "namespaces"))
        return _Route(res, None, rest[1], rest[2] if len(rest) == 3 else None, watch) if res else None
    ns: str | None = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        ns, rest = rest[1], rest[2:]
    res = BY_PATH.get((group, version, rest[0]))
    if res is None or len(rest) > 3 or (ns is not None and not res.namespaced):
        return None
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and sub not in res.subresources:
        return None
    if res.namespaced and ns is None and name is not None:
        return None
    return _Route(res, ns, name, sub, watch)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        pass

    def setup(self) -> None:
        super().setup()
        self.server.api._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.api._track(self.connection, False)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = lambda self: self._dispatch()  # noqa: E731

    # --- plumbing -----------------------------------------------------------------------------

    def _send_json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send_raw(code, json.dumps(body, separators=(",", ":")).encode(), headers)

    def _send_raw(self, code: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self._send_json(err.code, err.status(), err.headers)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        limit = self.server.api.max_body_bytes
        if limit is not None and length > limit:
            # Drain what the client is sending so it reads our 413 rather than a reset connection.
            left = length
            while 0 < left <= 256 * 1024 * 1024:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
            self.close_connection = left != 0
            raise ApiError(413, f"Request entity too large: limit is {limit}", "RequestEntityTooLarge")
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        api = self.server.api
        split = urlsplit(self.path)
        path = split.path
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        method = self.command
        api._record(RequestRecord(method, path, query))
        try:
            raw = self._read_body()
            api._apply_delays(method, path)
            api._maybe_fail(method, path)
            self._handle(method, path, query, raw)
        except ApiError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a server bug must still look like an apiserver error to the client
            traceback.print_exc(file=sys.stderr)
            self._send_error(ApiError(500, f"Internal error occurred: {exc!r}", "InternalError"))

    def _json_body(self, raw: bytes) -> Any:
        ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if ctype not in ("application/json", MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH, "*/*", ""):
            raise ApiError(
                415,
                f'the body of the request was in an unknown format - accepted media types include: application/json (got "{ctype}")',
                "UnsupportedMediaType",
            )
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise errors.bad_request(f"error decoding request body: {exc}") from None

    # --- routing ------------------------------------------------------------------------------

    def _handle(self, method: str, path: str, query: dict[str, str], raw: bytes) -> None:
        api = self.server.api
        reg = api.registry
        if method == "GET":
            if path in ("/healthz", "/readyz", "/livez"):
                data = b"ok"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            doc = _discovery(path.rstrip("/") if path != "/" else path)
            if doc is not None:
                self._send_json(200, doc)
                return
        route = _route(path)
        if route is None:
            raise errors.path_not_found()
        res, ns, name, sub, watch = route
        dry_run = query.get("dryRun") == "All"
        if name is None:  # collection
            if method == "GET":
                if watch or query.get("watch") in _TRUE:
                    self._watch(res, ns, query)
                else:
                    self._list(res, ns, query)
            elif method == "POST":
                if res.namespaced and ns is None:
                    raise errors.method_not_allowed(method)
                self._send_json(201, reg.create(res, ns or "", self._json_body(raw), dry_run))
            elif method == "DELETE":
                if res.namespaced and ns is None:
                    raise errors.method_not_allowed(method)
                matches = self._filter(res, query)
                gone = reg.delete_collection(res, ns, matches, self._json_body(raw))
                self._send_json(
                    200, {"kind": res.list_kind, "apiVersion": res.api_version, "metadata": {}, "items": gone}
                )
            else:
                raise errors.method_not_allowed(method)
            return
        nsv = ns or ""
        if sub in (None, "status"):
            if method == "GET":
                self._send_json(200, reg.get(res, nsv, name))
            elif method == "PUT":
                self._send_json(200, reg.update(res, nsv, name, self._json_body(raw), sub, dry_run))
            elif method == "PATCH":
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                self._send_json(200, reg.patch(res, nsv, name, self._json_body_any(raw), ctype, sub, dry_run))
            elif method == "DELETE" and sub is None:
                code, body = reg.delete(res, nsv, name, self._json_body(raw), dry_run)
                self._send_json(code, body)
            else:
                raise errors.method_not_allowed(method)
        elif sub == "binding" and method == "POST":
            self._send_json(201, reg.bind(nsv, name, self._json_body(raw), dry_run))
        elif sub == "eviction" and method == "POST":
            self._send_json(201, reg.evict(nsv, name, self._json_body(raw)))
        else:
            raise errors.method_not_allowed(method)

    def _json_body_any(self, raw: bytes) -> Any:
        try:
            return json.loads(raw) if raw else None
        except ValueError as exc:
            raise errors.bad_request(f"error decoding patch body: {exc}") from None

    def _selectors(self, res: Resource, query: dict[str, str]) -> tuple[list[Any], list[Any]]:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), _BASE_FIELDS + res.field_labels)
        return labels, fields

    def _filter(self, res: Resource, query: dict[str, str]) -> Any:
        return make_filter(*self._selectors(res, query))

    def _list(self, res: Resource, ns: str | None, query: dict[str, str]) -> None:
        labels, fields = self._selectors(res, query)
        hint = next(((f, v) for f, eq, v in fields if eq and f == "spec.nodeName"), None)
        try:
            limit = int(query.get("limit") or 0)
        except ValueError:
            raise errors.bad_request(f"invalid limit {query.get('limit')!r}") from None
        _, raws, rv, token, remaining = self.server.api.registry.list(
            res, ns, make_filter(labels, fields), hint, limit, query.get("continue")
        )
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if token:
            meta["continue"] = token
            meta["remainingItemCount"] = remaining
        head = json.dumps(
            {"kind": res.list_kind, "apiVersion": res.api_version, "metadata": meta}, separators=(",", ":")
        )
        self._send_raw(200, b"".join((head[:-1].encode(), b',"items":[', b",".join(raws), b"]}")))

    # --- watch --------------------------------------------------------------------------------

    def _chunk(self, payload: dict[str, Any]) -> None:
        self._write_chunk(json.dumps(payload, separators=(",", ":")).encode() + b"\n")

    def _event(self, kind: str, raw: bytes) -> None:
        self._write_chunk(b'{"type":"%s","object":%s}\n' % (kind.encode(), raw))

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _client_gone(self) -> bool:
        """True once the client closed the connection (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _watch(self, res: Resource, ns: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        with api._lock:
            api._active_watches += 1
        try:
            self._watch_stream(res, ns, query)
        finally:
            with api._lock:
                api._active_watches -= 1

    def _watch_stream(self, res: Resource, ns: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        store = api.store
        labels, fields = self._selectors(res, query)
        rv_text = query.get("resourceVersion") or ""
        try:
            since = int(rv_text) if rv_text else 0
            timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else api.watch_timeout
        except ValueError:
            raise errors.bad_request(f"invalid resourceVersion or timeoutSeconds: {rv_text!r}") from None
        bookmarks = query.get("allowWatchBookmarks") in _TRUE

        def wanted(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            if ns is not None and meta.get("namespace") != ns:
                return False
            return labels_match(labels, meta.get("labels")) and fields_match(fields, obj)

        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout
        initial: list[bytes] = []
        with store.cond:
            try:
                if since == 0:  # "" and "0": synthetic ADDED for current state, then changes
                    initial = store.raw_items(res, [o for o in store.items(res, ns) if wanted(o)])
                    position = store.start_position(res, store.rv)
                else:
                    position = store.start_position(res, since)
            except ApiError as err:
                self._end_watch(err)
                return
            last_rv = store.rv
        try:
            for raw in initial:
                self._event("ADDED", raw)
            last_bookmark = time.monotonic()
            while True:
                with store.cond:
                    while True:
                        if api._stopping.is_set():
                            break
                        try:
                            events, position = store.events_from(res, position)
                        except ApiError:
                            events = None
                            expired_err = errors.expired(last_rv, store.rs(res).compacted_rv)
                            break
                        if events:
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        if bookmarks and time.monotonic() - last_bookmark >= api.bookmark_interval:
                            break
                        wait = min(left, api.bookmark_interval) if bookmarks else left
                        store.cond.wait(min(wait, 0.5))
                        if self._client_gone():
                            raise ConnectionResetError("watch client went away")
                    current_rv = store.rv
                if events is None:
                    self._end_watch(expired_err)
                    return
                for ev in events:
                    last_rv = ev.rv
                    new_ok, old_ok = wanted(ev.obj), wanted(ev.old)
                    if ev.type == "MODIFIED" and new_ok != old_ok:
                        # The object moved into or out of the selector: the real cache says so this way.
                        self._event("ADDED" if new_ok else "DELETED", ev.raw)
                    elif new_ok or (ev.type == "DELETED" and old_ok):
                        self._event(ev.type, ev.raw)
                if api._stopping.is_set() or time.monotonic() >= deadline:
                    break
                if bookmarks and time.monotonic() - last_bookmark >= api.bookmark_interval:
                    last_rv = max(last_rv, current_rv)
                    self._chunk(
                        {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": res.kind,
                                "apiVersion": res.api_version,
                                "metadata": {"resourceVersion": str(last_rv)},
                            },
                        }
                    )
                    last_bookmark = time.monotonic()
            self._end_watch(None)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def _end_watch(self, err: ApiError | None) -> None:
        if err is not None:
            self._chunk({"type": "ERROR", "object": err.status()})
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    api: KubeAPIServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients dropping keep-alive connections is normal; anything else is a bug worth printing.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class KubeAPIServer:
    """An in-process Kubernetes API server on 127.0.0.1 for tests; see the package docstring."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        require_namespaces: bool = True,
        namespaces: tuple[str, ...] = ("default", "kube-system", "kube-public", "kube-node-lease"),
        history_limit: int = 10_000,
        max_body_bytes: int | None = 3 * 1024 * 1024,
        watch_timeout: float = 1800.0,
        bookmark_interval: float = 1.0,
        record_requests: bool = True,
    ) -> None:
        self.host, self.port = host, port
        self.store = Store(history_limit)
        self.registry = Registry(self.store, require_namespaces)
        self.max_body_bytes = max_body_bytes
        self.watch_timeout = watch_timeout
        self.bookmark_interval = bookmark_interval
        self.record_requests = record_requests
        self._lock = threading.Lock()
        self._requests: list[RequestRecord] = []
        self._faults: list[_Fault] = []
        self._delays: list[_Delay] = []
        self._connections: set[socket.socket] = set()
        self._active_watches = 0
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        for ns in namespaces:
            self.registry.create(lookup("namespaces"), "", {"metadata": {"name": ns}})

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> KubeAPIServer:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        # After stop(), start() comes back on the same port with the same objects, like an
        # apiserver restart: clients reconnect, watches must be re-established.
        self._httpd = _HTTPServer((self.host, self.port), _Handler)
        self._httpd.api = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="kubeapi", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watches end (their chunked streams are terminated)."""
        if self._httpd is None:
            return
        self._stopping.set()
        with self.store.cond:
            self.store.cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            conns = list(self._connections)
        deadline = time.monotonic() + 2.0
        while conns and time.monotonic() < deadline:
            # Give watch handlers a moment to write their final chunk, then cut idle keep-alives.
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RD)
            time.sleep(0.02)
            with self._lock:
                conns = list(self._connections)
        self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> KubeAPIServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` talking to this server."""
        from kubernetes import client

        config = client.Configuration(host=self.url)
        return client.ApiClient(config)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    # --- observation and fault injection ------------------------------------------------------

    def _record(self, rec: RequestRecord) -> None:
        if not self.record_requests:
            return
        with self._lock:
            self._requests.append(rec)

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request so far as (method, path, query-dict), oldest first (a snapshot)."""
        with self._lock:
            return list(self._requests)

    @property
    def active_watches(self) -> int:
        """Watch streams currently open (they end on timeout, client disconnect, or stop())."""
        with self._lock:
            return self._active_watches

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def count_requests(self, method: str | None = None, path_regex: str = "") -> int:
        pattern = re.compile(path_regex)
        with self._lock:
            return sum(
                1 for r in self._requests if (method is None or r.method == method) and pattern.search(r.path)
            )

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int,
        times: int = 1,
        *,
        reason: str | None = None,
        message: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next `times` requests matching (method or "*", regex searched in the path)
        with a Status of code `status` instead of serving them."""
        with self._lock:
            self._faults.append(
                _Fault(method.upper(), re.compile(path_regex), status, times, reason, message, retry_after)
            )

    def delay(self, path_regex: str, seconds: float, *, method: str = "*", times: int | None = None) -> None:
        """Sleep `seconds` before serving requests whose path matches (forever unless `times`)."""
        with self._lock:
            self._delays.append(_Delay(method.upper(), re.compile(path_regex), seconds, times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._delays.clear()

    def _maybe_fail(self, method: str, path: str) -> None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.method in ("*", method) and fault.pattern.search(path):
                    fault.times -= 1
                    break
            else:
                return
            self._faults = [f for f in self._faults if f.times > 0]
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
        raise ApiError(
            fault.status, fault.message or f"injected failure ({fault.status})", fault.reason, headers=headers
        )

    def _apply_delays(self, method: str, path: str) -> None:
        total = 0.0
        with self._lock:
            for d in self._delays:
                if (d.times is None or d.times > 0) and d.method in ("*", method) and d.pattern.search(path):
                    total += d.seconds
                    if d.times is not None:
                        d.times -= 1
            self._delays = [d for d in self._delays if d.times is None or d.times > 0]
        if total:
            time.sleep(total)

    # --- direct access for tests (same semantics and watch events as over HTTP) ---------------

    @property
    def resource_version(self) -> int:
        with self.store.cond:
            return self.store.rv

    def compact(self) -> int:
        """Forget all watch history (like etcd compaction); returns the compacted revision."""
        with self.store.cond:
            return self.store.compact()

    def get(self, resource: str, name: str, namespace: str = "") -> Obj | None:
        res = lookup(resource)
        with self.store.cond:
            obj = self.store.get(res, namespace, name)
        return clone(obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None) -> list[Obj]:
        res = lookup(resource)
        with self.store.cond:
            items = self.store.items(res, namespace)
        return clone(items)

    def create(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        """Create as a POST would (defaults, validation, watch event); returns a copy."""
        res = lookup(resource)
        body = clone(obj)
        ns = (
            namespace
            or (body.get("metadata") or {}).get("namespace")
            or ("default" if res.namespaced else "")
        )
        created = self.registry.create(res, ns, body)
        with self.store.cond:
            raw = self.store.raw_get(res, ns, created["metadata"]["name"])
        return json.loads(raw) if raw is not None else clone(created)

    def create_many(self, resource: str, objs: Any, namespace: str | None = None) -> int:
        """Create many objects quickly (seeding benchmarks); returns how many were created."""
        res = lookup(resource)
        count = 0
        for obj in objs:
            body = clone(obj)
            ns = (
                namespace
                or (body.get("metadata") or {}).get("namespace")
                or ("default" if res.namespaced else "")
            )
            self.registry.create(res, ns, body)
            count += 1
        return count

    def patch(self, resource: str, name: str, patch: Any, namespace: str = "", *, status: bool = False,
              content_type: str = MERGE_PATCH) -> Obj:  # fmt: skip
        res = lookup(resource)
        return clone(
            self.registry.patch(
                res, namespace, name, clone(patch), content_type, "status" if status else None
            )
        )

    def set_status(self, resource: str, name: str, status: dict[str, Any], namespace: str = "") -> Obj:
        """Replace .status wholesale, as a kubelet or controller would through the status subresource."""
        res = lookup(resource)
        with self.store.cond:
            current = self.registry.get(res, namespace, name)
            body = dict(current, status=clone(status))
            return clone(
                self.registry.update(res, namespace, name, body, "status" if res.has_status else None)
            )

    def delete(self, resource: str, name: str, namespace: str = "") -> None:
        self.registry.delete(lookup(resource), namespace, name)

    def sync_pdb_status(self, namespace: str | None = None) -> None:
        self.registry.sync_pdb_status(namespace)
