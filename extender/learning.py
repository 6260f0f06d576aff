"""The policy's learning batcher: shows a learning policy each new pod once, in batches, and
numbers the batches (the epoch that scores are cached under)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gpupack.core.model import PodRequest
from gpupack.core.policies import Policy

# Learning batches: the first pod at once, then up to OBSERVE_WARMUP pods learned each batch
# OBSERVE_GROWTH times the pods learned so far (1, 3, 12, 48), and no sooner than
# OBSERVE_MIN_GAP_S after the last flush; after the warm-up a flush per OBSERVE_BATCH_MAX new
# pods, or per OBSERVE_FLUSH_S, whichever comes first.
OBSERVE_WARMUP = 64
OBSERVE_GROWTH = 3
OBSERVE_MIN_GAP_S = 1.0
OBSERVE_BATCH_MAX = 4096
OBSERVE_FLUSH_S = 60.0
SEEN_MAX = 10_000  # pods remembered as shown (a pod filtered again is not learned twice)


class Learner:
    """Show the policy each new pod once, in batches. A learning policy's scores change with every
    pod it is shown; batching keeps them stable between flushes (an epoch), so scores of nodes that
    did not change can be reused. Each flush costs: the first filter (or prioritize) of every pod
    shape after it scores all its nodes again (~0.15 ms a node, so ~150 ms at 1,000 nodes, on
    kube-scheduler's serial cycle). The first pod is learned at once (with nothing learned the
    policy has no workload to score against); while the learned workload is small each batch is
    OBSERVE_GROWTH times what was learned so far, and flushes are at least OBSERVE_MIN_GAP_S apart,
    so a burst of pods at ~30 pods/s costs 3 flushes instead of one per doubling (7). Later a
    workload's mix changes slowly, so a flush per minute (or per OBSERVE_BATCH_MAX pods) keeps up.

    "Exact" with learning on means: filter's best node is schedule()'s for the current view and the
    policy as of the last flush; pods seen since are not in the policy yet (the same lag as before,
    at most a batch or OBSERVE_MIN_GAP_S)."""

    def __init__(self, policy: Policy, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.monotonic = monotonic
        self.epoch = 0  # bumped whenever the policy was shown new pods
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._waiting: list[PodRequest] = []
        self._learned = 0
        self._last_flush = monotonic()

    def observe(self, pod: PodRequest) -> None:
        """Note a pod kube-scheduler asked about; flush the batch when it is due. Call with the
        view's lock held (the policy is read under it)."""
        if not getattr(self.policy, "learn", False):
            # a given workload (--workload-file), or a policy that learns nothing (bestfit,
            # random): a flush would only make every shape score every node again for nothing
            return
        ident = pod.uid or pod.key
        if ident in self._seen:
            return
        self._seen[ident] = None
        if len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        self._waiting.append(pod)
        now = self.monotonic()
        if self._due(now):
            for p in self._waiting:
                self.policy.observe(p)
            self._learned += len(self._waiting)
            self._waiting.clear()
            self._last_flush = now
            self.epoch += 1

    def _due(self, now: float) -> bool:
        total = self._learned
        if total == 0:
            return True
        since = now - self._last_flush
        batch = total * OBSERVE_GROWTH if total < OBSERVE_WARMUP else OBSERVE_BATCH_MAX
        return (len(self._waiting) >= batch and since >= OBSERVE_MIN_GAP_S) or since > OBSERVE_FLUSH_S
