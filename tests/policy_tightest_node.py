"""A trivial policy, written as docs/architecture.md ("Adding a policy") says to add one: this module
plus one registry entry (tests/extender/test_adding_a_policy.py makes it).

`tightest-node`: the node left with the least free GPU capacity, the tightest GPU inside (the
base's default rank). `fast_scores` is its vectorised form for the simulator's trace replay."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpupack.core.fit import Fit
from gpupack.core.model import FULL, Node, PodRequest
from gpupack.core.policies import Policy, PolicySpec


class TightestNodePolicy(Policy):
    name = "tightest-node"

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        free = sum(g.free_milli for g in node.gpus if g.healthy)
        for _, milli, ex in f.charged.values():
            free -= FULL if ex else milli
        return -free


def fast_scores(
    policy: Policy, cl: Any, idx: np.ndarray, f: np.ndarray | None, milli: int, whole: int, cpu: int
) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """`node_score` for every candidate at once; inside a node the GPU with the least free milli,
    as the base's `tightest` rank (openb shares ask no GPU memory)."""
    left = cl.tot[idx] - (milli if f is not None else whole * FULL)
    return (-left, -f) if f is not None else -left


SPEC = PolicySpec("tightest-node", TightestNodePolicy, fast_scorer=f"{__name__}:fast_scores")
