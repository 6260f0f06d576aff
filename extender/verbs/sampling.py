"""A new pod shape's filter answered from the nodes fitted within a time budget, while the rest are
fitted off kube-scheduler's cycle.

The first filter of a pod shape fits and scores every node it is asked about: ~250 ms of CPU at
5,000 nodes with 100,000 running pods, where nearly every node is in a state of its own, and
kube-scheduler's serial cycle waits for it. The shape warmer (warming.py) does that work ahead of
kube-scheduler only when it has a CPU to spare; in a burst of new shapes it has none. With a
budget (`--new-shape-budget-ms`), a filter for a shape that has no answer yet fits nodes in an
order likely to hold the best ones, and stops once the budget is spent, at least `min_nodes` were
looked at and one passes that no other pod's bind or handoff holds (and it fitted one chunk of
CHUNK nodes at least, and every node holding defrag reservations), as kube-scheduler's own
percentageOfNodesToScore stops looking for feasible nodes (100 at least). Its answer is the best
of the nodes looked at; the nodes it did not reach are left out of it, without a reason (one
passes, so kube-scheduler reads none).

Every fit and score is kept in the same per-node-version caches the full answer is built from, so
nothing is computed twice: the next filter of the shape takes the nodes already fitted at no cost
and fits further ones, the shape warmer is asked to finish the shape off the cycle, and once every
node is fitted the filter builds the shape's full answer from the caches.

The order: the nodes holding defrag reservations first (the pod may be steered there: then the
whole answer is built), then every node in the policy's tie order, the order that decides among
equal scores. The policy's scores are coarse (0..99), so many nodes share the top score, and a
sample in that order often holds the very node the full answer takes: in bench_view.py's
5,000-node cluster (100,000 pods bound at random) the sampled answer scored as high as the full
answer's for 39 of 40 new shapes, 1 point lower for the 40th. In a cluster gpupack packed, the
nodes it filled first are the first in that order, as its ties sent pods there.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from gpupack.core.fit import Fit, FitFailure
from gpupack.core.model import PodRequest

from ..state.placement_index import FitMemo, Key, PlacementIndex, shape_of
from ..state.view import ClusterView
from .filter_stages import take_best
from .scoring import Scorer

# Nodes looked at, at least, before a budget stops a sampled filter: kube-scheduler's own minimum of
# feasible nodes to find (minFeasibleNodesToFind) when percentageOfNodesToScore samples.
MIN_NODES = 100
# Nodes fitted between looks at the clock.
CHUNK = 16


class Sample:
    """What a sampled filter found: the passing nodes looked at (with the policy's raw score when
    kept best are wanted), the failing ones with their reasons, and how many were looked at."""

    __slots__ = ("ok", "failed", "unresolvable", "codes", "looked")

    def __init__(self) -> None:
        self.ok: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.unresolvable: dict[str, str] = {}
        self.codes: Counter[str] = Counter()
        self.looked = 0  # nodes whose answer is in the sample

    def passes(self, n: str, score: float) -> None:
        """Node `n` fits the pod; `score`: the policy's raw score there (0.0 when not scored)."""
        self.looked += 1
        self.ok[n] = score

    def fails(self, n: str, r: FitFailure) -> None:
        self.looked += 1
        (self.unresolvable if r.unresolvable else self.failed)[n] = r.reason
        self.codes[r.code] += 1

    def best(
        self,
        tie: dict[str, float],
        keep: int,
        busy: Callable[[str], str | None] | None,
        skipped: dict[str, str],
    ) -> list[str]:
        """The `keep` passing nodes the policy prefers, in Scorer.best's order (highest score, then
        the tie order), those `busy` holds left out while another passes (noted in `skipped`)."""
        ok = self.ok
        order = sorted(ok, key=lambda n: (-ok[n], tie.get(n, 2.0), n))
        return take_best(order, keep, busy, skipped)


class NewShapeSampler:
    """Samples the nodes of a pod shape's first filters (see the module's doc)."""

    def __init__(
        self,
        view: ClusterView,
        placements: PlacementIndex,
        scorer: Scorer,
        budget_s: float,
        scored: bool,
        min_nodes: int = MIN_NODES,
    ) -> None:
        self.view, self.placements, self.scorer = view, placements, scorer
        self.budget_s = budget_s
        self.with_scores = scored  # keep_best: the sample's passing nodes are scored
        self.min_nodes = min_nodes
        self.clock = time.perf_counter
        self.fitted = self.scored = 0  # by the last sample(), whole answer or not (the slow-filter log)

    def sample(
        self,
        pod: PodRequest,
        names: list[str],
        now: datetime,
        busy: Callable[[str], str | None] = lambda n: None,
    ) -> Sample | None:
        """The filter of a shape that has no answer yet, from the nodes looked at within the budget;
        None when the whole answer is to be built: the budget is off, the request is no larger than
        `min_nodes`, every node got looked at, or the pod is steered by a defrag reservation. A
        passing node that `busy` holds (another pod's bind or handoff there) does not end the
        sample: the answer would be that node, which the full answer avoids while another passes.
        View lock held."""
        self.fitted = self.scored = 0
        if self.budget_s <= 0 or len(names) <= self.min_nodes or not pod.needs_gpu:
            return None
        deadline = self.clock() + self.budget_s
        shape = shape_of(pod)
        fits = self.placements.fit_table(shape)
        epoch = self.scorer.learner.epoch
        scores = self.scorer.scores.table((shape, epoch)) if self.with_scores else None
        nodes = self.view.nodes
        out = Sample()
        # every node fitted (and scored) already is in the sample at no cost; the others wait
        todo: list[str] = []
        for n in self.order(names):
            info = nodes.get(n)
            hit = None if info is None or info.reservations else fits.fresh(n, info.version)
            if hit is None:
                todo.append(n)
                continue
            r = hit[1]
            if not isinstance(r, Fit):
                out.fails(n, r)
            elif scores is None:
                out.passes(n, 0.0)
            else:
                known = scores.fresh(n, info.version)  # type: ignore[union-attr]
                if known is None or known[1] is None:
                    todo.append(n)
                else:
                    out.passes(n, known[1])
        # every node holding defrag reservations is fitted (never cached: their answer depends on
        # the time), so a pod steered by its own is never answered from a sample; they lead `todo`
        reserved = self.view.reserved
        must = 0
        while must < len(todo) and todo[must] in reserved:
            must += 1
        free = any(busy(n) is None for n in out.ok)
        memo: FitMemo = {}
        memos: tuple[dict[Key, float], FitMemo, dict[int, float | None]] = ({}, {}, {})
        i = 0
        while i < len(todo):
            # one chunk at least: every sampled filter brings the shape's whole answer nearer
            if i >= must and i and free and out.looked >= self.min_nodes and self.clock() >= deadline:
                return out
            chunk = todo[i : i + CHUNK]
            i += CHUNK
            passing: list[str] = []
            for n in chunk:
                r, res = self.placements.node_fit(n, pod, now, fits, memo)
                if res is not None:
                    return None  # steered by a defrag reservation: the full answer says where
                self.fitted += 1
                if not isinstance(r, Fit):
                    out.fails(n, r)
                    continue
                free = free or busy(n) is None
                if scores is None:
                    out.passes(n, 0.0)
                else:
                    passing.append(n)
            if passing:
                got = self.scorer.raw_scores(pod, passing, now, memos)
                self.scored += len(passing)
                for n in passing:
                    score = got.get(n)
                    if score is None:  # fitted just now, so scored: never, but not a node to answer
                        return None
                    out.passes(n, score)
        return None  # every node looked at: the full answer, from the caches

    def order(self, names: list[str]) -> list[str]:
        """The asked nodes in the order a sample looks at them (see the module's doc)."""
        asked = self.scorer.names.of(names)
        out = [n for n in self.view.reserved if n in asked]
        seen = set(out)
        out.extend(n for n in self.scorer.tie_order() if n in asked and n not in seen)
        if len(out) < len(asked):
            seen.update(out)
            out.extend(n for n in names if n not in seen)  # not in the view: node_fit says so
        return out
