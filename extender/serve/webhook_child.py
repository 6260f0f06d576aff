"""The admission webhook's child process, supervised: `gpupack extender` (role "all") serves the
webhook from a child of its own (TLS on a port of its own, a node watch of its own). A child that
exits while the parent is not stopping is started again, after a backoff that doubles from
`first_backoff_s` up to `max_backoff_s` (back to the first once a child has run `steady_s`), each
exit logged with its status. With `failurePolicy: Fail`, a webhook that stays down refuses every
GPU pod: while no child has been running for `down_limit_s`, `problem()` says so, and the
parent's /healthz (the container's liveness probe) fails with it, so the kubelet restarts the
container rather than leave admission down silently."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Sequence

log = logging.getLogger("gpupack.extender.webhook")


class WebhookChild:
    def __init__(self, cmd: Sequence[str], first_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 steady_s: float = 60.0, down_limit_s: float = 60.0) -> None:  # fmt: skip
        self.cmd = list(cmd)
        self.first_backoff_s, self.max_backoff_s = first_backoff_s, max_backoff_s
        self.steady_s, self.down_limit_s = steady_s, down_limit_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        # since when no child has run for `up_s` on end (None: one has, or none has exited yet)
        self.down_since: float | None = None
        self.started_at = 0.0
        self.up_s = 10.0
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._supervise, name="webhook-child", daemon=True)

    def start(self) -> None:
        self._spawn()
        self.thread.start()

    def _spawn(self) -> None:
        with self.lock:
            if self.stopping.is_set():
                return
            self.proc = subprocess.Popen(self.cmd)
            self.started_at = time.monotonic()

    def _supervise(self) -> None:
        backoff = self.first_backoff_s
        while not self.stopping.is_set():
            proc = self.proc
            started = time.monotonic()
            code = proc.wait() if proc is not None else "none: it could not be started"
            if self.stopping.is_set():
                return
            now = time.monotonic()
            if self.down_since is None:  # a child that crashes at once keeps the first time
                self.down_since = now
            if now - started >= self.steady_s:
                backoff = self.first_backoff_s
            self.restarts += 1
            log.error("the webhook process (pid %s) exited with status %s; starting it again in %.1f s "
                      "(restart %d)", proc and proc.pid, code, backoff, self.restarts)  # fmt: skip
            if self.stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.max_backoff_s)
            try:
                self._spawn()
            except OSError as e:  # tried again after the next backoff
                log.error("the webhook process could not be started: %s", e)
                self.proc = None

    def problem(self) -> str:
        """Why this process is not healthy on the webhook's account; "" while it is."""
        since, proc, now = self.down_since, self.proc, time.monotonic()
        if since is None:
            return ""
        if proc is not None and proc.poll() is None and now - self.started_at >= self.up_s:
            self.down_since = None  # up again, and staying up
            return ""
        if now - since < self.down_limit_s:
            return ""
        return f"the admission webhook has not stayed up since {now - since:.0f} s ago ({self.restarts} restarts)"

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.lock:
            self.stopping.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
