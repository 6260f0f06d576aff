"""Placement policies, selectable by name: the registry (`POLICIES`, `get_policy`, `DEFAULT_POLICY`)
and the simple policies (random, bestfit, fgd).

The interface and the shared Filter → Score → pick loop (`Policy`, `schedule`, ...) live in
:mod:`gpupack.core.policy_base` and are re-exported here; the default policy lives in
:mod:`gpupack.core.gpupack_policy`. Both build on the base only, so importing this module imports
them, and the registry below lists every policy by name without any module registering itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpupack.core.fgd import FGDPolicy, Workload
from gpupack.core.fit import Fit
from gpupack.core.gpupack_policy import GpupackPolicy
from gpupack.core.model import FULL, GPU, Node, PodRequest
from gpupack.core.policy_base import Decision, Policy, filter_nodes, pick_best, schedule


class RandomPolicy(Policy):
    name = "random"

    def gpu_rank(self, node: Node, gpu: GPU, mem: int, milli: int) -> float:
        return self.rng.random()

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        return self.rng.random()


def _gpu_free_after(node: Node, f: Fit) -> int:
    """Free GPU milli on the node after placing `f`."""
    free = sum(g.free_milli for g in node.gpus if g.healthy)
    for _, milli, ex in f.charged.values():
        free -= FULL if ex else milli
    return max(0, free)


# The published BestFit measures what a node has left against the largest node spec, not against
# the node's own size (hkust-adsl/kubernetes-scheduler-simulator, best_fit_score.go).
MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8 * FULL


class BestFitPolicy(Policy):
    """The node left with the least room, CPU and GPU each over the largest node spec, averaged;
    tightest GPU inside. Integer score ``int(100 * (1 - leftover))`` as in the published simulator.
    """

    name = "bestfit"

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        cpu_left = node.free_cpu - pod.cpu_milli if node.cpu_milli else 0
        return bestfit_score(_gpu_free_after(node, f), cpu_left)


def bestfit_score(gpu_left: float, cpu_left: float) -> int:
    """Shared by the policy and the replay's fast path so both compute the same float expression."""
    return int((1.0 - (cpu_left / MAX_SPEC_CPU * 0.5 + gpu_left / MAX_SPEC_GPU * 0.5)) * 100)


class FGD(FGDPolicy, Policy):
    """`fgd`: fragmentation gradient descent (see :mod:`gpupack.core.fgd`)."""

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        Policy.__init__(self, seed)
        self._setup(workload)


# Every policy by the name `--policy`, the replay and the extender select it with.
POLICIES: dict[str, Callable[..., Policy]] = {
    "random": RandomPolicy,
    "bestfit": BestFitPolicy,
    "fgd": FGD,
    "gpupack": GpupackPolicy,
}
DEFAULT_POLICY = "gpupack"


class UnknownPolicy(ValueError):
    pass


def get_policy(name: str, seed: int = 0, **kwargs: Any) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory(seed=seed, **kwargs)


__all__ = [
    "DEFAULT_POLICY",
    "FGD",
    "MAX_SPEC_CPU",
    "MAX_SPEC_GPU",
    "POLICIES",
    "BestFitPolicy",
    "Decision",
    "GpupackPolicy",
    "Policy",
    "RandomPolicy",
    "UnknownPolicy",
    "bestfit_score",
    "filter_nodes",
    "get_policy",
    "pick_best",
    "schedule",
]
