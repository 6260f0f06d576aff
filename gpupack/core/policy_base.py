"""The policy interface and the Filter → Score → pick loop every policy shares.

A policy answers two questions over plain data: which GPU inside a node (`gpu_rank`, lower first)
and how good a node is (`node_score`, higher first). `schedule` is the loop the replay and the
extender's bind share; the extender runs the filter and score halves separately per HTTP verb.
A policy that packs against a workload (the pod shapes it expects) builds on `WorkloadPolicy`, which
is given the workload or learns it from the pods it is shown (`observe`).
The concrete policies and the registry that names them are in :mod:`gpupack.core.policies`; this
module knows none of them, so a policy module can build on it without an import cycle.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpupack.core.fit import Fit, FitFailure, fit, tightest
from gpupack.core.model import GPU, ClusterState, Node, PodRequest
from gpupack.core.workload import LEARNT_SHAPES_MAX, Workload, shape_of


class Policy:
    name = "base"
    # Whether `observe` changes the policy's scores: the extender batches what it shows a learning
    # policy (gpupack.core.learning) and shows a policy that does not learn nothing.
    learn = False

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

    def kept_score(self, pod: PodRequest, f: Fit) -> float | None:
        """node_score(node, pod, f) without the node, from what `f`'s fit kept (Fit.score_memo),
        for a caller that knows the node is in the state `f` was fitted on (the extender's fit
        table, per node version); None when nothing was kept or the policy's tables changed
        since: ask node_score."""
        return None

    def fit(self, node: Node, pod: PodRequest) -> Fit | FitFailure:
        return fit(node, pod, self.gpu_rank)

    def refuses(self, node: Node, pod: PodRequest) -> FitFailure | None:
        """Why the policy refuses `pod` on `node` although it fits there (its `fit` answers this
        failure instead of the fit), or None. Preemption asks it of the node with the victims
        gone, so that it evicts nobody for a pod the policy would still refuse there."""
        return None

    def observe(self, pod: PodRequest) -> None:
        """Called once per arriving pod; policies that learn the workload's shape override it."""


class WorkloadPolicy(Policy):
    """A policy that packs against a workload: `workload` given (the replay passes the trace's
    shapes, the extender a --workload-file), or, without one, learnt from the pods it is shown
    through `observe`, which is what a live scheduler does."""

    def __init__(self, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed)
        self.learn = workload is None
        # a learnt workload is bounded: its shapes are whatever the pods ask for
        self.workload = workload if workload is not None else Workload(max_shapes=LEARNT_SHAPES_MAX)

    def observe(self, pod: PodRequest) -> None:
        if self.learn:
            self.workload.add(shape_of(pod))


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
