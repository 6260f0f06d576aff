"""A WSGI server that a few connections cannot stall: every listener of gpupack is served here
(the extender's verbs on loopback, its admission webhook and metrics port, and the device plugin's
metrics/health port, both open to the network), each with a budget of its own. Shared code: the
components must not import each other, so it lives in gpupack/ (extender/guarded.py adds the
extender's budgets).

A thread is given a request only once the whole request is in hand: the TLS handshake, the head
and the body are read by one asyncio loop, each within its own deadline (`Limits`), so a client
that connects and sends nothing, or trickles a byte a second, holds a few kilobytes of memory and
no thread. Each listener keeps at most `max_connections` connections; a new one past that closes
the connection that has waited longest for its next request (idle and slow ones go first; one
whose request is being answered is never closed). On plain TCP the request thread sends the
answer with one non-blocking send (what the socket takes at once: the whole of a verb's answer,
without waiting for the loop to wake); what is left, and every TLS answer, the loop writes within
`write_s`, so a client that stops reading holds no thread either.

HTTP/1.1 with Content-Length bodies (kube-scheduler's verbs, the API server's webhook calls and
Prometheus' scrapes send those) or, where a listener allows it (`chunked`), chunked ones, decoded
here within the same deadline and size limit. Kept-alive connections wait `idle_s` for the next
request. On SIGTERM (`run`) a listener stops accepting and closes its waiting connections at once,
and answers the requests in hand for up to `grace_s`.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from werkzeug.http import HTTP_STATUS_CODES

log = logging.getLogger("gpupack.guarded")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class Limits:
    handshake_s: float = 5.0  # TLS handshake, from accept
    header_s: float = 5.0  # the request head, from its first byte (or from accept)
    body_s: float = 10.0  # the body, from the end of the head
    idle_s: float = 30.0  # a kept-alive connection waiting for its next request
    write_s: float = 10.0  # the answer, written
    max_connections: int = 4096  # open at once on this listener
    max_header_bytes: int = 16384
    max_body: int = 8 * 1024 * 1024
    threads: int = 8  # requests answered at once (complete requests wait for a thread, not clients)
    chunked: bool = False  # accept chunked request bodies (else 411)


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Conn:
    __slots__ = ("writer", "waiting", "since")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting = True  # for (or reading) a request; False while one is answered
        self.since = time.monotonic()


class Listener:
    """One listening socket served on `loop`: its connections, limits and thread pool."""

    def __init__(self, app: WSGIApp, host: str, port: int, limits: Limits, tls: ssl.SSLContext | None,
                 name: str) -> None:  # fmt: skip
        self.app, self.host, self.port, self.limits, self.tls, self.name = app, host, port, limits, tls, name
        self.pool = ThreadPoolExecutor(limits.threads, thread_name_prefix=f"{name}-req")
        self.conns: dict[int, _Conn] = {}
        self.server: asyncio.Server | None = None
        self.evicted = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._serve, self.host, self.port, ssl=self.tls, limit=self.limits.max_header_bytes,
            ssl_handshake_timeout=self.limits.handshake_s if self.tls else None, backlog=2048,
        )  # fmt: skip
        if self.port == 0:
            self.port = self.server.sockets[0].getsockname()[1]

    def _make_room(self) -> None:
        waiting = [(c.since, k) for k, c in self.conns.items() if c.waiting]
        while len(self.conns) >= self.limits.max_connections and waiting:
            waiting.sort()
            _, k = waiting.pop(0)
            c = self.conns.pop(k)
            self.evicted += 1
            c.writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.conns) >= self.limits.max_connections:
            self._make_room()
        conn = _Conn(writer)
        self.conns[id(conn)] = conn
        direct: socket.socket | None = None
        try:
            first = True
            while True:
                conn.waiting, conn.since = True, time.monotonic()
                try:
                    environ = await self._read_request(reader, writer, first)
                except _Reject as e:
                    await self._write(writer, e.status, [], _body(str(e)), close=True)
                    return
                if environ is None:
                    return
                first = False
                conn.waiting = False
                keep = _keep_alive(environ)
                if direct is None and self.tls is None:
                    direct = _duplicate(writer)
                # the thread sends the answer itself when nothing of an earlier one is still
                # buffered here: the caller has it without waiting for this loop to wake
                sock = direct if not writer.transport.get_write_buffer_size() else None
                data, sent = await asyncio.get_running_loop().run_in_executor(
                    self.pool, _call_and_send, self.app, environ, not keep, sock
                )
                await self._send(writer, data[sent:] if sent else data)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError, OSError):
            return
        finally:
            self.conns.pop(id(conn), None)
            writer.close()
            if direct is not None:
                direct.close()  # no thread holds it: the request it was lent for has been answered

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool
    ) -> dict[str, Any] | None:
        lim = self.limits
        lead = b""
        if not first:
            # a kept-alive connection may wait idle_s for its next request, whose head then has header_s
            try:
                async with asyncio.timeout(lim.idle_s):
                    lead = await reader.readexactly(1)
            except (TimeoutError, asyncio.IncompleteReadError):
                return None
        try:
            async with asyncio.timeout(lim.header_s):
                head = lead + await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial and not lead:
                return None  # closed between requests
            raise
        except (asyncio.LimitOverrunError, ValueError):  # past the StreamReader's limit
            raise _Reject(431, f"request head larger than {lim.max_header_bytes} bytes") from None
        environ = self._environ(head, writer)
        coding = environ.pop("HTTP_TRANSFER_ENCODING", None)
        if coding is not None:
            if not lim.chunked:
                raise _Reject(411, "send the body with a Content-Length")
            if coding.strip().lower() != "chunked" or "CONTENT_LENGTH" in environ:
                raise _Reject(400, f"unsupported Transfer-Encoding {coding[:40]!r}")
            async with asyncio.timeout(lim.body_s):
                body = await _read_chunked(reader, lim.max_body)
            environ["CONTENT_LENGTH"] = str(len(body))
        else:
            raw = environ.get("CONTENT_LENGTH") or "0"
            if not raw.isdigit():
                raise _Reject(400, "Content-Length is not a number")
            length = int(raw)
            if length > lim.max_body:
                raise _Reject(413, f"request body larger than {lim.max_body} bytes")
            body = b""
            if length:
                async with asyncio.timeout(lim.body_s):
                    body = await reader.readexactly(length)
        environ["wsgi.input"] = io.BytesIO(body)
        return environ

    def _environ(self, head: bytes, writer: asyncio.StreamWriter) -> dict[str, Any]:
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Reject(400, "malformed request line")
        method, target, version = parts
        path, _, query = target.partition("?")
        peer = writer.get_extra_info("peername") or ("", 0)
        env: dict[str, Any] = {
            "REQUEST_METHOD": method, "SCRIPT_NAME": "", "PATH_INFO": path, "QUERY_STRING": query,
            "SERVER_NAME": self.host, "SERVER_PORT": str(self.port), "SERVER_PROTOCOL": version,
            "REMOTE_ADDR": str(peer[0]), "RAW_URI": target,
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if self.tls else "http",
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "wsgi.input_terminated": True,
        }  # fmt: skip
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if not sep:
                raise _Reject(400, "malformed header line")
            key = k.strip().upper().replace("-", "_")
            if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                env[key] = v.strip()
            else:
                env["HTTP_" + key] = v.strip()
        return env

    async def _write(self, writer: asyncio.StreamWriter, status: int | str, headers: list[tuple[str, str]],
                     body: bytes, close: bool) -> None:  # fmt: skip
        await self._send(writer, _answer(status, headers, body, close))

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
                c.writer.transport.abort()
            if all(c.waiting for c in self.conns.values()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)  # a shutdown's poll, off every request's path
        await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for c in list(self.conns.values()):
            c.writer.transport.abort()
        self.pool.shutdown(wait=False, cancel_futures=True)


async def _read_chunked(reader: asyncio.StreamReader, max_body: int) -> bytes:
    """A chunked body, decoded. Past `max_body` the rest is read and dropped before the 413, so the
    answer reaches a client still sending (a socket closed with unread data is reset, and the
    reset can destroy the answer before the client reads it); the caller's deadline bounds that."""
    parts: list[bytes] = []
    size, over = 0, False
    try:
        while True:
            line = await reader.readuntil(b"\r\n")
            digits = line.split(b";", 1)[0].strip()
            if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
                raise _Reject(400, "malformed chunk size")
            n = int(digits, 16)
            if n == 0:
                break
            size += n
            over = over or size > max_body
            if not over:
                parts.append(await reader.readexactly(n))
            else:
                parts.clear()
                while n:
                    n -= len(await reader.readexactly(min(n, 65536)))
            if await reader.readexactly(2) != b"\r\n":
                raise _Reject(400, "malformed chunk")
        while await reader.readuntil(b"\r\n") != b"\r\n":
            pass  # trailers: nothing here reads them
    except (asyncio.LimitOverrunError, ValueError):
        raise _Reject(400, "chunk size or trailer line too long") from None
    if over:
        raise _Reject(413, f"request body larger than {max_body} bytes")
    return b"".join(parts)


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
            name: str = "guarded") -> Listener:  # fmt: skip
        lst = Listener(app, host, port, limits, tls, name)
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
            with contextlib.suppress(Exception):
                self.loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        """From another thread, after `start`: close every listener and connection, end the loop."""

        async def close() -> None:
            for lst in self.listeners:
                await lst.close()
            await asyncio.sleep(0)  # the aborted transports' callbacks run before the loop ends

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout)


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
