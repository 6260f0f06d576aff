"""Work off the verb path: the janitor (stale assignments and handoffs) and the requeuer (pods
kube-scheduler parked while there was no room, touched when room appears)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from gpupack import handoff

from ..verbs.framework import Extender

log = logging.getLogger("gpupack.extender")


class Janitor:
    """Runs :meth:`Extender.requeue_waiting` once the view has synced, then :meth:`Extender.sweep`
    every `interval_s`, in a daemon thread."""

    def __init__(
        self, ext: Extender, interval_s: float = 5.0, listening: threading.Event | None = None
    ) -> None:
        self.ext, self.interval_s = ext, interval_s
        # the restart pass waits for the verbs' listener too: a pod touched while kube-scheduler's
        # filter is still refused (its retry from backoff fails after the touch) is parked again,
        # and a v1.28 scheduler then leaves it for its 5-minute flush
        self.listening = listening
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> Janitor:
        self.thread = threading.Thread(target=self.run, name="janitor", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread and wait for it (a pass under way ends first); True once it has ended."""
        return _close(self.stop, self.thread, timeout_s)

    def run(self) -> None:
        while not self.ext.view.synced.wait(0.5):
            if self.stop.is_set():
                return
        while self.listening is not None and not self.listening.wait(0.5):
            if self.stop.is_set():
                return
        try:
            self.ext.metrics.requeued.labels("restart").inc(self.ext.requeue_waiting()[0])
        except Exception:
            log.exception("requeue of waiting pods failed")
        while not self.stop.wait(self.interval_s):
            try:
                self.ext.sweep()
            except Exception:
                log.exception("janitor pass failed")


class Requeuer:
    """Asks kube-scheduler to retry its parked gpupack pods when the cluster gains room for them.

    kube-scheduler v1.28 (SchedulerQueueingHints off) moves parked pods back to its active queue on
    a Node add/update only when a pre-check passes, and that pre-check (noderesources.Fits) counts
    gpupack.io/gpu-mem and gpu-sm as missing on every node although the profile's NodeResourcesFit
    ignores them (it reads no plugin arguments): a GPU pod left waiting is not retried when a node joins, is uncordoned,
    loses a taint or publishes more GPUs, only on an unrelated pod event or the scheduler's 5-minute
    flush. The view reports such changes (ClusterView.on_room); this thread turns a burst of them
    into one pass of :meth:`Extender.requeue_waiting` over the pods the scheduler marked
    Unschedulable: after `settle_s` (the scheduler's informer sees the change too), at most one pass
    per `min_interval_s`, each one list and at most `max_pods` PATCHes. Off the verb path: a poke
    only sets a flag."""

    def __init__(
        self, ext: Extender, min_interval_s: float = 1.5, settle_s: float = 0.3, max_pods: int = 200
    ) -> None:
        self.ext = ext
        self.min_interval_s, self.settle_s, self.max_pods = min_interval_s, settle_s, max_pods
        self.wake = threading.Event()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._why: Counter[str] = Counter()
        self.passes = 0
        self.thread: threading.Thread | None = None

    def poke(self, node: str, why: str) -> None:
        # Room seen before the first sync (every node of the first list) is the Janitor's: it
        # requeues all waiting pods once synced. Dropped here, not cleared when the thread sees the
        # sync, so a poke that comes right after the sync is never lost with them.
        if not self.ext.view.synced.is_set():
            return
        with self._lock:
            self._why[why] += 1
        self.wake.set()

    def start(self) -> Requeuer:
        self.ext.view.on_room = self.poke
        self.thread = threading.Thread(target=self.run, name="requeuer", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread and wait for it (a pass under way ends first); True once it has ended."""
        return _close(self.stop, self.thread, timeout_s)

    def run(self) -> None:
        while not self.ext.view.synced.wait(0.5):
            if self.stop.is_set():
                return
        round_start = ""  # a pass capped at max_pods goes on with the pods it did not reach
        while not self.stop.is_set():
            if not self.wake.wait(0.5):
                continue
            if self.stop.wait(self.settle_s):
                return
            self.wake.clear()
            with self._lock:
                why, self._why = self._why, Counter()
            if not round_start or why:
                round_start = handoff.rfc3339(self.ext.clock())
            try:
                n, left = self.ext.requeue_waiting(
                    parked_only=True, limit=self.max_pods, touched_since=round_start
                )
            except Exception:
                log.exception("requeue of waiting pods failed")
                n, left = 0, 0
            self.passes += 1
            self.ext.metrics.requeued.labels("room").inc(n)
            if n or why:
                log.info("cluster gained room (%s): %d parked pod(s) asked to retry, %d left for the next pass",
                         ", ".join(f"{k} x{v}" for k, v in sorted(why.items())) or "continued", n, left)  # fmt: skip
            if left:
                self.wake.set()
            else:
                round_start = ""
            self.stop.wait(self.min_interval_s)


def _close(stop: threading.Event, thread: threading.Thread | None, timeout_s: float) -> bool:
    stop.set()
    if thread is not None:
        thread.join(timeout_s)
    return thread is None or not thread.is_alive()
