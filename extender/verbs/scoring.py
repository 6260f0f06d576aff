"""The policy's scores of the nodes a pod fits: prioritize's 0..10 answer, and the policy's best
few nodes that filter keeps (keep_best), cached per (pod shape, learning epoch) and node version."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Collection
from datetime import datetime

from gpupack.contract import Reservation
from gpupack.core.fit import Fit
from gpupack.core.model import PodRequest
from gpupack.core.policies import Policy
from gpupack.core.score_scale import MAX_SCORE, normalised

from ..state.placement_index import (
    AnswerCache,
    FitMemo,
    FitTable,
    Key,
    NameSets,
    PlacementIndex,
    Tables,
    VersionedTable,
    shape_of,
)
from ..state.records import NodeInfo
from ..state.view import ClusterView
from .filter_stages import take_best
from .learning import Learner

# Prioritize expects the pod on its top-scored nodes when at most this many share the top score
# (more: kube-scheduler's random pick among them rarely repeats), until its bind arrives or for
# at most EXPECT_S.
EXPECT_MAX_NODES = 4
EXPECT_S = 2.0
# After the policy learnt (a new epoch), a shape's node order from before it serves keep_best while
# the shape warmer scores every node again off kube-scheduler's cycle, for at most this long; then
# the filter scores them itself. The batches already let what the policy knows lag the pods it is
# asked about by up to a minute (gpupack.core.learning.OBSERVE_FLUSH_S): this is the same kind of lag.
STALE_ORDER_MAX_S = 30.0


class PriorityAnswer:
    """Raw scores of a prioritize answer kept up to date node by node, and its last result."""

    __slots__ = ("names", "name_set", "pos", "raw", "steered", "out")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name_set = set(names)
        self.pos = -1
        self.raw: dict[str, float] = {}
        self.steered: set[str] = set()
        self.out: list[int] | None = None

    def reorder(self, names: list[str]) -> None:
        """The same nodes, asked in the order of `names`: the scores follow that order."""
        self.names = names
        self.out = None

    def forget(self, n: str) -> None:
        self.raw.pop(n, None)
        self.steered.discard(n)
        self.out = None


def normalise(names: list[str], raw: dict[str, float], steered: set[str]) -> list[int]:
    """Raw scores to 0..MAX_SCORE over the lowest..highest (gpupack.core.score_scale); no fit 0;
    steered nodes MAX_SCORE."""
    norm = normalised(raw.values())
    get = raw.get
    out = [norm.get(get(n), 0) for n in names]  # type: ignore[arg-type]
    if steered:
        out = [MAX_SCORE if n in steered else s for n, s in zip(names, out, strict=True)]
    return out


def sorted_index(
    key_of: dict[str, tuple[bool, float, float]], scored: dict[str, float], ranked: list[str]
) -> list[tuple[tuple[bool, float, float], str]]:
    """sorted((key, n) for n, key in key_of.items()), the order of a new BestIndex, built without
    comparing those tuples: `ranked` (every node the policy ranked, by tie key then name) filtered
    to key_of's nodes, nodes it has not ranked (tie key 2.0) after them by name, then a stable sort
    on one float per node (its score negated; no score: after every score). After a learning flush
    every pod shape builds one of ~1,000-5,000 nodes on kube-scheduler's serial cycle; the tuple
    sort took ~0.7 ms at 1,000 nodes. A score that is not finite falls back to the tuple sort."""
    if not all(math.isfinite(v) for v in scored.values()):
        return sorted((k, n) for n, k in key_of.items())
    members = [n for n in ranked if n in key_of]
    if len(members) < len(key_of):
        known = set(members)
        members += sorted(n for n in key_of if n not in known)
    last = math.inf
    get = scored.get
    members.sort(key=lambda n: -s if (s := get(n)) is not None else last)
    return [(key_of[n], n) for n in members]


class BestIndex:
    """A request's nodes in the order :meth:`scoring.Scorer.keep_best` takes them, for one (shape,
    epoch), kept up to date node by node: each node's sort key, and (key, node) sorted."""

    __slots__ = ("names", "name_set", "pos", "key_of", "order")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name_set = set(names)
        self.pos = -1
        self.key_of: dict[str, tuple[bool, float, float]] = {}
        self.order: list[tuple[tuple[bool, float, float], str]] = []

    def reorder(self, names: list[str]) -> None:
        self.names = names  # the order of the request does not matter here

    def _unlist(self, n: str, key: tuple[bool, float, float]) -> bool:
        """Take (key, n) out of `order`. False when it is not found there (a key that does not
        compare equal to itself: a NaN score), and `order` was sorted again from `key_of` instead."""
        i = bisect.bisect_left(self.order, (key, n))
        if i < len(self.order) and self.order[i] == (key, n):
            del self.order[i]
            return True
        self.order = sorted((k, m) for m, k in self.key_of.items())
        return False

    def forget(self, n: str) -> None:
        key = self.key_of.pop(n, None)
        if key is not None:
            self._unlist(n, key)

    def set(self, n: str, key: tuple[bool, float, float]) -> None:
        old = self.key_of.get(n)
        if old == key:
            return
        self.key_of[n] = key
        if old is not None and not self._unlist(n, old):
            return  # sorted again, with the new key
        bisect.insort(self.order, (key, n))


ScoreTable = VersionedTable[float | None]  # node -> (version, raw score or None: no fit)


class Scorer:
    """Raw policy scores per node, and the answers built from them."""

    def __init__(
        self,
        view: ClusterView,
        policy: Policy,
        placements: PlacementIndex,
        learner: Learner,
        names: NameSets | None = None,
    ) -> None:
        self.view = view
        self.policy = policy
        self.placements = placements
        self.learner = learner
        self.scores: Tables[float | None] = Tables()  # (shape, epoch) -> node -> (version, raw score)
        # the last prioritize answer per (shape, epoch), and the policy's node order per (shape,
        # epoch) for keep_best, updated for the nodes changed since (the view's journal)
        self.names = names or placements.names
        self.priorities: AnswerCache[PriorityAnswer] = AnswerCache(PriorityAnswer, self.names)
        self.best_index: AnswerCache[BestIndex] = AnswerCache(BestIndex, self.names)
        self._ranked: tuple[int, list[str]] = (-1, [])  # tie_ranked
        # shape -> the epoch its keep_best order was last built for
        self.served: dict[Key, int] = {}
        # set by a running shape warmer (warming.ShapeWarmer.start): asked to score a shape's nodes
        # for the new epoch while its old order serves; None: every order is the current epoch's
        self.rescore: Callable[[PodRequest], None] | None = None
        # the last best()'s nodes scored and whether a stale order served (the slow-filter log)
        self.last_scored = 0
        self.last_stale = False
        view.gone_hooks.add(self.node_gone)

    def node_gone(self, name: str) -> None:
        """Node `name` was deleted: its scores go from every kept (shape, epoch) (view lock held).
        The answers drop it once a request no longer names it (AnswerCache.current)."""
        self.scores.forget_node(name)

    def tracked_sizes(self) -> dict[str, int]:
        """Entries kept: (shape, epoch) keys, their per-node scores, answers (view lock held)."""
        return {
            "scorer.keys": len(self.scores.data),
            "scorer.scores": self.scores.entries(),
            "scorer.priorities": len(self.priorities.data),
            "scorer.best_index": len(self.best_index.data),
            "scorer.served": len(self.served),
            "policy.tie_key": len(self.policy.tie_key),
        }

    # --- prioritize ------------------------------------------------------------------------------
    def prioritize(self, pod: PodRequest, names: list[str], now: datetime) -> list[int]:
        """Prioritize's scores 0..MAX_SCORE of `names`, in that order: the policy's, normalised;
        nodes locked by another pod's bind or handoff score 0."""
        with self.view.lock:
            self.learner.observe(pod)
            out = self._normalised(pod, names, now)
        locked = self.view.locks.locked_nodes(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        if locked:
            out = [0 if n in locked else v for n, v in zip(names, out, strict=True)]
        self.expect(pod, names, out)
        return out

    def _normalised(self, pod: PodRequest, names: list[str], now: datetime) -> list[int]:
        """The policy's scores of `names` normalised to 0..MAX_SCORE (view lock held)."""
        shape = shape_of(pod)
        fits = self.placements.fit_table(shape)
        key = (shape, self.learner.epoch)
        table = self.scores.table(key)
        st, todo = self.priorities.current(key, names, self.view.journal, self.view.reserved)
        pos = self.view.journal.seq
        nodes = self.view.nodes
        raw, steered = st.raw, st.steered
        memo: dict[Key, float] = {}
        fit_memo: FitMemo = {}
        for n in todo:
            st.out = None
            steered.discard(n)
            raw.pop(n, None)
            info = nodes.get(n)
            if info is None:
                continue
            score, res = self.raw_score(n, info, pod, now, fits, table, fit_memo, memo)
            if score is None:
                continue
            if res is not None:
                steered.add(n)  # the pod's own defrag reservation: it goes there
            else:
                raw[n] = score
        st.pos = pos
        if st.out is None:
            st.out = normalise(names, raw, steered)
        return st.out

    def expect(self, pod: PodRequest, names: list[str], scores: list[int]) -> None:
        """Note where kube-scheduler will most likely bind `pod` (see BindLocks.expected): the
        extender's weight makes its top score decide among nodes that pass."""
        if not pod.uid:
            return
        top = max(scores, default=0)
        best: list[str] = []
        if top > 0:
            for n, v in zip(names, scores, strict=True):
                if v == top:
                    best.append(n)
                    if len(best) > EXPECT_MAX_NODES:
                        best = []
                        break
        self.view.locks.expect(pod.uid, pod.key, tuple(best), time.monotonic() + EXPECT_S)

    # --- raw scores ------------------------------------------------------------------------------
    def raw_scores(
        self,
        pod: PodRequest,
        names: list[str],
        now: datetime,
        memos: tuple[dict[Key, float], FitMemo, dict[int, float | None]] | None = None,
    ) -> dict[str, float]:
        """The policy's raw score of each node in `names` the pod fits (view lock held); cached per
        (shape, epoch) and node version like prioritize's. `memos`: the per-state memos below,
        shared by calls over parts of one node list (the shape warmer's chunks) within one epoch."""
        shape = shape_of(pod)
        fits = self.placements.fit_table(shape)
        table = self.scores.table((shape, self.learner.epoch))
        nodes = self.view.nodes
        state_of = self.placements.state
        out: dict[str, float] = {}
        # Nodes in the same state fit and score the same (a fresh or evenly filled cluster, and after
        # the policy learned more pods, when every node is scored again), as in prioritize. Here
        # only the score is wanted, so a node in a state already scored in this call costs two
        # lookups: after a learning flush every node of every shape is scored again, ~1,000 nodes
        # on kube-scheduler's serial cycle, mostly in a few dozen states.
        memo, fit_memo, by_state = memos if memos is not None else ({}, {}, {})
        for n in names:
            info = nodes.get(n)
            if info is None:
                continue
            if not info.reservations:
                hit = table.fresh(n, info.version)
                if hit is not None:
                    if hit[1] is not None:
                        out[n] = hit[1]
                    continue
                state = state_of(n, info)
                if state is not None:
                    if state in by_state:
                        score = by_state[state]
                        table.put(n, info.version, score)
                    else:
                        score = by_state[state] = self.raw_score(
                            n, info, pod, now, fits, table, fit_memo, memo
                        )[0]
                    if score is not None:
                        out[n] = score
                    continue
            score, _res = self.raw_score(n, info, pod, now, fits, table, fit_memo, memo)
            if score is not None:
                out[n] = score
        return out

    def raw_score(
        self,
        n: str,
        info: NodeInfo,
        pod: PodRequest,
        now: datetime,
        fits: FitTable,
        table: ScoreTable,
        fit_memo: FitMemo,
        memo: dict[Key, float],
    ) -> tuple[float | None, Reservation | None]:
        """The policy's raw score of node `n` (None: the pod does not fit there), cached in `table`
        per node version unless the node holds defrag reservations (their answer depends on the
        time), and the reservation the fit would use. Nodes in the same state score the same
        (`memo`: a fresh or evenly filled cluster, common fill patterns). View lock held."""
        if not info.reservations:
            hit = table.fresh(n, info.version)
            if hit is not None:
                return hit[1], None
        r, res = self.placements.node_fit(n, pod, now, fits, fit_memo)
        score = None
        if isinstance(r, Fit):
            node = self.view.state.nodes[n]
            sig = (self.placements.state(n, info), tuple(sorted(r.charged.items())))
            score = memo.get(sig)
            if score is None:
                # r was fitted on the node at its version now (node_fit answers from the fit table
                # only at the node's version), so a score its fit kept stands unless the policy's
                # tables changed; a reservation's fit was made on a node holding it: scored anew.
                kept = None if info.reservations else self.policy.kept_score(pod, r)
                score = memo[sig] = kept if kept is not None else self.policy.node_score(node, pod, r)
        if not info.reservations:
            table.put(n, info.version, score)
        return score, res

    # --- keep_best -------------------------------------------------------------------------------
    def best(
        self,
        pod: PodRequest,
        names: list[str],
        passed: Collection[str],
        now: datetime,
        keep: int,
        busy: Callable[[str], str | None] | None = None,
        skipped: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> list[str]:
        """The `keep` nodes the policy prefers among those that pass (`passed`, out of the
        request's `names`). Order as :func:`gpupack.core.policies.schedule` picks: highest score,
        ties to the node first in the policy's seeded node order (ranked over every node of the
        view, in the order the view first saw them, as schedule() ranks its state's nodes). So for
        the same state, the node kept first is schedule()'s, and the bind's fit there its GPUs. The
        order of the request's nodes is kept per (shape, epoch) and only the nodes changed since
        the last request are scored again. With a shape warmer running, right after the policy
        learnt the shape's order from before serves (`order_key`) unless `fresh`."""
        with self.view.lock:
            tie = self.ranked_ties()
            shape, epoch = shape_of(pod), self.learner.epoch
            key = (shape, epoch) if fresh else self.order_key(pod, shape, epoch)
            idx, changed = self.best_index.current(key, names, self.view.journal, self.view.reserved)
            pos = self.view.journal.seq
            todo = list(changed)
            self.last_scored, self.last_stale = len(todo), key[1] != epoch
            scored = self.raw_scores(pod, todo, now)
            get = scored.get
            # a node whose fit changed since (no score) stays a candidate only after every scored one
            if idx.key_of:
                for n in todo:
                    idx.set(n, (get(n) is None, -(get(n) or 0.0), tie.get(n, 2.0)))
            else:
                idx.key_of = {n: (get(n) is None, -(get(n) or 0.0), tie.get(n, 2.0)) for n in todo}
                idx.order = sorted_index(idx.key_of, scored, self._tie_ranked())
            idx.pos = pos
            if key[1] == epoch and self.served.get(shape) != epoch:
                self._now_served(shape, epoch)
            want = passed if isinstance(passed, set) else set(passed)
            return take_best((n for _key, n in idx.order if n in want), keep, busy, skipped)

    def order_key(self, pod: PodRequest, shape: Key, epoch: int) -> Key:
        """The key of the node order keep_best takes for `shape`: the current epoch's, or while a
        shape warmer scores the nodes for it (`rescore`, asked here), for at most
        STALE_ORDER_MAX_S after the policy learnt, the order the shape had. Nodes changed since
        that order was built are scored as they are now: the order mixes the two for that while,
        instead of kube-scheduler waiting while every node is scored again (~110 ms a shape at
        5,000 nodes). View lock held."""
        key = (shape, epoch)
        if self.rescore is None or key in self.best_index.data:
            return key
        was = self.served.get(shape)
        if was is None or was == epoch or (shape, was) not in self.best_index.data:
            return key
        if self.learner.since_flush() > STALE_ORDER_MAX_S:
            return key
        self.rescore(pod)
        return (shape, was)

    def _now_served(self, shape: Key, epoch: int) -> None:
        """`shape`'s order for `epoch` is built: the one before it, and its scores, are dropped (they
        would hold a kept shape's room in the caches)."""
        was = self.served.get(shape)
        if was is not None:
            self.best_index.data.pop((shape, was), None)
            self.scores.data.pop((shape, was), None)
        self.served[shape] = epoch
        if len(self.served) > 4 * len(self.best_index.data) + 64:
            kept = {k[0] for k in self.best_index.data}
            self.served = {k: v for k, v in self.served.items() if k in kept}

    def ranked_ties(self) -> dict[str, float]:
        """The policy's tie key of every node of the view (ranking the ones it has not seen yet).
        View lock held."""
        tie = self.policy.tie_key
        if not self.view.state.nodes.keys() <= tie.keys():
            self.policy.rank_nodes(self.view.state.nodes)
        return tie

    def tie_order(self) -> list[str]:
        """Every node of the view in the policy's tie order (view lock held; do not change it)."""
        self.ranked_ties()
        return self._tie_ranked()

    def _tie_ranked(self) -> list[str]:
        """Every node the policy has ranked, in its tie order (ties of that order by name). The
        ranking only ever grows, so its size says whether this list is still current."""
        tie = self.policy.tie_key
        if self._ranked[0] != len(tie):
            self._ranked = (len(tie), sorted(tie, key=lambda n: (tie[n], n)))
        return self._ranked[1]
