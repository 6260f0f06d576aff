"""The connection-per-thread server (`--serving connection`, the default) reuses a connection's
thread for the next connection: kube-scheduler keeps only 2 idle connections to an extender, so
binds in parallel open new ones all the time, and a thread started for each was measurable."""

from __future__ import annotations

import socket
import time
from pathlib import Path


def _worker_pid(arbiter: int) -> int:
    kids = Path(f"/proc/{arbiter}/task/{arbiter}/children").read_text().split()
    assert len(kids) == 1, kids  # one worker (the extender keeps its state in one process)
    return int(kids[0])


def _threads(pid: int) -> set[int]:
    return {int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()}


def _get_keep_open(port: int, path: str) -> tuple[socket.socket, bytes]:
    """One request on a new connection, its answer read, the connection left open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v)
        for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += s.recv(4096)
    return s, head.split(b"\r\n", 1)[0]


def test_connections_one_after_another_are_served_by_the_same_thread(start_extender):
    ext = start_extender()
    worker = _worker_pid(ext.proc.pid)
    before = _threads(worker)
    serving: set[int] = set()
    for _ in range(12):
        s, status = _get_keep_open(ext.port, "/healthz")
        assert b"200" in status, status
        serving |= _threads(worker) - before  # the thread holding this open connection
        s.close()
        time.sleep(0.05)  # room for its thread to see the close and wait for the next connection
    # a thread per connection would have shown 12 new threads here (each alive while its connection
    # is); reused, a few at most (a connection that comes before the last one's thread is idle again
    # gets a thread of its own, which is reused from then on)
    assert len(serving) <= 4, serving


def test_connections_at_once_each_get_a_thread_and_all_are_answered(start_extender):
    ext = start_extender()
    socks = [_get_keep_open(ext.port, "/healthz") for _ in range(6)]
    try:
        assert all(b"200" in status for _, status in socks)
    finally:
        for s, _ in socks:
            s.close()
    # and they are reused afterwards: six more at once start no new thread (once the server has seen
    # the six close, which it does at once: the sleep is a generous margin, not a guess)
    time.sleep(1.0)
    worker = _worker_pid(ext.proc.pid)
    before = _threads(worker)
    again = [_get_keep_open(ext.port, "/healthz") for _ in range(6)]
    try:
        assert all(b"200" in status for _, status in again)
        assert not _threads(worker) - before
    finally:
        for s, _ in again:
            s.close()
