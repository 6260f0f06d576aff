"""When a learning policy is shown the pods it has seen: the extender's learning batches, which the
simulator's pipeline model runs too.

A learning policy's scores change with every pod it is shown (`Policy.observe`); batching keeps
them stable between flushes (an epoch), so the scores of nodes that did not change can be reused.
Each flush costs: the first filter (or prioritize) of every pod shape after it scores all its nodes
again (~0.15 ms a node, so ~150 ms at 1,000 nodes, on kube-scheduler's serial cycle).

The rule (:class:`LearningBatcher`): the first pod is learnt at once (with nothing learnt the policy
has no workload to score against); while fewer than OBSERVE_WARMUP pods are learnt, a batch is due
once OBSERVE_GROWTH times the pods learnt so far are waiting (1, 3, 12, 48) and OBSERVE_MIN_GAP_S
has passed since the last flush, so a burst of pods at ~30 pods/s costs 3 flushes instead of one per
doubling (7); later a workload's mix changes slowly, so a flush per OBSERVE_BATCH_MAX waiting pods
(and OBSERVE_MIN_GAP_S) keeps up. Whatever the counts, a pod arriving more than OBSERVE_FLUSH_S
after the last flush flushes. A pod is offered by an identity (its uid or key): the extender sees it
waiting and is asked about it, often several times, and it is learnt once.

Pure: the clock is the caller's (the extender's monotonic clock; the simulator's simulated one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

OBSERVE_WARMUP = 64
OBSERVE_GROWTH = 3
OBSERVE_MIN_GAP_S = 1.0
OBSERVE_BATCH_MAX = 4096
OBSERVE_FLUSH_S = 60.0
# Identities of the pods offered last, so a pod asked about again is not learnt twice.
SEEN_MAX = 10_000

T = TypeVar("T")


def batch_due(learnt: int, waiting: int, since_flush_s: float) -> bool:
    """Whether the `waiting` pods (the newest among them just offered) are learnt now, with `learnt`
    pods learnt before and `since_flush_s` seconds since the last flush."""
    if learnt == 0:
        return True
    batch = learnt * OBSERVE_GROWTH if learnt < OBSERVE_WARMUP else OBSERVE_BATCH_MAX
    return (waiting >= batch and since_flush_s >= OBSERVE_MIN_GAP_S) or since_flush_s > OBSERVE_FLUSH_S


class LearningBatcher(Generic[T]):
    """Holds the pods offered (`offer`) and hands them to `learn` in batches (`batch_due`).

    `clock`: seconds, monotonic; read at construction (the first "flush") and at each offer. Not
    thread-safe: the extender offers under its view's lock.
    """

    def __init__(self, learn: Callable[[T], None], clock: Callable[[], float]) -> None:
        self.learn = learn
        self.clock = clock
        self.waiting: list[T] = []
        self.learnt = 0  # pods handed to `learn`
        self.flushes = 0  # the extender's epoch: bumped whenever the policy was shown new pods
        self.last_flush = clock()
        self._seen: OrderedDict[str, None] = OrderedDict()

    def forget(self, ident: str) -> None:
        """The pod `ident` will not be offered again (bound, or gone): its identity need not be
        kept for SEEN_MAX more offers."""
        self._seen.pop(ident, None)

    @property
    def seen_count(self) -> int:
        """Identities remembered (at most SEEN_MAX)."""
        return len(self._seen)

    def offer(self, ident: str, item: T) -> bool:
        """Offer one pod by its identity; True when this offer flushed (the policy has changed).
        A pod offered before (among the last SEEN_MAX) is ignored."""
        if ident in self._seen:
            return False
        self._seen[ident] = None
        if len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        self.waiting.append(item)
        now = self.clock()
        if not batch_due(self.learnt, len(self.waiting), now - self.last_flush):
            return False
        for p in self.waiting:
            self.learn(p)
        self.learnt += len(self.waiting)
        self.waiting.clear()
        self.last_flush = now
        self.flushes += 1
        return True
