"""The extender's side of the policy's learning: each pod waiting for kube-scheduler (as the
pending-pod watch sees it) or asked about is offered to the learning batcher
(gpupack.core.learning, whose rule the simulator's pipeline model runs too), and the batches are
numbered (the epoch scores are cached under)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpupack.core.learning import LearningBatcher
from gpupack.core.model import PodRequest
from gpupack.core.policies import Policy
from gpupack.core.workload import Workload


class Learner:
    def __init__(self, policy: Policy, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        # the batches' clock is the batcher's (`batcher.clock`; tests set it)
        self.batcher: LearningBatcher[PodRequest] = LearningBatcher(policy.observe, monotonic)
        # told after each flush, view lock held (the shape warmer queues the shapes to score again)
        self.on_flush: Callable[[], None] = lambda: None

    @property
    def epoch(self) -> int:
        """Bumped whenever the policy was shown new pods."""
        return self.batcher.flushes

    def observe(self, pod: PodRequest) -> None:
        """Offer a pod kube-scheduler asked about, or one the pending-pod watch saw waiting for it
        (whichever comes first: it is learnt once). Call with the view's lock held (the policy is
        read under it). A policy given its workload (--workload-file), or one that learns nothing
        (bestfit, random), is shown nothing: a flush would only make every shape score every node
        again for nothing."""
        if self.policy.learn and self.batcher.offer(pod.uid or pod.key, pod):
            self.on_flush()

    def tracked_sizes(self) -> dict[str, int]:
        """Pods offered (their identities, the LRU of gpupack.core.learning.SEEN_MAX) and waiting
        for the next batch, and the pod shapes of the learnt mix (capped: LEARNT_SHAPES_MAX)."""
        wl = getattr(self.policy, "workload", None)
        return {
            "learner.seen": self.batcher.seen_count,
            "learner.waiting": len(self.batcher.waiting),
            "learner.shapes": len(wl.counts) if isinstance(wl, Workload) else 0,
        }

    def since_flush(self) -> float:
        """Seconds since the policy was last shown pods (on the batches' clock)."""
        return self.batcher.clock() - self.batcher.last_flush
