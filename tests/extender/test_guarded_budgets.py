"""What a network client can hold on a gpupack listener (gpupack/guarded.py): bytes of bodies in
flight and queued requests are bounded per listener (503 with Retry-After past them), a TLS
connection counts toward max_connections from accept, probes are answered without waiting behind
the work, and the admission webhook's process (its real app and limits, TLS) stays within a memory
bound that 100 hostile connections cannot push past."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import REPO
from realk8s import until

from extender.serve.app import WEBHOOK_MAX_BODY
from gpupack import certs
from gpupack.guarded import GuardedServer, Limits, Listener, tls_context

MIB = 1 << 20
RSS_LIMIT_MIB = 300


def _head(path: str, length: int, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        path.encode(), length, extra,
    )  # fmt: skip


def _answer(s: socket.socket, timeout: float) -> bytes:
    """What the server sends until it pauses for `timeout` or closes."""
    s.settimeout(timeout)
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                n = next((int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                          if k.lower() == b"content-length"), 0)  # fmt: skip
                if len(body) >= n:
                    break
    return out


# --- one listener in this process ------------------------------------------------------------


@pytest.fixture
def blocking() -> Iterator[tuple[threading.Event, list[str]]]:
    release, seen = threading.Event(), []
    yield release, seen
    release.set()


def _blocking_app(release: threading.Event, seen: list[str]) -> Any:
    def app(environ, start_response):  # type: ignore[no-untyped-def]
        seen.append(environ["PATH_INFO"])
        body = environ["wsgi.input"].read()
        release.wait(20)
        start_response("200 OK", [])
        return [b"done %d" % len(body)]

    return app


def _serve(app: Any, lim: Limits, **kw: Any) -> tuple[GuardedServer, Listener]:
    srv = GuardedServer()
    lst = srv.add(app, "127.0.0.1", 0, lim, name="t-budget", **kw)
    srv.start()
    return srv, lst


def test_bodies_past_the_byte_budget_get_503_without_being_read(blocking) -> None:
    release, seen = blocking
    lim = Limits(body_s=20, max_body=100, max_body_bytes_in_flight=250, threads=1)
    srv, lst = _serve(_blocking_app(release, seen), lim)
    try:
        stalled = []
        for _ in range(2):  # two bodies of 100 declared, 10 sent: 200 of the 250 held
            s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
            s.sendall(_head("/stall", 100) + b"x" * 10)
            stalled.append(s)
        until(lambda: lst.body_bytes == 200, 5, "both declared bodies counted")
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        s.sendall(_head("/third", 100))  # its body is not sent: the 503 must not wait for it
        answer = _answer(s, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
        assert lst.peak_body_bytes <= 250 and seen == []
        # the stalled bodies are closed to make room once they have stalled a second
        time.sleep(1.1)  # EVICT_BODY_AFTER_S: the oldest body must be that old to be closed
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        s.sendall(_head("/fourth", 100) + b"y" * 100)
        until(lambda: seen == ["/fourth"], 5, "the new request given to the thread")
        assert stalled[0].recv(10) == b""  # the oldest stalled body was closed for it
        release.set()
        assert _answer(s, 5).endswith(b"done 100")
    finally:
        srv.stop()


def test_a_chunked_body_counts_as_it_arrives(blocking) -> None:
    release, seen = blocking
    lim = Limits(body_s=20, max_body=100, max_body_bytes_in_flight=150, threads=1, chunked=True)
    srv, lst = _serve(_blocking_app(release, seen), lim)
    try:
        hold = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        hold.sendall(_head("/hold", 100))
        until(lambda: lst.body_bytes == 100, 5, "the declared body counted")
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        s.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n14\r\n" + b"z" * 20 + b"\r\n"
        )
        until(lambda: lst.body_bytes == 120, 5, "the first chunk counted")
        s.sendall(b"3c\r\n" + b"z" * 60 + b"\r\n")  # 80 in all: past the 150 with the 100 held
        assert _answer(s, 5).startswith(b"HTTP/1.1 503")
        assert lst.peak_body_bytes <= 150 and seen == []
        hold.close()
        until(lambda: lst.body_bytes == 0, 5, "every byte given back")
    finally:
        srv.stop()


def test_requests_past_the_queue_get_503(blocking) -> None:
    release, seen = blocking
    srv, lst = _serve(_blocking_app(release, seen), Limits(threads=1, max_queued=2))
    try:
        socks = []
        for i in range(3):  # one answered (blocked), two waiting for the thread
            s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
            s.sendall(_head(f"/{i}", 2) + b"{}")
            socks.append(s)
            until(lambda i=i: lst.in_pool == i + 1, 5, "the request given to the pool")
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        s.sendall(_head("/3", 2) + b"{}")
        answer = _answer(s, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After" in answer
        release.set()
        for s in socks:
            assert _answer(s, 5).endswith(b"done 2")
        assert sorted(seen) == ["/0", "/1", "/2"]
    finally:
        srv.stop()


def test_probes_are_answered_while_every_thread_is_busy(blocking) -> None:
    release, seen = blocking
    ready = {"ok": False}
    probes = {"/readyz": lambda: (200, "ok\n") if ready["ok"] else (503, "not yet\n")}
    srv, lst = _serve(_blocking_app(release, seen), Limits(threads=1), probes=probes)
    try:
        for i in range(5):
            s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
            s.sendall(_head(f"/{i}", 2) + b"{}")
        until(lambda: lst.in_pool == 5, 5, "the work queued")
        for want in (b"503", b"200"):
            t0 = time.monotonic()
            p = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
            p.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(p, 5).startswith(b"HTTP/1.1 " + want)
            assert time.monotonic() - t0 < 1.0
            ready["ok"] = True
        assert seen == ["/0"]  # the probes never reached the app
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("tls")
    ca_cert, ca_key = certs.new_ca(1)
    cert, key = certs.issue(ca_cert, ca_key, ["127.0.0.1"], 1)
    (tmp / "tls.crt").write_bytes(cert)
    (tmp / "tls.key").write_bytes(key)
    return tmp / "tls.crt", tmp / "tls.key"


def test_tls_connections_in_their_handshake_count_toward_the_limit(tls_files: tuple[Path, Path]) -> None:
    def app(environ, start_response):  # type: ignore[no-untyped-def]
        start_response("200 OK", [])
        return [b"hi"]

    srv, lst = _serve(app, Limits(max_connections=4, handshake_s=30), tls=tls_context(*map(str, tls_files)))
    try:
        held = []
        for _ in range(4):  # TCP only: each stays in its handshake
            held.append(socket.create_connection(("127.0.0.1", lst.port), timeout=5))
            until(lambda: len(lst.conns) == len(held), 5, "the handshaking connection counted")
        fifth = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        assert held[0].recv(10) == b""  # the oldest handshake closed to make room
        assert len(lst.conns) == 4 and lst.evicted == 1
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with ctx.wrap_socket(fifth) as t:
            t.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _answer(t, 5).endswith(b"hi")
        for s in held:
            s.close()
    finally:
        srv.stop()


# --- the webhook's own process ---------------------------------------------------------------


@pytest.fixture
def webhook(tls_files: tuple[Path, Path]) -> Iterator[tuple[int, int]]:
    """(pid, port) of the webhook's app behind its real listener, TLS, in a process of its own."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "webhook_listener.py"), *map(str, tls_files)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(10)


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def _tls(port: int) -> ssl.SSLSocket:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30))


def _review(pad: int) -> bytes:
    pod = {"metadata": {"name": "p", "namespace": "t", "uid": "u", "annotations": {"pad": "x" * pad}},
           "spec": {"containers": [{"name": "a", "image": "x:1", "resources": {"limits": {"gpupack.io/gpu-mem": "1024"}}}]}}  # fmt: skip
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:t:app"}, "namespace": "t",
        "object": pod}}).encode()  # fmt: skip


def _crowd(port: int, n: int, send: Any, stop: threading.Event) -> list[bytes]:
    """`n` TLS connections, each running `send(sock)` and then reading what comes within 3 s; the
    connections stay open (stalled) until `stop`. Returns each one's answer (b"": none yet)."""
    answers: list[bytes] = [b""] * n
    done = threading.Barrier(n + 1, timeout=120)

    def one(i: int) -> None:
        try:
            s = _tls(port)
        except OSError:
            done.wait()
            return
        with contextlib.suppress(OSError):
            send(s)
        answers[i] = _answer(s, 3)
        done.wait()
        stop.wait(60)
        s.close()

    for i in range(n):
        threading.Thread(target=one, args=(i,), daemon=True).start()
    done.wait()
    return answers


def test_100_stalled_bodies_declared_past_max_body_are_refused_at_once(webhook: tuple[int, int]) -> None:
    pid, port = webhook
    base = _status_mib(pid, "VmRSS")
    stop = threading.Event()
    try:
        answers = _crowd(port, 100, lambda s: s.sendall(_head("/mutate", 8 * MIB - 1) + b"x" * MIB), stop)
        peak = _status_mib(pid, "VmHWM")
    finally:
        stop.set()
    print(f"webhook RSS {base:.0f} MiB at start, peak {peak:.0f} MiB with 100 bodies of 8 MiB - 1 declared")
    assert sum(a.startswith(b"HTTP/1.1 413") for a in answers) == 100
    assert peak <= RSS_LIMIT_MIB


def test_100_stalled_bodies_within_max_body_hold_at_most_the_budget(webhook: tuple[int, int]) -> None:
    pid, port = webhook
    base = _status_mib(pid, "VmRSS")
    stop = threading.Event()
    try:
        answers = _crowd(
            port, 100, lambda s: s.sendall(_head("/mutate", WEBHOOK_MAX_BODY - 1) + b"x" * MIB), stop
        )
        rss, peak = _status_mib(pid, "VmRSS"), _status_mib(pid, "VmHWM")
        # a real review still gets in: bodies stalled over a second are closed to make room
        time.sleep(1.1)  # EVICT_BODY_AFTER_S
        s = _tls(port)
        body = _review(100)
        s.sendall(_head("/mutate", len(body)) + body)
        ok = _answer(s, 10)
    finally:
        stop.set()
    refused = sum(a.startswith(b"HTTP/1.1 503") for a in answers)
    stalled = sum(a == b"" for a in answers)
    print(f"webhook RSS {base:.0f} MiB at start, {rss:.0f} MiB with 100 stalled bodies of {WEBHOOK_MAX_BODY - 1} "
          f"declared ({stalled} being read, {refused} refused 503), peak {peak:.0f} MiB")  # fmt: skip
    # unanswered: being read, or closed to make room for a later one (stalled over a second)
    assert stalled + refused == 100 and refused > 0
    assert peak <= RSS_LIMIT_MIB
    assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_readyz_answers_within_a_second_behind_60_big_reviews(webhook: tuple[int, int]) -> None:
    pid, port = webhook
    body = _review(1_100_000)
    statuses: list[bytes] = []
    # probed from a process of its own, as the kubelet does: this one's threads send the reviews
    prober = subprocess.Popen([sys.executable, str(REPO / "tests" / "webhook_listener.py"), "probe", str(port), "6"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def review() -> None:
        with _tls(port) as s:
            for _ in range(3):
                s.sendall(_head("/mutate", len(body)) + body)
                a = _answer(s, 60)
                statuses.append(a[9:12])
                if not a.startswith(b"HTTP/1.1 200"):
                    return

    reviewers = [threading.Thread(target=review, daemon=True) for _ in range(60)]
    for t in reviewers:
        t.start()
    for t in reviewers:
        t.join(180)
    out, _ = prober.communicate(timeout=120)
    took = json.loads(out)
    print(f"/readyz worst {max(took) * 1000:.0f} ms, median {sorted(took)[len(took) // 2] * 1000:.0f} ms over "
          f"{len(took)} probes behind 60 reviews of {len(body) / 1e6:.1f} MB ({statuses.count(b'200')} answered "
          f"200, {statuses.count(b'503')} 503)")  # fmt: skip
    assert prober.returncode == 0 and len(took) >= 5
    assert statuses.count(b"200") >= 60 and set(statuses) <= {b"200", b"503"}
    assert max(took) <= 1.0
    assert os.path.exists(f"/proc/{pid}")
