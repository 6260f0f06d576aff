"""How the real extender process serves its verbs (gpupack/guarded.py): open connections hold no
thread and a request thread is reused for the next request (kube-scheduler keeps only 2 idle
connections to an extender, so binds in parallel open new ones all the time, and a thread started
for each was measurable); kube-scheduler's kept-alive connection carries one verb after another;
a chunked body is answered as a sized one is."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import realk8s
from ext_helpers import container, gpu_node, pod_obj


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


def test_open_connections_hold_no_thread_and_threads_are_reused(start_extender):
    ext = start_extender()
    pid = ext.proc.pid  # one process: the verbs, their threads and the watches
    warm, status = _get_keep_open(ext.port, "/healthz")  # the first request starts a pool thread
    assert b"200" in status, status
    before = _threads(pid)
    # kube-scheduler opens a connection per bind in parallel and keeps a few alive; a connection
    # waiting for its next request (or for the rest of one) is held by the server's loop, not by a
    # thread, and requests one after another are answered by the thread already there
    held = [_get_keep_open(ext.port, "/healthz") for _ in range(40)]
    idle = [socket.create_connection(("127.0.0.1", ext.port), timeout=10) for _ in range(40)]
    try:
        assert all(b"200" in st for _, st in held)
        warm.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # and the kept-alive one still answers
        assert b"200" in _answer(warm)[0]
        # a thread per connection would show 80 new threads here; the pool may start one or two
        # when a request comes in the instant between the last answer's send and its thread
        # counting itself idle again
        new = _threads(pid) - before
        assert len(new) <= 4, f"{len(new)} new threads for 80 open connections"
    finally:
        for s, _ in [(warm, b""), *held]:
            s.close()
        for s in idle:
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
