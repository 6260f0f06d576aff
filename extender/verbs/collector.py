"""What stands aside while kube-scheduler waits for a verb: the garbage collector's full
collections (run in a pause between verbs, not inside one), and bind and watch threads (they
wait at their next step until the verb is answered; VerbActivity.wait_quiet).

kube-scheduler's cycle is serial and waits for every filter. CPython runs a full collection from
whatever allocation happens to cross its threshold, and a full collection walks every tracked
object: the cluster view and its answer caches, hundreds of thousands of them in a large cluster,
so one inside a filter can take longer than the filter's whole budget (figures: operator guide,
"Scheduling throughput"). The young generations stay automatic (cheap); full
collections run from a thread of their own once filter and prioritize have been quiet for
`idle_s`, or after `max_gap_s` without one whatever the traffic, so cyclic garbage is still freed
within that. Objects freed by their last reference (most of the view's) never wait for it.

What survives a full collection is frozen (gc.freeze), so the next one walks only what was
allocated since: at 5,000 nodes and 100,000 pods with 40 pod shapes' answers kept, a full
collection walked ~730,000 objects (0.5-0.9 s holding the GIL, each time ten young collections
had run), and one after a freeze walks the few allocated since (0.075 s after 40 more shapes'
filters; both timed in one process, a diagnostic: bench_scale.py's `gc_full` is the benchmark). Cyclic garbage among frozen objects would then never be freed: every `sweep_s` a full
collection unfreezes everything first (the whole heap, 2.2 million objects, 1.5 s there) and
freezes the survivors again.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("gpupack.extender")

IDLE_S = 1.0  # filter and prioritize quiet this long: a full collection will not stall one
MAX_GAP_S = 300.0  # at most this long between full collections, however busy the scheduler is
SWEEP_S = 3600.0  # a full collection walks the frozen objects too at most this long after the last did
POLL_S = 0.25
# the longest a bind or watch thread stands aside for one verb: a filter at 5,000 nodes takes up to
# ~35 ms when it is a new pod shape's first. A bind may wait once between its Lease read and its
# Binding (for the fit under the view's lock): far inside the fence's margin (API timeout + 1 s).
YIELD_MAX_S = 0.05
# count[2] (young collections since the last full one) past this: CPython's own default
# threshold for a full collection, so one is due about as often as CPython would have run it
DUE_YOUNG_COLLECTIONS = 10
NEVER = 2**31 - 1  # a full-collection threshold the count never reaches
# the verbs kube-scheduler's serial cycle waits for: they mark VerbActivity (bind does not)
LATENCY_VERBS = frozenset({"filter", "prioritize"})


class VerbActivity:
    """Whether a latency-critical verb (filter, prioritize) is being answered, and since when
    none has been. enter()/leave() around each; cheap (one lock, no allocation).

    Threads whose work can wait (binds, watch events) call wait_quiet() between their steps, at
    points where they hold no lock a verb needs. On the extender's CPU they otherwise take turns at
    the GIL with the thread answering kube-scheduler: in a 500-pod burst at 1,000 nodes the filters
    spent 38-44 ms in all off their CPU inside the verb (wall time less the thread's CPU time; bind
    threads ran 0.3-2 ms each inside single filters), 11-15 ms once these threads stood aside (two
    alternating runs each, bench_scheduler.py --extender-cpus 1)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0
        self._verbs: set[int] = set()  # threads answering one now: they never wait for themselves
        self._quiet_since = clock()
        self.waited = 0  # wait_quiet calls that found a verb running (tests, benchmarks)

    def enter(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._busy += 1
            self._verbs.add(me)

    def leave(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._busy -= 1
            self._verbs.discard(me)
            if self._busy == 0:
                self._quiet_since = self._clock()
                self._cond.notify_all()

    def quiet_for(self) -> float:
        """Seconds since the last verb ended; 0.0 while one is in progress."""
        with self._cond:
            if self._busy:
                return 0.0
            return max(0.0, self._clock() - self._quiet_since)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """A verb that waits for a bind (filter, for a view that is whole) is not answering for
        that while: the binds it waits for must not stand aside for it. Nothing on a thread that
        is not answering a verb."""
        with self._cond:
            mine = threading.get_ident() in self._verbs
        if not mine:
            yield
            return
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def wait_quiet(self, max_s: float = YIELD_MAX_S) -> None:
        """Return once no verb is being answered, or after `max_s` whatever happens (a verb that
        hangs never holds the others up for longer). At once on a thread answering a verb itself
        (filter cleans a stale assignment through the bind's code). Never call it with a lock held
        that a verb takes (the view's)."""
        if not self._busy:  # a plain read: at worst one needless or one missed wait
            return
        with self._cond:
            if self._busy and threading.get_ident() not in self._verbs:
                self.waited += 1
                self._cond.wait_for(lambda: self._busy == 0, timeout=max_s)


class IdleCollector:
    """Runs the full collections CPython would run, at a moment no verb waits for them.

    `collect`, `young_count`, `freeze` and `unfreeze` are gc's own in the product; tests pass
    their own."""

    def __init__(
        self,
        activity: VerbActivity,
        idle_s: float = IDLE_S,
        max_gap_s: float = MAX_GAP_S,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], object] = gc.collect,
        young_count: Callable[[], int] = lambda: gc.get_count()[2],
        on_collect: Callable[[float, bool], None] | None = None,
        sweep_s: float = SWEEP_S,
        freeze: Callable[[], None] = gc.freeze,
        unfreeze: Callable[[], None] = gc.unfreeze,
    ) -> None:
        self.activity = activity
        self.idle_s, self.max_gap_s, self.sweep_s = idle_s, max_gap_s, sweep_s
        self._clock, self._collect, self._young = clock, collect, young_count
        self._freeze, self._unfreeze = freeze, unfreeze
        self._on_collect = on_collect
        self._last = self._last_sweep = clock()
        self.swept = 0  # full collections that walked the frozen objects too
        self.stop = threading.Event()

    def install(self) -> None:
        """Take full collections away from allocation (this process) and start the thread."""
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, NEVER)
        threading.Thread(target=self._run, name="gc-idle", daemon=True).start()

    def step(self) -> bool:
        """One check: collect if due and quiet (or overdue). Whether it collected."""
        now = self._clock()
        young = self._young()
        overdue = young > 0 and now - self._last >= self.max_gap_s
        if not overdue and (young < DUE_YOUNG_COLLECTIONS or self.activity.quiet_for() < self.idle_s):
            return False
        sweep = now - self._last_sweep >= self.sweep_s
        t0 = time.perf_counter()
        if sweep:
            self._unfreeze()
        self._collect()
        self._freeze()  # what survived is long-lived: the next collection walks only what comes after
        took = time.perf_counter() - t0
        self._last = self._clock()
        if sweep:
            self._last_sweep = self._last
            self.swept += 1
        if self._on_collect is not None:
            self._on_collect(took, overdue)
        if overdue and took > 0.01:
            log.info("full garbage collection while verbs were busy (none for %.0f s): %.0f ms",
                     self.max_gap_s, took * 1000)  # fmt: skip
        return True

    def _run(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.step()
            except Exception:  # never let the thread die: collections would stop for good
                log.exception("idle garbage collection failed")
