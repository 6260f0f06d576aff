"""Placement policies, selectable by name: the registry (`POLICIES` of `PolicySpec`, `get_policy`,
`DEFAULT_POLICY`) and the simple policies (random, bestfit).

The interface and the shared Filter → Score → pick loop (`Policy`, `schedule`, ...) live in
:mod:`gpupack.core.policy_base` and are re-exported here; the fragmentation policies live in
:mod:`gpupack.core.fgd` and :mod:`gpupack.core.gpupack_policy`. They build on the base only, so
importing this module imports them, and the registry below lists every policy by name without
any module registering itself. A policy's entry is all the extender, the simulator and the CLIs
need to know of it (docs/architecture.md, "Adding a policy").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpupack.core.fgd import FGDPolicy
from gpupack.core.fit import Fit
from gpupack.core.gpupack_policy import GpupackPolicy
from gpupack.core.model import FULL, GPU, Node, PodRequest
from gpupack.core.policy_base import Decision, Policy, WorkloadPolicy, filter_nodes, pick_best, schedule
from gpupack.core.workload import Workload


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


# `fgd` by the name it had when it was a mixin on Policy.
FGD = FGDPolicy


@dataclass(frozen=True)
class PolicySpec:
    """Everything the extender, the simulator and the CLIs know of one policy.

    `factory(seed=..., [workload=...])` makes one. `learns`: it packs against a workload
    (:class:`~gpupack.core.policy_base.WorkloadPolicy`): it takes `workload=` and, without one,
    learns it from the pods it is shown. `fast_scorer`: the simulator's vectorised scorer for its
    trace replay, as "module:function" (see :mod:`gpupack.simulate.fast_policy` for the
    signature); named rather than imported because the core may not import the simulator (nor
    numpy). None: the trace replay cannot run this policy, and `gpupack simulate` says so instead
    of replaying another; the simulator's pipeline mode and churn replay, which run the policy's
    own per-node code, still can.
    """

    name: str
    factory: Callable[..., Policy]
    learns: bool = False
    fast_scorer: str | None = None

    def make(self, seed: int = 0, workload: Workload | None = None) -> Policy:
        """A policy of this kind; `workload` goes to a learning policy (None: it learns one) and
        is not needed by the others."""
        if self.learns:
            return self.factory(seed=seed, workload=workload)
        return self.factory(seed=seed)


_FAST = "gpupack.simulate.fast_policy"

# Every policy by the name `--policy`, the replay and the extender select it with.
POLICIES: dict[str, PolicySpec] = {
    s.name: s
    for s in (
        PolicySpec("random", RandomPolicy, fast_scorer=f"{_FAST}:random_draw"),
        PolicySpec("bestfit", BestFitPolicy, fast_scorer=f"{_FAST}:bestfit_scores"),
        PolicySpec("fgd", FGDPolicy, learns=True, fast_scorer=f"{_FAST}:fgd_scores"),
        PolicySpec("gpupack", GpupackPolicy, learns=True, fast_scorer=f"{_FAST}:gpupack_scores"),
    )
}
DEFAULT_POLICY = "gpupack"


class UnknownPolicy(ValueError):
    pass


def policy_spec(name: str) -> PolicySpec:
    """The registry entry of `name`; UnknownPolicy naming the choices otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None


def get_policy(name: str, seed: int = 0, **kwargs: Any) -> Policy:
    """A policy by name; `kwargs` go to its factory (TypeError for one it does not take)."""
    return policy_spec(name).factory(seed=seed, **kwargs)


__all__ = [
    "DEFAULT_POLICY",
    "FGD",
    "MAX_SPEC_CPU",
    "MAX_SPEC_GPU",
    "POLICIES",
    "BestFitPolicy",
    "Decision",
    "FGDPolicy",
    "GpupackPolicy",
    "Policy",
    "PolicySpec",
    "RandomPolicy",
    "UnknownPolicy",
    "WorkloadPolicy",
    "bestfit_score",
    "filter_nodes",
    "get_policy",
    "pick_best",
    "policy_spec",
    "schedule",
]
