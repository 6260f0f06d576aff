"""Pod shapes' answers computed before kube-scheduler asks for them, off its serial cycle.

Two kinds of filter cost every node of the cluster (~300 ms and ~110 ms of CPU at 5,000 nodes
with 100,000 running pods, where nearly every node is in a state of its own), and kube-scheduler
waits for each:
- the first filter of a pod shape: every node fitted and scored;
- a shape's first filter after the policy learnt (a new epoch): every node scored again.

`ShapeWarmer` does that work in a thread of its own, a chunk of nodes at a time: each chunk under
the view's lock, and only while no verb is being answered (VerbActivity.wait_quiet), so a filter
waits at most for one chunk. It fills the same per-node-version caches the filter reads
(placement_index.PlacementIndex's fits, scoring.Scorer.scores), then builds the shape's answers
from them, so a node that changed meanwhile is simply fitted again by the next filter, as any
changed node is; and a filter that comes first finds whatever chunks are done already.

What it is asked to warm:
- the shapes of pods waiting for kube-scheduler (`pending_watcher`: a watch of the profile's
  unbound pods), newest first: kube-scheduler takes its queue oldest first, so it would reach the
  oldest while they are being warmed. A learning policy learns each such pod as it is seen;
- after a learning flush, the shapes asked about in the last RESCORE_RECENT_S (`Scorer.order_key`
  serves their order from before meanwhile, for at most scoring.STALE_ORDER_MAX_S): a shape
  kube-scheduler asks about first, then the others, most recently asked first.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from typing import Any

from gpupack.core.model import PodRequest

from ..api.kube import Kube, NamespaceUnreadable
from ..api.wire import PodRequestError
from ..state.metrics import Metrics
from ..state.placement_index import CACHE_SHAPES, FitMemo, Key, shape_of
from ..state.preempt_inputs import Unschedulable, unschedulable
from ..state.sync import Watcher
from ..state.view import ClusterView
from .collector import VerbActivity
from .filtering import Filter
from .pod_requests import pod_request
from .scoring import Scorer

log = logging.getLogger("gpupack.extender.warming")

# Nodes fitted or scored per hold of the view's lock: ~60 us a node to fit and ~25 us to score at
# 5,000 nodes, so a filter or a watch event waits at most ~10 ms for the warmer.
CHUNK_NODES = 128
# A pause after each chunk: a thread waiting for the view's lock (a bind, a watch event, a verb
# not marked yet) takes it then, rather than the warmer taking it straight back.
CHUNK_GAP_S = 0.001
# The key and uid the warmer fits and scores under. Not a real pod's: a pod counts as the holder of
# its own share (the policy's trial placements charge by key), so fitting as a pod already placed
# would see its node without that share. A namespace is a DNS label: no pod key has a dot before
# the slash.
STAND_IN_KEY = "gpupack.io/shape-warmer"

# After the policy learnt, the shapes asked about this recently are scored again at once; the others
# only once asked again (scoring every kept shape after every flush spent CPU on shapes whose
# pods had all been placed).
RESCORE_RECENT_S = 60.0
# Rounds of scoring a shape's nodes when the policy learns while they are being scored (the last
# round's leftovers are scored under the lock).
SCORE_ATTEMPTS = 3
# Shapes waiting to be warmed, at most: more pending shapes than the caches keep (CACHE_SHAPES)
# would only push each other out.
QUEUE_MAX = CACHE_SHAPES
# Pending pods whose shape was handed on, remembered by uid (their later events are skipped).
TOLD_MAX = 10_000


class ShapeWarmer:
    """Warms pod shapes' filter answers and keep_best orders (see the module's doc)."""

    def __init__(
        self,
        view: ClusterView,
        filtering: Filter,
        scorer: Scorer,
        activity: VerbActivity,
        metrics: Metrics,
        clock: Callable[[], datetime],
        chunk: int = CHUNK_NODES,
    ) -> None:
        self.view, self.filtering, self.scorer = view, filtering, scorer
        self.activity, self.metrics, self.clock = activity, metrics, clock
        self.chunk = chunk
        self._cond = threading.Condition(threading.Lock())
        # shape -> (a pod of that shape, why): asked now (a stale order serving) before the others
        self._urgent: OrderedDict[Key, tuple[PodRequest, str]] = OrderedDict()
        self._queue: OrderedDict[Key, tuple[PodRequest, str]] = OrderedDict()  # after a flush
        # new shapes of pending pods, taken newest first: kube-scheduler takes its queue oldest
        # first, so the oldest are the ones it would reach while they are being warmed
        self._pending: OrderedDict[Key, tuple[PodRequest, str]] = OrderedDict()
        # the shapes whose order was built, with a pod of each, most recently asked last
        self._seen: OrderedDict[Key, tuple[PodRequest, float]] = OrderedDict()  # (pod, when asked)
        self.monotonic = time.monotonic
        self.warmed = 0  # shapes warmed (tests, benchmarks)
        # uids of the pending pods whose shape was handed on (pending_watcher): their later events
        # are not parsed again. A pod leaves when the watch no longer shows it (bound or deleted),
        # and a relist keeps only the pods listed; TOLD_MAX bounds it whatever happens.
        self.told: OrderedDict[str, None] = OrderedDict()
        # told (view lock not held) of each pending pod's uid once it is bound or gone
        self.on_gone: Callable[[str], None] = lambda uid: None

    @staticmethod
    def stand_in(pod: PodRequest) -> PodRequest:
        """`pod`'s shape as no pod: what the warmer fits and scores (see STAND_IN_KEY)."""
        return dataclasses.replace(pod, key=STAND_IN_KEY, uid="")

    # --- what to warm ------------------------------------------------------------------------------
    def want(self, pod: PodRequest) -> None:
        """A pod waits for kube-scheduler: a learning policy learns it now (its filter will not
        again: a pod is learnt once), and its shape is warmed unless its answers are current."""
        shape = shape_of(pod)
        with self.view.lock:
            # Learnt when it starts waiting rather than at its first filter: an extender that starts
            # (or takes over as leader) with pods queued knows their mix, and warms their shapes,
            # before kube-scheduler reaches them, instead of learning in flushes during the burst
            # and answering each new shape from a sample on the serial cycle.
            self.scorer.learner.observe(pod)
            if self._current(shape):
                return
        self._put(shape, self.stand_in(pod), "pending", urgent=False)

    def rescore(self, pod: PodRequest) -> None:
        """kube-scheduler asks about `pod` while its shape's order is from before the policy learnt
        (Scorer.order_key): that shape next."""
        self._put(shape_of(pod), self.stand_in(pod), "learnt", urgent=True)

    def sampled(self, pod: PodRequest) -> None:
        """kube-scheduler asked about `pod`, a shape with no answer yet, and was answered from a
        sample of the nodes (sampling.py): that shape next, so its next filters find it whole."""
        self._put(shape_of(pod), self.stand_in(pod), "pending", urgent=True)

    def flushed(self) -> None:
        """The policy learnt (a new epoch): every shape asked about in the last RESCORE_RECENT_S is
        scored again, the most recently asked first. One asked longer ago is scored again when it
        is next asked (Scorer.order_key). View lock held (Learner.on_flush)."""
        now = self.monotonic()
        for shape, (pod, at) in reversed(self._seen.items()):
            if now - at > RESCORE_RECENT_S:
                break  # the rest were asked even longer ago
            self._put(shape, pod, "learnt", urgent=False)

    def _put(self, shape: Key, pod: PodRequest, why: str, urgent: bool) -> None:
        with self._cond:
            if shape in self._urgent:
                return
            if urgent:
                self._queue.pop(shape, None)
                self._pending.pop(shape, None)
                self._urgent[shape] = (pod, why)
            elif why == "pending":
                if shape in self._queue or shape in self._pending:
                    return
                if len(self._pending) >= QUEUE_MAX:
                    self._pending.popitem(last=False)  # the oldest: kube-scheduler reaches it first
                self._pending[shape] = (pod, why)
            elif shape not in self._queue:
                if len(self._queue) >= QUEUE_MAX:
                    return
                self._pending.pop(shape, None)
                self._queue[shape] = (pod, why)
            self._cond.notify()

    def _current(self, shape: Key) -> bool:
        """Whether `shape` has a filter answer and an order for the current epoch (view lock held)."""
        if not self.filtering.placements.knows(shape):
            return False
        if self.filtering.keep_best <= 0:
            return True
        return self.scorer.served.get(shape) == self.scorer.learner.epoch

    def _pause(self) -> None:
        time.sleep(CHUNK_GAP_S)
        self.activity.wait_quiet()

    def ready(self) -> bool:
        """Whether there is anything to warm for: not while a learning policy has learnt nothing.
        A fit's GPUs are chosen by what the policy knows, and fits are kept across its flushes (per
        node version): a warmer fitting for a policy that knows nothing would keep an untaught
        choice. The first pending pod seen (`want`) or asked about is learnt at once."""
        learner = self.scorer.learner
        return not (learner.policy.learn and learner.epoch == 0)

    def _next(self, timeout: float | None) -> tuple[PodRequest, str] | None:
        if not self.ready():
            if timeout:
                time.sleep(timeout)
            return None
        with self._cond:
            if not self._urgent and not self._pending and not self._queue:
                self._cond.wait(timeout)
            if self._urgent:
                return self._urgent.popitem(last=False)[1]
            if self._pending:  # a new shape costs a filter every node; an old order serves meanwhile
                return self._pending.popitem(last=True)[1]
            if self._queue:
                return self._queue.popitem(last=False)[1]
        return None

    # --- the work ----------------------------------------------------------------------------------
    def warm(self, pod: PodRequest, why: str = "pending") -> bool:
        """Fit and score every node of the view for `pod`'s shape, a chunk at a time, then build its
        filter answer and (keep_best) its order for the current epoch. False when they were
        current already."""
        pod = self.stand_in(pod)
        shape = shape_of(pod)
        with self.view.lock:
            if self._current(shape):
                return False
            names = list(self.view.nodes)
        t0 = time.perf_counter()
        now = self.clock()
        placements = self.filtering.placements
        # nodes in the same state fit alike: one memo for every chunk (state numbers never repeat)
        memo: FitMemo = {}
        for i in range(0, len(names), self.chunk):
            self._pause()
            with self.view.lock:
                if self._current(shape):
                    return False  # a filter got there first
                table = placements.fit_table(shape)
                nodes = self.view.nodes
                for n in names[i : i + self.chunk]:
                    info = nodes.get(n)
                    if info is not None and not info.reservations and table.fresh(n, info.version) is None:
                        placements.node_fit(n, pod, now, table, memo)
        learner = self.scorer.learner
        for attempt in range(SCORE_ATTEMPTS):
            # prioritize's scores (keep_best 0) come from the same tables as keep_best's order
            epoch = learner.epoch
            # scores of a state hold within the epoch: the memos serve every chunk of this round
            memos: tuple[dict[Key, float], FitMemo, dict[int, float | None]] = ({}, {}, {})
            for i in range(0, len(names), self.chunk):
                self._pause()
                with self.view.lock:
                    if self._current(shape):
                        return False
                    if learner.epoch != epoch:
                        break
                    self.scorer.raw_scores(pod, names[i : i + self.chunk], now, memos)
            self._pause()
            with self.view.lock:
                if learner.epoch != epoch and attempt + 1 < SCORE_ATTEMPTS:
                    continue  # the policy learnt meanwhile: score again in chunks, not under the lock
                # from the caches just filled: a node changed since is fitted or scored again here
                names = list(self.view.nodes)
                self.filtering.placements.filter_answer(pod, names, now)
                if self.filtering.keep_best > 0:
                    self.scorer.best(pod, names, (), now, self.filtering.keep_best, fresh=True)
                    self._note(shape, pod)
                break
        self.metrics.warmed.labels(why).observe(time.perf_counter() - t0)
        self.warmed += 1
        return True

    def asked(self, pod: PodRequest) -> None:
        """kube-scheduler asked about `pod` (filter): its shape is among those scored again after
        the policy learns. View lock held."""
        self._note(shape_of(pod), self.stand_in(pod))

    def _note(self, shape: Key, pod: PodRequest) -> None:
        self._seen[shape] = (pod, self.monotonic())
        self._seen.move_to_end(shape)
        while len(self._seen) > CACHE_SHAPES:
            self._seen.popitem(last=False)

    def tracked_sizes(self) -> dict[str, int]:
        """Entries per queue and map (shapes, and the pending pods' uids)."""
        with self._cond:
            queued = {"warmer.urgent": len(self._urgent), "warmer.queue": len(self._queue),
                      "warmer.pending": len(self._pending)}  # fmt: skip
        return {**queued, "warmer.seen": len(self._seen), "warmer.told": len(self.told)}

    def drain(self) -> int:
        """Warm everything queued, in this thread (tests); how many shapes were warmed."""
        n = 0
        while (item := self._next(0)) is not None:
            n += self.warm(*item)
        return n

    def attach(self) -> None:
        """Be told of the shapes asked about and of the policy's flushes, and let a shape's old order
        serve until this warmer has scored it again (Scorer.order_key). Only with something to warm
        what is queued: the thread (`start`) or a test's `drain`."""
        self.scorer.rescore = self.rescore
        self.filtering.on_sampled = self.sampled
        self.scorer.learner.on_flush = self.flushed
        self.filtering.on_asked = self.asked

    # --- the thread --------------------------------------------------------------------------------
    def start(self, stop: threading.Event) -> None:
        """Warm from a daemon thread until `stop`; from now on a shape's old order serves while its
        nodes are scored again after the policy learnt (Scorer.rescore)."""
        self.attach()
        threading.Thread(target=self._run, args=(stop,), name="shape-warmer", daemon=True).start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.view.synced.wait(0.5):
                continue
            item = self._next(0.5)
            if item is None:
                continue
            try:
                self.warm(*item)
            except Exception:  # a warmer that died would leave stale orders serving: never
                log.exception("warming a pod shape failed; the filter computes it when asked")


def pending_watcher(
    kube: Kube,
    scheduler_name: str,
    warmer: ShapeWarmer,
    stop: threading.Event,
    pause: Callable[[], None] | None = None,
    marks: Unschedulable | None = None,
) -> Watcher:
    """A watch of the pods waiting for `scheduler_name` (not bound to a node): each one's shape is
    handed to `warmer`, and which are marked Unschedulable to `marks` (the preemption pass's). A
    pod gpupack cannot parse is left to the filter, which says why."""

    told = warmer.told

    def seen(obj: dict[str, Any]) -> None:
        if marks is not None:
            marks.apply(obj)
        if (obj.get("spec") or {}).get("nodeName"):
            return
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid in told:
            return
        try:
            req = pod_request(obj, kube)
        except (PodRequestError, NamespaceUnreadable):
            return
        warmer.want(req)
        if uid:
            told[uid] = None
            if len(told) > TOLD_MAX:
                told.popitem(last=False)

    def listed(pages: Any) -> None:
        marked: list[dict[str, Any]] = []
        listed_uids: set[str] = set()
        for items in pages:
            for obj in items:
                seen(obj)
                listed_uids.add(str((obj.get("metadata") or {}).get("uid") or ""))
                if marks is not None and unschedulable(obj):
                    marked.append(obj)
        if marks is not None:
            marks.replace(marked)
        # pods bound or deleted while the watch was away: no event will say so
        for uid in [u for u in told if u not in listed_uids]:
            del told[uid]

    def gone(obj: dict[str, Any]) -> None:
        if marks is not None:
            marks.delete(obj)
        # bound (it leaves the unbound selection) or deleted: nothing is kept of it any more
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid:
            told.pop(uid, None)
            warmer.on_gone(uid)

    return Watcher(
        "pending-pods",
        lambda: kube.pending_pod_pages(scheduler_name),
        lambda rv, timeout_s: kube.watch_pending_pods(scheduler_name, rv, timeout_s),
        listed,
        seen,
        gone,
        stop,
        pause=pause,
    )
