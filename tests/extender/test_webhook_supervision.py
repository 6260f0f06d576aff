"""The admission webhook's child process is supervised (extender/serve/webhook_child.py): killed, it is
started again and answers; one that cannot stay up makes the parent's /healthz (the container's
liveness probe) fail, so admission never stays down silently."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import requests
from processes import free_port
from realk8s import until

from extender.serve.app import create_webhook_app, probes_of
from extender.serve.webhook import WebhookConfig
from extender.serve.webhook_child import WebhookChild
from extender.state.metrics import Metrics
from extender.state.view import ClusterView
from gpupack import certs


def _tls(tmp: Path) -> tuple[Path, Path, Path]:
    ca_cert, ca_key = certs.new_ca(1)
    cert, key = certs.issue(ca_cert, ca_key, ["127.0.0.1"], 1)
    for name, data in (("ca.crt", ca_cert), ("tls.crt", cert), ("tls.key", key)):
        (tmp / name).write_bytes(data)
    return tmp / "ca.crt", tmp / "tls.crt", tmp / "tls.key"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_a_killed_webhook_child_is_started_again_and_answers(start_extender, tmp_path: Path) -> None:
    ca, cert, key = _tls(tmp_path)
    port = free_port()
    ext = start_extender("--webhook-port", str(port), "--webhook-host", "127.0.0.1", "--tls-cert", str(cert),
                         "--tls-key", str(key), "--log-level", "info")  # fmt: skip
    url = f"https://127.0.0.1:{port}/readyz"

    def webhook_ready() -> bool:
        try:
            return requests.get(url, verify=str(ca), timeout=2).status_code == 200
        except requests.RequestException:
            return False

    until(webhook_ready, 60, "the webhook child to answer")
    (first,) = _children(ext.proc.pid)
    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    until(lambda: not webhook_ready(), 10, "the killed webhook to stop answering")
    until(lambda: _children(ext.proc.pid) and _children(ext.proc.pid) != [first], 30, "a new webhook child")
    until(webhook_ready, 60, "the restarted webhook child to answer")
    assert time.monotonic() - t0 < 60
    assert "the webhook process" in ext.tail() and "exited with status -9" in ext.tail()
    assert ext.proc.poll() is None  # the verbs' process never went down
    assert ext.http.get(ext.url + "/healthz", timeout=5).status_code == 200


def test_a_webhook_that_cannot_stay_up_fails_the_liveness_check() -> None:
    child = WebhookChild([sys.executable, "-c", "raise SystemExit(3)"], first_backoff_s=0.05, max_backoff_s=0.2,
                         down_limit_s=1.0)  # fmt: skip
    child.start()
    try:
        until(lambda: child.restarts >= 3, 10, "the crashing child started again, with backoff")
        assert child.problem() == ""  # down for less than down_limit_s: a restart may bring it back
        until(child.problem, 10, "the liveness check to fail")
        assert "has not stayed up" in child.problem()
    finally:
        child.stop()
    n = child.restarts
    time.sleep(0.5)  # stopped: no further start (a negative check needs a wait)
    assert child.restarts == n


def test_a_child_up_again_clears_the_problem() -> None:
    marker = Path(f"/tmp/gpupack-wh-{os.getpid()}")
    marker.unlink(missing_ok=True)
    # the first child exits at once; the next ones stay up
    code = f"import os,time,pathlib; p=pathlib.Path({str(marker)!r}); (p.exists() or (p.touch(), os._exit(1))); time.sleep(60)"
    child = WebhookChild([sys.executable, "-c", code], first_backoff_s=0.05, down_limit_s=0.0)
    child.up_s = 0.5
    child.start()
    try:
        until(lambda: child.restarts == 1, 10, "the first child's exit")
        until(lambda: child.problem() == "", 10, "the problem cleared once a child stays up")
        assert child.down_since is None
    finally:
        child.stop()
        marker.unlink(missing_ok=True)


def test_the_liveness_probe_carries_the_webhooks_problem() -> None:
    view = ClusterView()
    app = create_webhook_app(WebhookConfig(namespace="gpupack-system"), view, Metrics())
    why = [""]
    probes = probes_of(app, lambda: why[0])
    assert probes["/healthz"]() == (200, "ok\n")
    why[0] = "the admission webhook has not stayed up"
    assert probes["/healthz"]() == (503, "the admission webhook has not stayed up\n")
    assert probes["/readyz"]()[0] == 503
    view.synced.set()
    assert probes["/readyz"]() == (200, "ok\n")
