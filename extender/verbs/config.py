"""The extender's settings, one object (from the command line in main.py, or a test's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtenderConfig:
    # how long a bind waits for the node's pending GPU handoff (and a bind slot) before failing
    bind_wait_s: float = 4.0
    # a handoff pending longer than this is reported and marked failed by the janitor
    stale_handoff_s: float = 120.0
    # kube-scheduler's profile whose waiting pods the requeuer touches
    scheduler_name: str = "gpupack-scheduler"
    # binds past their claim at most this many at a time (0: no limit)
    bind_concurrency: int = 0
    # filter passes only the policy's N best nodes of those that fit (0: all of them)
    keep_best: int = 0
    # a new pod shape's filter answers from the nodes fitted within this many seconds (0: every node)
    new_shape_budget_s: float = 0.0
