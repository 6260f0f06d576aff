"""HTTP/1.1 framing on gpupack/guarded.py's listeners: every request RFC 9112 says to reject (or
that a proxy in front could read differently) is refused with its 4xx/5xx, the connection is
closed, no thread sees it, nothing is logged at ERROR, and a flood of them logs a bounded amount."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import gpupack.guarded as guarded
from gpupack.guarded import GuardedServer, Limits

SEEN: list[dict[str, Any]] = []


def app(environ, start_response):  # type: ignore[no-untyped-def]
    body = environ["wsgi.input"].read()
    SEEN.append({k: v for k, v in environ.items() if isinstance(v, str)} | {"body": body})
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"got " + body]


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, int]]:
    srv = GuardedServer()
    lim = Limits(header_s=2, body_s=2, idle_s=2, max_connections=64, max_header_bytes=8192, max_body=100,
                 threads=2)  # fmt: skip
    plain = srv.add(app, "127.0.0.1", 0, lim, name="t-framing")
    chunked = srv.add(app, "127.0.0.1", 0, Limits(**{**lim.__dict__, "chunked": True}), name="t-framing-c")
    srv.start()
    yield {"plain": plain.port, "chunked": chunked.port}
    srv.stop()


def _talk(port: int, data: bytes) -> bytes:
    """Send `data`, read to the end: raises (socket timeout) unless the server closes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


H = b"Host: x\r\n"
CASES = [
    # (name, listener, request, status)
    ("two different Content-Length", "plain",
     b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nContent-Length: 40\r\n\r\nhelloGET /smuggled HTTP/1.1\r\n", 400),
    ("Content_Length", "plain", b"POST / HTTP/1.1\r\n" + H + b"Content_Length: 5\r\n\r\nhello", 400),
    ("Transfer_Encoding", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Transfer_Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400),
    ("obs-fold line", "plain", b"POST / HTTP/1.1\r\n" + H + b"X-A: a\r\n Content-Length: 5\r\n\r\nhello", 400),
    ("obs-fold with a tab", "plain", b"GET / HTTP/1.1\r\n" + H + b"X-A: a\r\n\tb\r\n\r\n", 400),
    ("space before the colon", "plain", b"POST / HTTP/1.1\r\n" + H + b"Content-Length : 5\r\n\r\nhello", 400),
    ("bare LF inside a header value", "plain",
     b"POST / HTTP/1.1\r\n" + H + b"X-A: a\nContent-Length: 5\r\n\r\nhello", 400),
    ("bare LF line ends", "plain", b"GET / HTTP/1.1\nHost: x\n\n", 400),
    ("NUL in a value", "plain", b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n", 400),
    ("CR in a value", "plain", b"GET / HTTP/1.1\r\n" + H + b"X-A: a\rb\r\n\r\n", 400),
    ("HTTP/1.1 without Host", "plain", b"GET / HTTP/1.1\r\nX-A: a\r\n\r\n", 400),
    ("two Host headers", "plain", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("non-ASCII digit length", "plain", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\nab".encode("latin-1"), 400),
    ("5,000-digit length", "plain", b"POST / HTTP/1.1\r\n" + H + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 400),
    ("negative length", "plain", b"POST / HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n", 400),
    ("Content-Length and Transfer-Encoding", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("Content-Length and Transfer-Encoding, no chunked", "plain",
     b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("a coding other than chunked", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 400),
    ("chunked where not served", "plain", b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    ("malformed chunk size", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n", 400),
    ("chunk longer than its size", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n0\r\n\r\n", 400),
    ("head over max_header_bytes in one piece", "plain", b"GET / HTTP/1.1\r\n" + H + b"X: " + b"a" * 9000 + b"\r\n\r\n", 431),
    ("head over max_header_bytes, never ending", "plain", b"GET / HTTP/1.1\r\n" + H + b"X: " + b"a" * 70000, 431),
    ("body over max_body", "plain", b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 101\r\n\r\n", 413),
    ("chunked body over max_body", "chunked",
     b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + b"40\r\n" + b"a" * 64 + b"\r\n" * 1
     + b"40\r\n" + b"a" * 64 + b"\r\n0\r\n\r\n", 413),
    ("HTTP/2.0 in a request line", "plain", b"GET / HTTP/2.0\r\n" + H + b"\r\n", 505),
    ("no request line", "plain", b"nonsense\r\n\r\n", 400),
    ("a space in the target", "plain", b"GET /a b HTTP/1.1\r\n" + H + b"\r\n", 400),
    ("empty header name", "plain", b"GET / HTTP/1.1\r\n" + H + b": v\r\n\r\n", 400),
]  # fmt: skip


@pytest.mark.parametrize(("name", "which", "request_bytes", "status"), CASES, ids=[c[0] for c in CASES])
def test_each_framing_case_is_refused_and_closed(
    ports: dict[str, int], caplog: pytest.LogCaptureFixture, name: str, which: str, request_bytes: bytes,
    status: int,
) -> None:  # fmt: skip
    SEEN.clear()
    caplog.set_level(logging.WARNING)
    answer = _talk(ports[which], request_bytes)  # returns only once the server closed
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"Connection: close" in answer
    assert answer.count(b"HTTP/1.1 ") == 1  # one answer: nothing after it was read as a request
    assert SEEN == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_body_is_never_read_as_the_next_request(ports: dict[str, int]) -> None:
    SEEN.clear()
    inner = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    after = b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    head = b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(inner)
    answer = _talk(ports["plain"], head + inner + after)
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert [e["PATH_INFO"] for e in SEEN] == ["/first", "/after"]
    assert SEEN[0]["body"] == inner


def test_pipelined_requests_are_answered_in_order(ports: dict[str, int]) -> None:
    SEEN.clear()
    reqs = b"".join(
        b"POST /%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (i, len(str(i)), str(i).encode())
        for i in range(50)
    )
    answer = _talk(ports["plain"], reqs + b"GET /end HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    bodies = [part.split(b"\r\n\r\n", 1)[1][:8] for part in answer.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies[:50] == [b"got " + str(i).encode() for i in range(50)]


def test_underscore_names_do_not_stand_for_dashed_ones(ports: dict[str, int]) -> None:
    SEEN.clear()
    answer = _talk(ports["plain"], b"GET / HTTP/1.1\r\nHost: x\r\nX_Tenant: evil\r\nX-Tenant: good\r\n"
                   b"Connection: close\r\n\r\n")  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 200")
    assert SEEN[0]["HTTP_X_TENANT"] == "good"
    assert "CONTENT_LENGTH" not in SEEN[0]


def test_a_flood_of_malformed_requests_logs_a_bounded_amount(
    ports: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpupack.guarded")
    bad = [row[2] for row in CASES if row[1] == "plain" and row[3] == 400]
    threads = [
        threading.Thread(target=lambda: [_talk(ports["plain"], b) for b in bad * 10]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    n = 4 * 10 * len(bad)
    assert n >= 400
    ours = [r for r in caplog.records if r.name == "gpupack.guarded"]
    assert len(ours) <= 2, [r.getMessage() for r in ours]  # one line per listener per 10 s
    assert not [r for r in ours if r.exc_info or r.levelno >= logging.ERROR]


def test_a_surprise_in_the_parser_is_a_400_not_a_dropped_connection(
    ports: dict[str, int], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(p: Any) -> Any:
        raise ValueError("a parser bug")

    monkeypatch.setattr(guarded, "_next", boom)
    caplog.set_level(logging.WARNING)
    for _ in range(20):
        assert _talk(ports["plain"], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if r.name == "gpupack.guarded"]) <= 1


def test_a_client_that_expects_100_continue_is_told_to_send(ports: dict[str, int]) -> None:
    SEEN.clear()
    s = socket.create_connection(("127.0.0.1", ports["plain"]), timeout=5)
    try:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"hi")
        assert s.recv(4096).endswith(b"got hi")
    finally:
        s.close()
    # refused before the body: no 100 Continue, only the refusal
    answer = _talk(
        ports["plain"], b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 413")
