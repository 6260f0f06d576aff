"""A small HTTP proxy in front of the real kube-apiserver, for faults it will not produce on demand.

Everything is served by the real API server; the proxy only adds what a test asks for: a Status
error instead of the Nth matching request (`fail_next`), a delay (`delay`), cutting every open watch
(`cut_watches`; `open_watches` says which are in flight, so a test can wait for a client to have
re-established them), and a record of the requests that passed (`requests`). A component under test gets
a kubeconfig whose server is `proxy.url` (plain HTTP on loopback) and its own token; the proxy
forwards headers unchanged, so authentication and authorization are still the real server's.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_REASONS = {400: "BadRequest", 404: "NotFound", 409: "Conflict", 410: "Expired", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}  # fmt: skip


@dataclass
class _Fault:
    method: str | None
    path: re.Pattern[str]
    times: int
    status: int = 0
    message: str = ""
    seconds: float = 0.0
    retry_after: int | None = None
    skip: int = 0  # let this many matching requests through first
    forward: bool = False  # pass the request on first: the API server acts, its answer is lost

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and bool(self.path.search(path))


@dataclass
class Record:
    method: str
    path: str
    query: dict[str, list[str]] = field(default_factory=dict)


class FaultProxy:
    def __init__(self, upstream: str, tls: tuple[str, str] | None = None) -> None:
        """`tls` = (certificate file, key file) serves HTTPS: Go clients (kube-scheduler, kubectl)
        send a kubeconfig's credentials only over TLS, so plain HTTP would make them anonymous."""
        u = urlsplit(upstream)
        self._host, self._port = u.hostname or "127.0.0.1", u.port or 443
        self._ctx = ssl.create_default_context()
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._records: list[Record] = []
        # watch streams in flight: (client socket, upstream connection, path)
        self._watches: set[tuple[socket.socket, http.client.HTTPSConnection, str]] = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._serve(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            sctx.load_cert_chain(*tls)
            self._server.socket = sctx.wrap_socket(self._server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="faultproxy")

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.cut_watches()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- what tests call --
    def fail_next(self, method: str | None, path_regex: str, status: int, times: int = 1, message: str = "",
                  retry_after: int | None = None, skip: int = 0) -> None:  # fmt: skip
        """Answer the next `times` matching requests (after letting `skip` through) with a Status."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), times, status=status,
                                       message=message or f"injected {status}", retry_after=retry_after,
                                       skip=skip))  # fmt: skip

    def lose_answer_next(self, method: str, path_regex: str, status: int = 504, times: int = 1) -> None:
        """Pass the next `times` matching requests on, then answer `status` instead of the API
        server's answer: the write happened, the client cannot know it."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), times, status=status,
                                       message=f"injected {status} (the request was served)", forward=True))  # fmt: skip

    def delay(self, path_regex: str, seconds: float, method: str | None = None, times: int = 1) -> None:
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), times, seconds=seconds))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def cut_watches(self) -> int:
        """Close every watch stream in flight, as a dropped connection would; how many there were.
        They are forgotten at once: `open_watches` then lists only the ones opened since."""
        with self._lock:
            cut = list(self._watches)
            self._watches.clear()
        for s, upstream, _ in cut:
            for sock in (s, upstream.sock):
                try:
                    if sock is not None:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return len(cut)

    def open_watches(self) -> list[str]:
        """The paths of the watch streams in flight (opened since the last `cut_watches`), sorted."""
        with self._lock:
            return sorted(path for _, _, path in self._watches)

    @property
    def requests(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def count(self, method: str, path_regex: str) -> int:
        rx = re.compile(path_regex)
        return sum(1 for r in self.requests if r.method == method and rx.search(r.path))

    def clear_requests(self) -> None:
        with self._lock:
            self._records.clear()

    # -- serving --
    def _take(self, method: str, path: str) -> tuple[float, _Fault | None]:
        wait, fail = 0.0, None
        with self._lock:
            for f in self._faults:
                if f.times <= 0 or not f.matches(method, path):
                    continue
                if f.skip > 0:
                    f.skip -= 1
                    continue
                if f.status and fail is None:
                    f.times -= 1
                    fail = f
                elif f.seconds and not f.status:
                    f.times -= 1
                    wait += f.seconds
            self._faults = [f for f in self._faults if f.times > 0]
        return wait, fail

    def _forward_and_drop(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        headers = {
            k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection", "content-length")
        }
        conn = http.client.HTTPSConnection(self._host, self._port, context=self._ctx, timeout=60)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            conn.getresponse().read()
        finally:
            conn.close()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        u = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        with self._lock:
            self._records.append(Record(h.command, u.path, parse_qs(u.query)))
        wait, fail = self._take(h.command, u.path)
        if wait:
            time.sleep(wait)
        if fail is not None and fail.forward:
            self._forward_and_drop(h, body)
        if fail is not None:
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": fail.message, "reason": _REASONS.get(fail.status, "InternalError"),
                      "code": fail.status}  # fmt: skip
            data = json.dumps(status).encode()
            h.send_response(fail.status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            if fail.retry_after is not None:
                h.send_header("Retry-After", str(fail.retry_after))
            h.end_headers()
            h.wfile.write(data)
            return
        headers = {
            k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection", "content-length")
        }
        conn = http.client.HTTPSConnection(self._host, self._port, context=self._ctx, timeout=600)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            h.send_error(502, f"upstream: {e}")
            return
        watching = "watch=true" in u.query or "watch=1" in u.query
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                h.send_header(k, v)
        if not watching and resp.getheader("Transfer-Encoding") != "chunked":
            data = resp.read()
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            conn.close()
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        entry = (h.connection, conn, u.path)
        with self._lock:
            self._watches.add(entry)
        try:
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            h.close_connection = True
        finally:
            with self._lock:
                self._watches.discard(entry)
            conn.close()
