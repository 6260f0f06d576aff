"""A WSGI server that a few connections cannot stall: every listener of gpupack is served here
(the extender's verbs on loopback, its admission webhook and metrics port, and the device plugin's
metrics/health port, both open to the network), each with a budget of its own. Shared code: the
components must not import each other, so it lives in gpupack/ (extender/serve/guarded.py adds the
extender's budgets).

A thread is given a request only once the whole request is in hand: the TLS handshake, the head
and the body are read by one asyncio loop, each within its own deadline (`Limits`), so a client
that connects and sends nothing, or trickles a byte a second, holds a few kilobytes of memory and
no thread. Each listener keeps at most `max_connections` connections, counted from accept (a TLS
connection still in its handshake counts too); a new one past that closes the connection that has
waited longest for its next request (idle, handshaking and slow ones go first; one whose request is
being answered is never closed). On plain TCP the request thread sends the answer with one
non-blocking send (what the socket takes at once: the whole of a verb's answer, without waiting
for the loop to wake); what is left, and every TLS answer, the loop writes within `write_s`, so a
client that stops reading holds no thread either.

Memory is bounded per listener, not only per connection: the bodies being read or waiting for a
thread hold at most `max_body_bytes_in_flight` bytes between them (a declared Content-Length is
counted before its body is read; a chunked body as it arrives). A request that does not fit gets
503 with Retry-After, after the body that has waited longest to be read (over a second: a client
stalling in its body) is closed to make room; at most `max_queued` whole requests wait for a
thread (503 past that). Probes (`/healthz`, `/readyz`, as the listener is told) are answered by
the loop itself, never queued behind the work.

HTTP/1.1 framing is h11's (RFC 9110/9112), with what h11 lets through refused here as well: obs-fold
lines, a bare CR or LF in the head, a header name with `_` that would read as Content-Length or
Transfer-Encoding (other such names are dropped, so none can stand in for a dashed one in the WSGI
environ), Content-Length together with Transfer-Encoding, versions other than 1.0 and 1.1. Content-
Length bodies (kube-scheduler's verbs, the API server's webhook calls and Prometheus' scrapes send
those) or, where a listener allows it (`chunked`), chunked ones, decoded within the same deadline
and size limit. Every malformed request is a 4xx and a closed connection; they are logged as one
line per listener every `COMPLAINT_EVERY_S`, never one per request. Kept-alive connections wait
`idle_s` for the next request. On SIGTERM (`run`) a listener stops accepting and closes its
waiting connections at once, and answers the requests in hand for up to `grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import h11
from werkzeug.http import HTTP_STATUS_CODES

log = logging.getLogger("gpupack.guarded")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
# a probe answered by the loop itself: (status, text); it must not block (it runs on the loop)
Probe = Callable[[], tuple[int, str]]

READ = 65536  # bytes read at once from a connection
COMPLAINT_EVERY_S = 10.0  # malformed requests are logged as one line per listener this often
EVICT_BODY_AFTER_S = 1.0  # a body reading this long may be closed to make room in the byte budget
LINGER_S = 1.0  # after a refusal, what the client still sends is read and dropped this long
RETRY_AFTER_S = 1
END_TASKS_S = 2.0  # on stop, cancelled connection tasks get this long to end before the loop closes


@dataclass(frozen=True)
class Limits:
    handshake_s: float = 5.0  # TLS handshake, from accept
    header_s: float = 5.0  # the request head, from its first byte (or from accept)
    body_s: float = 10.0  # the body, from the end of the head
    idle_s: float = 30.0  # a kept-alive connection waiting for its next request
    write_s: float = 10.0  # the answer, written
    max_connections: int = 4096  # open at once on this listener (handshaking ones included)
    max_header_bytes: int = 16384
    max_body: int = 8 * 1024 * 1024
    threads: int = 8  # requests answered at once (complete requests wait for a thread, not clients)
    chunked: bool = False  # accept chunked request bodies (else 411)
    # bytes of request bodies held at once, being read or waiting for a thread, on all of this
    # listener's connections (503 past it); at least one max_body
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    max_queued: int = 1024  # whole requests waiting for a thread (503 past it)


class _Reject(Exception):
    def __init__(self, status: int, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retry = retry


class _Conn:
    __slots__ = ("writer", "waiting", "since", "reserved", "body_since", "leftover")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting = True  # for (or reading) a request; False while one is answered
        self.since = time.monotonic()
        self.reserved = 0  # bytes of the byte budget this connection's body holds
        self.body_since = 0.0  # when its body started to be read (0: not reading one)
        self.leftover = b""  # bytes received past the last request: the start of the next


class _Complaints:
    """Malformed requests on one listener, logged as at most one line every COMPLAINT_EVERY_S:
    a flood of them costs a few lines, not one (or a traceback) per request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.total = 0
        self.next_at = 0.0

    def note(self, status: int, reason: str, peer: Any, exc: BaseException | None = None) -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now < self.next_at:
            return
        log.warning(
            "%s: %d malformed request(s) refused since the last report; latest from %s: %d %s",
            self.name, self.count, peer, status, reason[:200], exc_info=exc,
        )  # fmt: skip
        self.count, self.next_at = 0, now + COMPLAINT_EVERY_S


class Listener:
    """One listening socket served on `loop`: its connections, limits and thread pool."""

    def __init__(self, app: WSGIApp, host: str, port: int, limits: Limits, tls: ssl.SSLContext | None,
                 name: str, probes: dict[str, Probe] | None = None) -> None:  # fmt: skip
        self.app, self.host, self.port, self.limits, self.tls, self.name = app, host, port, limits, tls, name
        self.probes = dict(probes or {})
        self.pool = ThreadPoolExecutor(limits.threads, thread_name_prefix=f"{name}-req")
        self.conns: dict[int, _Conn] = {}
        self.server: asyncio.Server | None = None
        self.evicted = 0
        self.body_bytes = 0  # held by bodies being read or waiting for a thread
        self.peak_body_bytes = 0
        self.in_pool = 0  # requests given to the pool and not answered yet
        self.refused_busy = 0  # 503s for the byte budget or the queue
        self.complaints = _Complaints(name)

    async def start(self) -> None:
        # TLS is started in _serve, so a connection counts toward max_connections from accept
        self.server = await asyncio.start_server(self._serve, self.host, self.port, limit=READ, backlog=2048)
        if self.port == 0:
            self.port = self.server.sockets[0].getsockname()[1]

    def _make_room(self) -> None:
        waiting = [(c.since, k) for k, c in self.conns.items() if c.waiting]
        while len(self.conns) >= self.limits.max_connections and waiting:
            waiting.sort()
            _, k = waiting.pop(0)
            self._evict(self.conns.pop(k))

    def _evict(self, c: _Conn) -> None:
        self.evicted += 1
        self._release(c)
        _abort(c.writer)

    def _release(self, c: _Conn) -> None:
        self.body_bytes -= c.reserved
        c.reserved, c.body_since = 0, 0.0

    def _reserve(self, c: _Conn, n: int) -> None:
        """Count `n` more bytes of `c`'s body in the listener's budget; past it, close bodies that
        have been read for over EVICT_BODY_AFTER_S (oldest first), then refuse with a 503."""
        budget = max(self.limits.max_body_bytes_in_flight, self.limits.max_body)  # one body always fits
        if self.body_bytes + n > budget:
            now = time.monotonic()
            stalled = sorted(
                (o.body_since, k) for k, o in self.conns.items()
                if o is not c and o.waiting and o.body_since and now - o.body_since >= EVICT_BODY_AFTER_S
            )  # fmt: skip
            for _, k in stalled:
                if self.body_bytes + n <= budget:
                    break
                self._evict(self.conns.pop(k))
            if self.body_bytes + n > budget:
                self.refused_busy += 1
                raise _Reject(503, "too many request bodies in flight; retry", retry=True)
        c.reserved += n
        self.body_bytes += n
        self.peak_body_bytes = max(self.peak_body_bytes, self.body_bytes)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.conns) >= self.limits.max_connections:
            self._make_room()
        conn = _Conn(writer)
        self.conns[id(conn)] = conn
        direct: socket.socket | None = None
        try:
            if self.tls is not None:
                raw = writer.transport
                try:
                    async with asyncio.timeout(self.limits.handshake_s):
                        await writer.start_tls(self.tls)
                except AttributeError:
                    # closed during the handshake (evicted): Python 3.11's start_tls then fails on,
                    # and leaves the writer with, no transport, which its __del__ cannot take
                    if writer.transport is None:
                        setattr(writer, "_transport", raw)  # noqa: B010
                    return
            first = True
            while True:
                conn.waiting, conn.since = True, time.monotonic()
                try:
                    environ = await self._read_request(reader, conn, first)
                except _Reject as e:
                    self._release(conn)
                    peer = writer.get_extra_info("peername")
                    if e.status != 503:
                        self.complaints.note(e.status, str(e), peer)
                    await self._refuse(reader, writer, e)
                    return
                except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError, OSError):
                    return
                except Exception as e:  # a parser's surprise is the client's 400, never a dropped connection
                    self._release(conn)
                    self.complaints.note(400, f"unreadable request ({type(e).__name__})",
                                         writer.get_extra_info("peername"), e)  # fmt: skip
                    await self._refuse(reader, writer, _Reject(400, "malformed request"))
                    return
                if environ is None:
                    return
                first = False
                conn.waiting = False
                conn.body_since = 0.0
                keep = _keep_alive(environ)
                probe = self.probes.get(environ["PATH_INFO"])
                if probe is not None and environ["REQUEST_METHOD"] in ("GET", "HEAD"):
                    # answered here: a probe never waits behind the work queue
                    self._release(conn)
                    try:
                        status, text = probe()
                    except Exception as e:  # a probe's bug is its 500, logged at most every 10 s
                        self.complaints.note(500, f"probe {environ['PATH_INFO']} failed", "-", e)
                        status, text = 500, "probe failed\n"
                    data = _answer(status, [("Content-Type", "text/plain")], text.encode(), not keep)
                    await self._send(writer, data)
                elif self.in_pool >= self.limits.threads + self.limits.max_queued:
                    self._release(conn)
                    self.refused_busy += 1
                    busy = _Reject(503, "too many requests waiting; retry", retry=True)
                    await self._send(writer, _answer(503, _retry(busy), _body(str(busy)), not keep))
                else:
                    if direct is None and self.tls is None:
                        direct = _duplicate(writer)
                    # the thread sends the answer itself when nothing of an earlier one is still
                    # buffered here: the caller has it without waiting for this loop to wake
                    sock = direct if not writer.transport.get_write_buffer_size() else None
                    self.in_pool += 1
                    job = self.pool.submit(_call_and_send, self.app, environ, not keep, sock)
                    try:
                        data, sent = await asyncio.wrap_future(job)
                    except asyncio.CancelledError:
                        if sock is not None:
                            # stopped while a thread may still send on the lent socket: it is
                            # closed once that thread is done, never under it (its descriptor
                            # number could be reused by another connection)
                            job.add_done_callback(_closer(sock))
                            direct = None
                        raise
                    finally:
                        self.in_pool -= 1
                        self._release(conn)  # the body is the thread's no more
                    await self._send(writer, data[sent:] if sent else data)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError, OSError):
            return
        finally:
            self._release(conn)
            self.conns.pop(id(conn), None)
            writer.close()
            if direct is not None:
                direct.close()  # no thread holds it: the request it was lent for has been answered

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, e: _Reject) -> None:
        """Answer a refused request and close. What the client still sends is read and dropped
        for up to LINGER_S first: a socket closed with unread data is reset, and the reset can
        destroy the answer before the client reads it."""
        with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError, OSError, RuntimeError):
            await self._send(writer, _answer(e.status, _retry(e), _body(str(e)), True))
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(READ):
                    pass

    async def _read_request(
        self, reader: asyncio.StreamReader, conn: _Conn, first: bool
    ) -> dict[str, Any] | None:
        lim = self.limits
        p = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_header_bytes)
        raw = conn.leftover
        conn.leftover = b""
        if not raw and not first:
            # a kept-alive connection may wait idle_s for its next request, whose head then has header_s
            try:
                async with asyncio.timeout(lim.idle_s):
                    raw = await reader.read(READ)
            except TimeoutError:
                return None
            if not raw:
                return None  # closed between requests
        conn.since = time.monotonic()
        pieces = [raw] if raw else []
        async with asyncio.timeout(lim.header_s):
            if not raw:  # a new connection's first request: h11 has nothing to look at yet
                raw = await reader.read(READ)
                if not raw:
                    return None  # closed before a request
                pieces.append(raw)
            p.receive_data(raw)
            while True:
                ev = _next(p)
                if isinstance(ev, h11.Request):
                    break
                if ev is h11.NEED_DATA:
                    data = await reader.read(READ)
                    if not data:
                        raise ConnectionError("closed within a request head")
                    pieces.append(data)
                    p.receive_data(data)
                    continue
                raise _Reject(400, "malformed request")
        # h11 has taken the head: what it has not taken yet is the body and what follows it
        head = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        rest = p.trailing_data[0]
        head_end = len(head) - len(rest)
        if head_end > lim.max_header_bytes:  # h11 bounds only a head still incomplete
            raise _Reject(431, f"request head larger than {lim.max_header_bytes} bytes")
        environ, length, chunked = self._environ(ev, head[:head_end], conn.writer)
        if length > lim.max_body:
            raise _Reject(413, f"request body larger than {lim.max_body} bytes")
        conn.body_since = time.monotonic()
        self._reserve(conn, length)  # before its body is read: 503 without reading it
        if p.client_is_waiting_for_100_continue and (chunked or len(rest) < length):
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # (curl waits a second for it)
        if chunked:
            async with asyncio.timeout(lim.body_s):
                body = await self._read_chunked(reader, conn, p)
            environ["CONTENT_LENGTH"] = str(len(body))
        else:
            # h11 has framed it (one valid Content-Length): exactly that many bytes are read here
            # rather than through h11's Data events, a copy or two fewer of each body on the loop
            if len(rest) >= length:
                body, conn.leftover = rest[:length], rest[length:]
            else:
                async with asyncio.timeout(lim.body_s):
                    body = rest + await reader.readexactly(length - len(rest))
        environ["wsgi.input"] = io.BytesIO(body)
        return environ

    async def _read_chunked(self, reader: asyncio.StreamReader, conn: _Conn, p: h11.Connection) -> bytes:
        """A chunked body, decoded by h11 and counted in the byte budget as it arrives. Past
        max_body the rest is read and dropped before the 413, so the answer reaches a client still
        sending (a socket closed with unread data is reset, and the reset can destroy the answer
        before the client reads it); the caller's deadline bounds that."""
        max_body = self.limits.max_body
        parts: list[bytes] = []
        size, over = 0, False
        while True:
            ev = _next(p)
            if isinstance(ev, h11.Data):
                n = len(ev.data)
                size += n
                over = over or size > max_body
                if over:
                    parts.clear()
                    continue
                self._reserve(conn, n)
                parts.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif ev is h11.NEED_DATA:
                data = await reader.read(READ)
                if not data:
                    raise ConnectionError("closed within a request body")
                p.receive_data(data)
            else:
                raise _Reject(400, "malformed request body")
        if over:
            raise _Reject(413, f"request body larger than {max_body} bytes")
        conn.leftover = p.trailing_data[0]
        return b"".join(parts)

    def _environ(
        self, req: h11.Request, head: bytes, writer: asyncio.StreamWriter
    ) -> tuple[dict[str, Any], int, bool]:
        """The WSGI environ of h11's request, its declared body length and whether it is chunked;
        _Reject for the framing h11 lets through but RFC 9112 (or a proxy in front) would not."""
        if req.http_version not in (b"1.1", b"1.0"):
            raise _Reject(505, "only HTTP versions 1.0 and 1.1 are served")
        if head.count(b"\n") != head.count(b"\r\n"):
            raise _Reject(400, "bare LF in the request head")
        if head.count(b"\r") != head.count(b"\r\n"):
            raise _Reject(400, "bare CR in the request head")
        if b"\n " in head or b"\n\t" in head:
            raise _Reject(400, "obsolete line folding in the request head")
        target = req.target.decode("latin-1")
        path, _, query = target.partition("?")
        peer = writer.get_extra_info("peername") or ("", 0)
        env: dict[str, Any] = {
            "REQUEST_METHOD": req.method.decode("latin-1"), "SCRIPT_NAME": "", "PATH_INFO": path,
            "QUERY_STRING": query, "SERVER_NAME": self.host, "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": "HTTP/" + req.http_version.decode("latin-1"),
            "REMOTE_ADDR": str(peer[0]), "RAW_URI": target,
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if self.tls else "http",
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "wsgi.input_terminated": True,
        }  # fmt: skip
        length, chunked = 0, False
        for raw_name, value in req.headers.raw_items():  # (faster than iterating the Sequence)
            name = raw_name.lower()
            if b"_" in name:
                if name.replace(b"_", b"-") in (b"content-length", b"transfer-encoding"):
                    raise _Reject(400, f"header {name.decode('latin-1')!r} is not a framing header")
                continue  # dropped: in the environ it would stand for the dashed name
            v = value.decode("latin-1")
            if name == b"content-length":
                length = int(value)  # h11 has checked it: digits, one value
                env["CONTENT_LENGTH"] = v
            elif name == b"content-type":
                env["CONTENT_TYPE"] = v
            elif name == b"transfer-encoding":
                chunked = True  # h11 refuses any other coding than chunked
            else:
                key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
                env[key] = f"{env[key]}, {v}" if key in env else v
        if chunked:
            if "CONTENT_LENGTH" in env:
                raise _Reject(400, "both Content-Length and Transfer-Encoding")
            if not self.limits.chunked:
                raise _Reject(411, "send the body with a Content-Length")
        return env, length, chunked

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if data:
            writer.write(data)
        if writer.transport.get_write_buffer_size():  # else written whole already: no deadline to set
            async with asyncio.timeout(self.limits.write_s):
                await writer.drain()

    async def shut(self, grace_s: float) -> None:
        """Stop accepting, close the connections waiting for a request, answer the requests in
        hand for up to `grace_s`, then close everything."""
        if self.server is not None:
            self.server.close()
        deadline = time.monotonic() + grace_s
        while True:
            for c in [c for c in self.conns.values() if c.waiting]:
                _abort(c.writer)
            if all(c.waiting for c in self.conns.values()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)  # a shutdown's poll, off every request's path
        await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for c in list(self.conns.values()):
            _abort(c.writer)
        self.pool.shutdown(wait=False, cancel_futures=True)


def _abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if transport is not None:  # (none: lost during its TLS handshake)
        transport.abort()


def _next(p: h11.Connection) -> Any:
    """h11's next event; its protocol errors are the client's, as the status h11 suggests (a
    transfer coding other than chunked, its 501, is a 400 here: the request is malformed)."""
    try:
        return p.next_event()
    except h11.RemoteProtocolError as e:
        status = e.error_status_hint if e.error_status_hint in (400, 431) else 400
        if status == 431:
            raise _Reject(431, "request head too large") from None
        raise _Reject(status, str(e)[:200]) from None


def _retry(e: _Reject) -> list[tuple[str, str]]:
    return [("Retry-After", str(RETRY_AFTER_S))] if e.retry else []


def _answer(status: int | str, headers: list[tuple[str, str]], body: bytes, close: bool) -> bytes:
    """The answer's bytes: status line, headers (Content-Length, Connection set here), body."""
    line = status if isinstance(status, str) else f"{status} {HTTP_STATUS_CODES.get(status, 'UNKNOWN')}"
    out = [f"HTTP/1.1 {line}"]
    names = {k.lower() for k, _ in headers}
    out += [f"{k}: {v}" for k, v in headers if k.lower() not in ("connection", "transfer-encoding")]
    if "content-length" not in names:
        out.append(f"Content-Length: {len(body)}")
    if "content-type" not in names and not isinstance(status, str):
        out.append("Content-Type: application/json")
    out.append("Connection: close" if close else "Connection: keep-alive")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body


def _duplicate(writer: asyncio.StreamWriter) -> socket.socket | None:
    """A descriptor of the connection's socket of its own, for a request thread to send on: it
    stays open until this connection's coroutine closes it, so a thread never sends on a
    descriptor number the loop closed and a new connection reused. None where there is none."""
    raw = writer.get_extra_info("socket")
    if raw is None:
        return None
    try:
        return socket.socket(fileno=os.dup(raw.fileno()))
    except OSError:
        return None


def _closer(sock: socket.socket) -> Callable[[Future[Any]], None]:
    def close(_: Future[Any]) -> None:
        sock.close()

    return close


def _call_and_send(app: WSGIApp, environ: dict[str, Any], close: bool,
                   sock: socket.socket | None) -> tuple[bytes, int]:  # fmt: skip
    """In a request thread: the answer, and how many of its bytes were sent on `sock` (shared
    with the loop's non-blocking socket, so one send; the loop writes what is left)."""
    status, headers, body = _call(app, environ)
    data = _answer(status, headers, body, close)
    if sock is None:
        return data, 0
    try:
        return data, sock.send(data)
    except OSError:  # would block, or the connection is gone: the loop writes it or finds out
        return data, 0


def _body(message: str) -> bytes:
    return json.dumps({"Error": message}).encode()


def _keep_alive(environ: dict[str, Any]) -> bool:
    conn = str(environ.get("HTTP_CONNECTION", "")).lower()
    if environ.get("SERVER_PROTOCOL") == "HTTP/1.0":
        return "keep-alive" in conn
    return "close" not in conn


def _call(app: WSGIApp, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Run the WSGI app on a complete request; its status, headers and whole body."""
    got: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        got[:] = [status, headers]
        return lambda data: None

    try:
        result = app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
    except Exception:
        log.exception("unhandled error on %s", environ.get("PATH_INFO"))
        return "500 Internal Server Error", [], _body("internal error")
    return got[0], list(got[1]), body


class GuardedServer:
    """Listeners served by one asyncio loop in a thread of its own (`start`) or the caller's
    (`run`, until SIGTERM or SIGINT)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.listeners: list[Listener] = []
        self.thread: threading.Thread | None = None

    def add(self, app: WSGIApp, host: str, port: int, limits: Limits, tls: ssl.SSLContext | None = None,
            name: str = "guarded", probes: dict[str, Probe] | None = None) -> Listener:  # fmt: skip
        """Serve `app` on host:port; `probes` (path -> Probe) are answered by the loop itself."""
        lst = Listener(app, host, port, limits, tls, name, probes)
        self.loop.run_until_complete(lst.start())
        self.listeners.append(lst)
        return lst

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, name="guarded-loop", daemon=True)
        self.thread.start()

    def run(self, grace_s: float = 0.0) -> None:
        """Serve until SIGTERM or SIGINT; then the requests in hand get `grace_s` to be answered."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.loop.stop)
        try:
            self.loop.run_forever()
        finally:
            for lst in self.listeners:
                self.loop.run_until_complete(lst.shut(grace_s))
            self.loop.run_until_complete(_end_tasks(END_TASKS_S))
            with contextlib.suppress(Exception):
                self.loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        """From another thread, after `start`: close every listener and connection, end the loop."""

        async def close() -> None:
            for lst in self.listeners:
                await lst.close()
            await asyncio.sleep(0)  # the aborted transports' callbacks run before the loop ends
            await _end_tasks(min(timeout, END_TASKS_S))

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():
                with contextlib.suppress(Exception):
                    self.loop.close()


async def _end_tasks(timeout: float) -> None:
    """Cancel every task of the running loop but this one and wait (up to `timeout`) for them to
    end. A connection's task may be waiting on a thread still inside the app: left pending, it
    would outlive the loop and be reported at ERROR ("Task was destroyed but it is pending") by
    whatever runs when the garbage collector finds it."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for t in rest:
        t.cancel()
    if rest:
        await asyncio.wait(rest, timeout=timeout)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def raise_fd_limit() -> None:
    """Soft open-file limit up to the hard one: each connection is a descriptor, and the limits
    above must be reached before the process runs out of them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard)
            )
