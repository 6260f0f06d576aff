"""The one-writer fence: the extender binds only while its kube-scheduler holds the Lease."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.kubeclient import api_reason

from .kube import Kube

log = logging.getLogger("gpupack.extender")
LEASE_REUSE_S = 1.0  # see LeaseFence.problem


class BindError(Exception):
    """A bind that must fail with this message in the response's Error (the scheduler retries)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _lease_time(text: str) -> float | None:
    t = handoff.parse_rfc3339(text)
    return None if t is None else t.timestamp()


class LeaseFence:
    """Exactly one writer of assignments: the extender beside the kube-scheduler that holds the
    scheduler's leader-election Lease. kube-scheduler's holderIdentity is `<hostname>_<uuid>`, and
    a sidecar shares its pod's hostname, so `identity` (default: this hostname) matches the holder
    itself or its `<identity>_` prefix. The lease must also stay valid for `margin_s` more, longer
    than one bounded API call: a write started under the fence ends before a new leader could
    have taken over (a Lease changes hands only once it has expired, or is released)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        margin_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.margin_s = margin_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held_until = 0.0  # time.monotonic() until which the last read, if good, may be reused
        # Fresh reads are shared (see `problem`): one at a time, so the last answered is the newest;
        # reads started and the last one answered are numbered, so a check knows which answers
        # began after it asked.
        self._turn = threading.Condition(self._lock)
        self._reading = False
        self._started_n = 0
        self._answered_n = 0
        self._answer = ""

    def problem(self, fresh: bool = True) -> str:
        """Why this extender may not write now ("" when it may). With `fresh` false, a read that
        found the Lease ours at most LEASE_REUSE_S ago, and valid for `margin_s` from now on,
        answers without another: for the checks before a bind's one write (the Binding), whose
        last check, right before it, is fresh. A refusal is never reused."""
        if not fresh:
            with self._lock:
                if time.monotonic() < self._held_until:
                    return ""
        # A fresh check is answered by a read that starts after it asked, its own or one shared
        # with the checks that asked before that read began: each sees every change to the Lease
        # made before it asked, as its own read would. In a burst of binds (dozens in flight at
        # 60 pods/s) this is a read per read's duration instead of one per Binding, on an API
        # server and etcd (a quorum read) that the binds themselves wait on.
        with self._turn:
            need = self._started_n + 1  # a read running now began before this check asked
            while self._answered_n < need:
                if not self._reading:
                    self._reading = True
                    self._started_n += 1
                    mine = self._started_n
                    break
                self._turn.wait()
            else:
                return self._answer
        started = time.monotonic()
        done = False
        try:
            why, good_for = self._judge(started)
            done = True
        finally:
            with self._turn:
                self._reading = False
                if done:
                    self._answered_n, self._answer = mine, why
                    self._held_until = started + min(LEASE_REUSE_S, good_for) if not why else 0.0
                # a read that raised answers nobody: the next waiter reads for itself
                self._turn.notify_all()
        return why

    def _judge(self, started: float) -> tuple[str, float]:
        """Read the Lease: why not to write ("" when writing is fine) and, when fine, for how many
        seconds from `started` on it stays valid with `margin_s` to spare."""
        try:
            lease = self.kube.read_lease(self.namespace, self.name) or {}
        except ApiException as e:
            return f"cannot read Lease {self.namespace}/{self.name}: {api_reason(e)}", 0.0
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        if holder != self.identity and not holder.startswith(self.identity + "_"):
            return (
                f"this extender ({self.identity}) is not beside the leading kube-scheduler: Lease "
                f"{self.namespace}/{self.name} is held by {holder or 'nobody'}"
            ), 0.0
        renewed = _lease_time(str(spec.get("renewTime") or spec.get("acquireTime") or ""))
        duration = spec.get("leaseDurationSeconds")
        if renewed is None or not isinstance(duration, int):
            return f"Lease {self.namespace}/{self.name} has no renewTime/leaseDurationSeconds", 0.0
        left = renewed + duration - self.clock()
        if left < self.margin_s:
            return f"Lease {self.namespace}/{self.name} expires in {left:.1f} s; not writing under it", 0.0
        # measured from now, counted from the read's start: never longer than the Lease allows
        return "", left - self.margin_s

    def check(self, fresh: bool = True) -> None:
        why = self.problem(fresh)
        if why:
            raise BindError(why, "not-leader")
