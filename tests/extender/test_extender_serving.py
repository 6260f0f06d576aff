"""How the real extender process serves (extender/serving.py: gunicorn's gthread worker): a
request thread is reused for the next connection (kube-scheduler keeps only 2 idle connections to
an extender, so binds in parallel open new ones all the time, and a thread started for each was
measurable); kube-scheduler's kept-alive connection carries one verb after another; a chunked
body is answered as a sized one is."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import realk8s
from ext_helpers import container, gpu_node, pod_obj


def _worker_pid(arbiter: int) -> int:
    kids = Path(f"/proc/{arbiter}/task/{arbiter}/children").read_text().split()
    assert len(kids) == 1, kids  # one worker (the extender keeps its state in one process)
    return int(kids[0])


def _threads(pid: int) -> set[int]:
    return {int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()}


def _answer(s: socket.socket) -> tuple[bytes, bytes]:
    """The status line and body of the next answer on `s` (one with a Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v)
        for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += s.recv(4096)
    assert len(body) == length, "more bytes than the answer: the next one came unasked"
    return head.split(b"\r\n", 1)[0], body


def _get_keep_open(port: int, path: str) -> tuple[socket.socket, bytes]:
    """One request on a new connection, its answer read, the connection left open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".encode())
    status, _ = _answer(s)
    return s, status


def _post(s: socket.socket, path: str, body: bytes, chunk: int = 0) -> tuple[bytes, bytes]:
    """POST `body` on the open connection `s`, sized, or chunked in pieces of `chunk` bytes."""
    if chunk:
        pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        head = "Transfer-Encoding: chunked"
    else:
        framed, head = body, f"Content-Length: {len(body)}"
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n\r\n".encode())
    s.sendall(framed)
    return _answer(s)


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


def test_one_kept_alive_connection_carries_verb_after_verb_sized_or_chunked(cluster, sfx, start_extender):
    node = f"serve-{sfx}"
    gpu_node(cluster, node, 1)
    ext = start_extender()
    pod = pod_obj(f"p-{sfx}", [container("c", 1, 1024)])
    pod["metadata"]["uid"] = f"uid-{sfx}"
    body = json.dumps({"Pod": pod, "NodeNames": [node], "Nodes": None}).encode()
    realk8s.until(lambda: ext.post("filter", body).json().get("NodeNames") == [node], 30, "the node in view")
    with socket.create_connection(("127.0.0.1", ext.port), timeout=10) as s:
        first = _post(s, "/filter", body)
        assert first[0].endswith(b"200 OK"), first
        assert json.loads(first[1])["NodeNames"] == [node]
        for verb, chunk in (("/filter", 100), ("/prioritize", 0), ("/prioritize", 7), ("/filter", 0)):
            status, answer = _post(s, verb, body, chunk)
            assert status.endswith(b"200 OK"), (verb, chunk, status, answer)
            if verb == "/filter":
                assert answer == first[1], chunk  # a chunked body: the same answer
            else:
                assert [h["Host"] for h in json.loads(answer)] == [node], answer
        # a chunked body past the limit: 413 with its reason, on the same connection
        status, answer = _post(s, "/filter", b"[" + b"1," * (5 * 1024 * 1024) + b"1]", 1 << 20)
        assert b"413" in status and b"larger than" in answer, (status, answer)
