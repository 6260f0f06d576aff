"""Placement policies, selectable by name. Each one answers two questions over plain data:
which GPU inside a node (`gpu_rank`, lower first) and how good a node is (`node_score`, higher first).

`schedule` is the Filter → Score → pick loop the replay and the extender's bind share; the
extender runs the filter and score halves separately per HTTP verb.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpupack.core.fgd import FGDPolicy, Workload
from gpupack.core.fit import Fit, FitFailure, fit, tightest
from gpupack.core.model import FULL, GPU, ClusterState, Node, PodRequest


class Policy:
    name = "base"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        # Per-seed random order of the nodes: ties go to the node first in it (openb-replay.md).
        self.tie_key: dict[str, float] = {}

    def rank_nodes(self, names: Iterable[str]) -> None:
        """Give every node not seen before its place in the tie order (one RNG draw each, in order)."""
        for n in names:
            if n not in self.tie_key:
                self.tie_key[n] = self.rng.random()

    def gpu_rank(self, node: Node, gpu: GPU, mem: int, milli: int) -> float:
        return tightest(node, gpu, mem, milli)

    def node_score(self, node: Node, pod: PodRequest, f: Fit) -> float:
        raise NotImplementedError

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        return fit(node, pod, self.gpu_rank)

    def observe(self, pod: PodRequest) -> None:
        """Called once per arriving pod; policies that learn the workload's shape override it."""


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


@dataclass
class Decision:
    node: str | None
    fit: Fit | None
    failures: dict[str, FitFailure] = field(default_factory=dict)

    @property
    def placed(self) -> bool:
        return self.fit is not None


def filter_nodes(
    nodes: Iterable[Node], pod: PodRequest, policy: Policy
) -> tuple[dict[str, Fit], dict[str, FitFailure]]:
    ok: dict[str, Fit] = {}
    bad: dict[str, FitFailure] = {}
    for node in nodes:
        r = policy.fit(node, pod)
        if isinstance(r, Fit):
            ok[node.name] = r
        else:
            bad[node.name] = r
    return ok, bad


def pick_best(scored: list[tuple[str, float]], policy: Policy) -> str:
    """Highest score; ties go to the node first in the policy's seeded random node order.

    A fixed order (not a fresh draw per decision) is what the published openb runs did; it also
    makes ties pack onto the same nodes instead of spreading. The replay's fast path does the same.
    """
    policy.rank_nodes(n for n, _ in scored)
    top = max(s for _, s in scored)
    return min((n for n, s in scored if s == top), key=policy.tie_key.__getitem__)


def schedule(state: ClusterState, pod: PodRequest, policy: Policy, commit: bool = True) -> Decision:
    """Filter every node, score the feasible ones, pick the best (ties: the policy's seeded order)."""
    policy.rank_nodes(state.nodes)
    ok, bad = filter_nodes(state.nodes.values(), pod, policy)
    if not ok:
        return Decision(None, None, bad)
    best_name = pick_best(
        [(name, policy.node_score(state.nodes[name], pod, f)) for name, f in ok.items()], policy
    )
    chosen = ok[best_name]
    if commit:
        state.place(pod, chosen.placement, chosen.charged)
    return Decision(best_name, chosen, bad)


POLICIES: dict[str, Callable[..., Policy]] = {
    "random": RandomPolicy,
    "bestfit": BestFitPolicy,
}
DEFAULT_POLICY = "gpupack"


class FGD(FGDPolicy, Policy):
    """`fgd`: fragmentation gradient descent (see :mod:`gpupack.core.fgd`)."""

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        Policy.__init__(self, seed)
        self._setup(workload)


POLICIES["fgd"] = FGD


class UnknownPolicy(ValueError):
    pass


def get_policy(name: str, seed: int = 0, **kwargs: Any) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory(seed=seed, **kwargs)


# The default policy's module builds on Policy above and registers itself in POLICIES; importing it
# last keeps every policy listed as soon as this module is imported, whichever is imported first.
from gpupack.core import gpupack_policy  # noqa: E402, F401
