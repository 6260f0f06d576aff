"""gpupack/guarded.py on its own: a thread gets a request only once it is whole, each stage has
its deadline, and a listener at its connection limit closes the connection that waited longest."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from realk8s import until

from gpupack.guarded import GuardedServer, Limits, Listener

CALLS: list[str] = []


def app(environ, start_response):  # type: ignore[no-untyped-def]
    CALLS.append(threading.current_thread().name)
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"got " + body]


@pytest.fixture
def listener() -> Iterator[Listener]:
    srv = GuardedServer()
    lim = Limits(header_s=0.5, body_s=0.5, idle_s=0.5, max_connections=4, max_body=100, threads=1)
    lst = srv.add(app, "127.0.0.1", 0, lim, name="t")
    srv.start()
    CALLS.clear()
    yield lst
    srv.stop()


@pytest.fixture
def port(listener: Listener) -> int:
    return listener.port


def _talk(port: int, data: bytes) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    s.close()
    return out


def test_requests_are_answered_and_kept_alive(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    for _ in range(2):
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        answer = s.recv(4096)
        assert (
            answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"got hi") and b"keep-alive" in answer
        )
    s.close()


def test_what_is_refused_before_any_thread_sees_it(port: int) -> None:
    assert _talk(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n").startswith(
        b"HTTP/1.1 413"
    )
    assert _talk(port, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n").startswith(
        b"HTTP/1.1 411"
    )
    assert _talk(port, b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n").startswith(
        b"HTTP/1.1 431"
    )
    assert _talk(port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert CALLS == []


def test_slow_heads_and_bodies_are_closed_at_their_deadline(port: int) -> None:
    t0 = time.monotonic()
    assert _talk(port, b"POST / HTTP/1.1\r\nHost: x\r\n") == b""  # the head never ends
    assert _talk(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab") == b""  # nor the body
    assert time.monotonic() - t0 < 3 and CALLS == []


def test_at_its_limit_a_listener_closes_the_connection_that_waited_longest(
    listener: Listener, port: int
) -> None:
    idle = []
    for _ in range(4):  # accepted one after another, so the first is the oldest
        idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        until(lambda: len(listener.conns) == len(idle), 5, "the connection accepted")
    answer = _talk(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    assert idle[0].recv(10) == b""  # the oldest was closed to make room
    for s in idle:
        s.close()


@pytest.fixture
def chunked_port() -> Iterator[int]:
    srv = GuardedServer()
    lim = Limits(
        header_s=0.5, body_s=2.0, idle_s=0.5, max_connections=4, max_body=100, threads=1, chunked=True
    )
    lst = srv.add(app, "127.0.0.1", 0, lim, name="t-chunked")
    srv.start()
    CALLS.clear()
    yield lst.port
    srv.stop()


def _chunked(body: bytes, size: int) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_a_chunked_body_is_decoded_before_a_thread_sees_it(chunked_port: int) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    assert _talk(chunked_port, head + _chunked(b"0123456789" * 10, 7)).endswith(b"got " + b"0123456789" * 10)
    assert len(CALLS) == 1


def test_a_chunked_body_past_the_limit_or_malformed_is_refused_and_its_answer_arrives(
    chunked_port: int,
) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    # the whole body is sent before the answer is read: the 413 must survive the close
    over = _talk(chunked_port, head + _chunked(b"x" * 300_000, 1000))
    assert over.startswith(b"HTTP/1.1 413") and b"larger than 100 bytes" in over
    assert _talk(chunked_port, head + b"zz\r\nab\r\n0\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert _talk(chunked_port, head + b"2\r\nabcd\r\n0\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert _talk(chunked_port, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n").startswith(
        b"HTTP/1.1 400"
    )
    assert CALLS == []


def test_a_stopping_listener_answers_the_request_in_hand_and_closes_the_waiting_ones() -> None:
    srv = GuardedServer()
    started, release = threading.Event(), threading.Event()

    def slow(environ, start_response):  # type: ignore[no-untyped-def]
        started.set()
        release.wait(5)
        start_response("200 OK", [])
        return [b"done"]

    lst = srv.add(slow, "127.0.0.1", 0, Limits(threads=2), name="t-stop")
    srv.start()
    idle = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
    busy = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
    busy.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert started.wait(5)
    shut = asyncio.run_coroutine_threadsafe(lst.shut(5.0), srv.loop)
    assert idle.recv(10) == b""  # closed at once: it held no request
    release.set()
    assert busy.recv(4096).endswith(b"done")  # answered within the grace
    shut.result(5)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", lst.port), timeout=1)
    srv.stop()
    idle.close()
    busy.close()


def test_an_answer_larger_than_the_socket_takes_arrives_whole_and_holds_no_thread() -> None:
    big = bytes(range(256)) * 40_000  # ~10 MB: far more than one send puts in the socket

    def large(environ, start_response):  # type: ignore[no-untyped-def]
        start_response("200 OK", [])
        return [big if environ["PATH_INFO"] == "/big" else b"small"]

    srv = GuardedServer()
    lst = srv.add(large, "127.0.0.1", 0, Limits(threads=1), name="t-big")
    srv.start()
    try:
        slow = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        slow.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # and not read yet
        # the one thread is free again while the loop writes the rest of that answer
        assert _talk(lst.port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"small")
        got = b""
        while not got.endswith(big):
            chunk = slow.recv(1 << 20)
            assert chunk, "closed before the whole answer"
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        assert body == big and f"Content-Length: {len(big)}".encode() in head
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection carries the next request in order
        assert slow.recv(4096).endswith(b"small")
        slow.close()
    finally:
        srv.stop()


def test_stopping_with_a_request_in_a_thread_leaves_no_task_pending(caplog: pytest.LogCaptureFixture) -> None:
    """stop() while the app still holds a request: the connection's task is ended with the loop,
    not left pending for the garbage collector to report (at ERROR, in whatever runs later)."""
    import gc
    import logging

    release = threading.Event()
    entered = threading.Event()

    def slow(environ, start_response):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        start_response("200 OK", [])
        return [b""]

    srv = GuardedServer()
    lst = srv.add(slow, "127.0.0.1", 0, Limits(threads=1), name="t-stop")
    srv.start()
    s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
    try:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(5)
        caplog.set_level(logging.ERROR, logger="asyncio")
        srv.stop()
        assert srv.loop.is_closed()
        del srv, lst
        gc.collect()
        assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    finally:
        release.set()
        s.close()
