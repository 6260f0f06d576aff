"""The filter verb: which of the nodes kube-scheduler asks about the pod fits, with a reason for
each that does not, and (with keep_best N) only the policy's N best of those that do."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from gpupack.core.model import PodRequest

from ..api.kube import Kube, NamespaceUnreadable
from ..api.wire import ExtenderArgs, PodRequestError, WireError, filter_result, unresolvable_result
from ..state.metrics import Metrics
from ..state.node_resources import HostedPodRequest
from ..state.view import ClusterView
from .answers import AnswerCache, FilterAnswer, shape_of
from .collector import VerbActivity
from .fitting import FitMemo, Fitter
from .learning import Learner
from .pod_requests import pod_request
from .sampling import NewShapeSampler
from .scoring import EXPECT_MAX_NODES, EXPECT_S, Scorer

log = logging.getLogger("gpupack.extender")


# How long a filter whose passing nodes all await a bind's room waits for it to be charged (a
# bind holds it on arrival unless its pod must be read first) before it answers an error that
# kube-scheduler retries.
WHOLE_WAIT_S = 1.0
# How long it waits for the bind of a pod only expected on those nodes (BindLocks.coming) to
# arrive: kube-scheduler starts it as it starts this filter, so it comes within milliseconds, or
# the pod is not being bound (held at Permit, another node chosen) and the node passes.
COMING_WAIT_S = 0.5


# A filter slower than this is logged (info) with where its time went: kube-scheduler's cycle waits
# for every filter, and the verb's latency histogram alone does not say why one was slow.
SLOW_FILTER_S = 0.05


class FilterCost:
    """What one filter spent its time on (for the slow-filter log line)."""

    __slots__ = ("lock_wait_s", "fitted", "scored", "stale_order", "sampled")

    def __init__(self) -> None:
        self.lock_wait_s = 0.0
        self.fitted = 0
        self.scored = 0
        self.stale_order = False
        self.sampled: tuple[int, int] | None = None  # a new shape's sample: (nodes looked at, asked)


def busy_reason(node: str, key: str) -> str:
    return f"node {node}: pod {key} is being bound there or waits for its kubelet (GPU handoff)"


def note_busy(busy: dict[str, str], failed: dict[str, str], codes: dict[str, int]) -> None:
    """Nodes left out of an answer because another pod's bind or handoff holds them (node -> that
    pod's key): each with the reason, counted as handoff-pending."""
    for n, by in busy.items():
        failed[n] = busy_reason(n, by)
    if busy:
        codes["handoff-pending"] = codes.get("handoff-pending", 0) + len(busy)


def without_busy(
    passed: list[str], busy: dict[str, str], failed: dict[str, str], codes: dict[str, int]
) -> list[str]:
    """`passed` without the nodes `busy` holds (note_busy), unless none would be left. A bind there
    would wait for the kubelet to admit the other pod first; another node that fits is better than
    a bind that waits and maybe fails into back-off."""
    held = {n: busy[n] for n in passed if n in busy}
    if not held or len(held) == len(passed):
        return passed
    note_busy(held, failed, codes)
    return [n for n in passed if n not in held]


class Filter:
    """Answers filter requests from the view, a pod shape's answer kept up to date node by node."""

    def __init__(
        self,
        view: ClusterView,
        kube: Kube | None,
        fitter: Fitter,
        scorer: Scorer,
        learner: Learner,
        metrics: Metrics,
        clock: Callable[[], datetime],
        keep_best: int,
        on_pod: Callable[[dict[str, Any], HostedPodRequest], None] = lambda pod, request: None,
        activity: VerbActivity | None = None,
    ) -> None:
        self.view = view
        self.kube = kube
        self.fitter = fitter
        self.scorer = scorer
        self.learner = learner
        self.metrics = metrics
        self.clock = clock
        # Filter passes only this many of the fitting nodes, the policy's best first (0: all of
        # them, and kube-scheduler's own scores and random ties pick among them with prioritize's).
        self.keep_best = keep_best
        # told of each pod filtered that parsed, and its request (the binder's pod memory)
        self.on_pod = on_pod
        self.answers: AnswerCache[FilterAnswer] = AnswerCache(FilterAnswer, scorer.names)
        self.activity = activity or VerbActivity()
        # told of each pod asked about, view lock held (the shape warmer's shapes to score again)
        self.on_asked: Callable[[PodRequest], None] = lambda pod: None
        self.cost = FilterCost()  # the last filter's (filters come one at a time: kube-scheduler's cycle)
        # a new shape's first filters answered from the nodes fitted within a budget (None: every node)
        self.sampler: NewShapeSampler | None = None
        # told of each pod answered from a sample, view lock not held (the shape warmer finishes it)
        self.on_sampled: Callable[[PodRequest], None] = lambda pod: None

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.cost = cost = FilterCost()
        try:
            return self._filter(args)
        finally:
            dt = time.perf_counter() - t0
            if dt > SLOW_FILTER_S:
                meta = args.pod.get("metadata") or {}
                how = ""
                if cost.stale_order:
                    how = " (the shape's order from before the policy learnt)"
                elif cost.sampled is not None:
                    how = f" (a new shape: {cost.sampled[0]} of {cost.sampled[1]} nodes looked at)"
                log.info(
                    "slow filter: %.0f ms for pod %s/%s: %.0f ms waiting for the cluster view, %d node(s) "
                    "fitted, %d scored%s",
                    dt * 1000, meta.get("namespace", ""), meta.get("name", ""), cost.lock_wait_s * 1000,
                    cost.fitted, cost.scored, how,
                )  # fmt: skip

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The view's lock, its wait counted in this filter's cost."""
        t = time.perf_counter()
        with self.view.lock:
            self.cost.lock_wait_s += time.perf_counter() - t
            yield

    def _filter(self, args: ExtenderArgs, waited: bool = False) -> dict[str, Any]:
        try:
            pod = pod_request(args.pod, self.kube)
        except PodRequestError as e:
            log.info("filter: %s", e)
            self.metrics.rejections.labels("invalid-request").inc(len(args.node_names))
            return unresolvable_result(args, f"gpupack cannot place this pod: {e}")
        except NamespaceUnreadable as e:
            log.warning("filter: %s", e)
            return filter_result(args, [], {}, {}, error=f"gpupack: {e}")
        self.on_pod(args.pod, pod)
        now = self.clock()
        names = args.node_names
        with self._locked():
            self.learner.observe(pod)
            self.on_asked(pod)
            sampled = self._sampled(pod, names, now)
            if sampled is None:
                st = self.answer(pod, names, now, self.cost)
                cand: set[str] | None = None
                passed: list[str] = []
                steered: list[str] | None = None
                if self.keep_best > 0 and not st.steered:
                    # only the policy's best few of the nodes that pass are answered: which pass is
                    # wanted as a set, not as a list in the request's order (~1,000 nodes a pod)
                    cand = set(st.ok)
                else:
                    if st.passed is None:
                        ok = st.ok
                        st.passed = [n for n in names if n in ok]
                    passed = list(st.passed)
                    steered = [n for n in passed if n in st.steered] if st.steered else None
                failed = dict(st.failed)
                unresolvable = dict(st.unresolvable)
                codes = {c: k for c, k in st.codes.items() if k}
                if steered:
                    target = steered[0]
                    steer = st.steered[target]
                    wanted = {n: st.steered[n] for n in steered}
        if sampled is not None:
            self.on_sampled(pod)
            return self._settle(args, pod, *sampled, waited)
        if names and codes.get("unknown-node") == len(st.name_set):
            shown = ", ".join(names[:5])
            raise WireError(f"none of the {len(names)} node(s) is known to gpupack: {shown}")
        if steered:
            # A pod with its own defrag reservation goes there, not anywhere else.
            for n in passed:
                if n not in wanted:
                    failed[n] = f"pod is steered to node {target} by defrag reservation {steer.id}"
                    codes["reservation-steer"] = codes.get("reservation-steer", 0) + 1
            passed = steered
        if cand is not None:
            passed = self._best_of(pod, names, cand, failed, codes, now)
        else:
            locked = self.view.locks.locked_nodes(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        if cand is None and locked:
            passed = without_busy(passed, locked, failed, codes)
        if cand is None and self.keep_best > 0 and len(passed) > self.keep_best:
            # The others are left out of the answer without a reason: kube-scheduler reads reasons
            # only when no node passes (and one always does here), and this one would only say that
            # another node was chosen. At 1,000 nodes that was ~50 KB of JSON per pod to write here
            # and to parse there, on the scheduler's serial cycle.
            kept = self.scorer.best(pod, names, passed, now, self.keep_best)
            codes["not-best"] = codes.get("not-best", 0) + len(passed) - len(kept)
            passed = kept
        return self._settle(args, pod, passed, failed, unresolvable, codes, waited)

    def _settle(
        self,
        args: ExtenderArgs,
        pod: PodRequest,
        passed: list[str],
        failed: dict[str, str],
        unresolvable: dict[str, str],
        codes: dict[str, int],
        waited: bool,
    ) -> dict[str, Any]:
        """The answer from the nodes that pass, once none of them is about to take a pod whose
        room the view does not charge yet (waiting for it, or leaving such a node out)."""
        unsettled = self.view.locks.unsettled(pod.uid) if passed else {}
        if passed and not waited:
            # Every node answered is expected to take another pod any moment (kube-scheduler
            # started its bind with this filter; see BindLocks.coming): wait for that bind to
            # charge its room, as for one that has arrived, so a fit this answer gives is one the
            # bind will not refuse. Once waited, such a node passes: that pod may never come.
            coming = self.view.locks.coming(pod.uid, time.monotonic())
            if coming and all(n in coming or n in unsettled for n in passed):
                self._await_room(passed, pod.uid)
                return self._filter(args, waited=True)
        if any(n in unsettled for n in passed):
            # A node that is about to take a pod whose room the view does not charge yet is not
            # whole: a fit there may be refused by the bind that follows. Another node that passes
            # is answered instead; with none, the pod waits for the room to be charged, and is
            # answered an error to retry rather than a fit its bind may refuse.
            whole = [n for n in passed if n not in unsettled]
            if not whole and not waited:
                self._await_room([n for n in passed if n in unsettled], pod.uid)
                return self._filter(args, waited=True)
            for n in passed:
                if n in unsettled:
                    failed[n] = busy_reason(n, unsettled[n])
                    codes["handoff-pending"] = codes.get("handoff-pending", 0) + 1
            passed = whole
            if not passed:
                self.metrics.rejections.labels("not-whole").inc(len(unsettled))
                return filter_result(
                    args, [], {}, {},
                    error="gpupack: the node(s) this pod fits are taking other pods whose GPUs are not "
                    f"charged yet ({', '.join(sorted(set(unsettled.values()))[:3])}); try again",
                )  # fmt: skip
        if self.keep_best > 0 and passed and pod.uid:
            # kube-scheduler binds there (one node: it skips prioritize, whose expectation this is):
            # the next pod's filter may come before this pod's bind and must steer clear of it
            self.view.locks.expect(
                pod.uid, pod.key, tuple(passed[:EXPECT_MAX_NODES]), time.monotonic() + EXPECT_S
            )
        for code, k in codes.items():
            self.metrics.rejections.labels(code).inc(k)
        return filter_result(args, passed, failed, unresolvable)

    def _sampled(
        self, pod: PodRequest, names: list[str], now: datetime
    ) -> tuple[list[str], dict[str, str], dict[str, str], dict[str, int]] | None:
        """A new shape's answer from the nodes looked at within the budget (sampling.py): with
        keep_best its best not held by another pod's bind or handoff, else every passing node in
        the request's order (prioritize scores them); None for the whole answer. View lock held."""
        if self.sampler is None or shape_of(pod) in self.answers.data:
            return None
        busy_on = self.view.locks.lock_check(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        sample = self.sampler.sample(pod, names, now, busy_on)
        self.cost.fitted += self.sampler.fitted
        self.cost.scored += self.sampler.scored
        if sample is None:
            return None
        self.cost.sampled = (sample.looked, len(names))
        failed = dict(sample.failed)
        codes = {c: k for c, k in sample.codes.items() if k}
        codes["not-sampled"] = len(names) - sample.looked
        if self.keep_best > 0:
            skipped: dict[str, str] = {}
            passed = sample.best(self.scorer.ranked_ties(), self.keep_best, busy_on, skipped)
            note_busy(skipped, failed, codes)
            codes["not-best"] = len(sample.ok) - len(passed) - len(skipped)
        else:
            passed = [n for n in names if n in sample.ok]
            locked = {n: by for n in passed if (by := busy_on(n)) is not None}
            passed = without_busy(passed, locked, failed, codes)
        return passed, failed, dict(sample.unresolvable), codes

    def _await_room(self, nodes: list[str], uid: str) -> None:
        """Wait (at most WHOLE_WAIT_S, standing aside for the binds) until one of `nodes` has the
        room of the pod about to take it charged, or is no longer about to take one (nor expected
        to)."""
        t0 = time.monotonic()
        deadline = t0 + WHOLE_WAIT_S
        with self.activity.aside(), self.view.changed:
            while (left := deadline - (now := time.monotonic())) > 0:
                unsettled = self.view.locks.unsettled(uid)
                coming = self.view.locks.coming(uid, now) if now - t0 < COMING_WAIT_S else {}
                if any(n not in unsettled and n not in coming for n in nodes):
                    return
                self.view.changed.wait(min(left, 0.05))

    def answer(
        self, pod: PodRequest, names: list[str], now: datetime, cost: FilterCost | None = None
    ) -> FilterAnswer:
        """The pod shape's answer, updated for the nodes changed since it was last given (all of
        them for a new shape), those nodes counted in `cost`. View lock held."""
        shape = shape_of(pod)
        table = self.fitter.fits.table(shape)
        st, todo = self.answers.current(shape, names, self.view.journal, self.view.reserved)
        pos = self.view.journal.seq
        nodes = self.view.nodes
        if cost is not None:
            cost.fitted += len(todo)
        if todo is names and pod.needs_gpu:
            self.fitter.fit_every_node(st, names, pod, now, table)
        else:
            memo: FitMemo = {}
            update = st.update
            node_fit = self.fitter.node_fit
            for n in todo:
                info = nodes.get(n)
                res = None
                if info is not None and not info.reservations:
                    hit = table.fresh(n, info.version)
                    if hit is not None:
                        r = hit[1]
                    else:
                        r, res = node_fit(n, pod, now, table, memo)
                else:
                    r, res = node_fit(n, pod, now, table, memo)
                update(n, r, res)
        st.pos = pos
        return st

    def _best_of(
        self,
        pod: PodRequest,
        names: list[str],
        cand: set[str],
        failed: dict[str, str],
        codes: dict[str, int],
        now: datetime,
    ) -> list[str]:
        """filter's answer with keep_best from `cand`, the nodes that pass (no defrag steering):
        as filter would answer from them in the request's order, without that list. Nodes locked
        by another pod's bind or handoff are left out (with the reason) while another passes. Only
        the nodes the answer looks at are asked whether they are locked (BindLocks.lock_check), so
        handoffs pending elsewhere in the cluster cost nothing here."""
        with self._locked():
            busy_on = self.view.locks.lock_check(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
            if len(cand) > self.keep_best:
                skipped: dict[str, str] = {}
                kept = self.scorer.best(pod, names, cand, now, self.keep_best, busy_on, skipped)
                self.cost.scored += self.scorer.last_scored
                self.cost.stale_order = self.scorer.last_stale
                note_busy(skipped, failed, codes)
                # the others pass too but are left out (see filter)
                codes["not-best"] = codes.get("not-best", 0) + len(cand) - len(kept) - len(skipped)
                return kept
            busy = {n: by for n in cand if (by := busy_on(n)) is not None}
        if busy and len(busy) < len(cand):
            note_busy(busy, failed, codes)
            cand.difference_update(busy)
        return [n for n in names if n in cand]
