"""The filter verb: which of the nodes kube-scheduler asks about the pod fits, with a reason for
each that does not, and (with keep_best N) only the policy's N best of those that do."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from gpupack.contract import Reservation
from gpupack.core.model import PodRequest

from ..api.kube import Kube, NamespaceUnreadable
from ..api.wire import ExtenderArgs, PodRequestError, WireError, filter_result, unresolvable_result
from ..state.metrics import Metrics
from ..state.node_resources import HostedPodRequest
from ..state.placement_index import PlacementIndex, shape_of
from ..state.view import ClusterView
from .collector import VerbActivity
from .filter_stages import Busy, NotWhole, Ranking, Verdict, Wait, rank, settle, steer
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


class _CountedLock:
    """The view's lock held by a filter, the time it waited for it added to the filter's cost."""

    __slots__ = ("filtering", "lock")

    def __init__(self, filtering: Filter) -> None:
        self.filtering, self.lock = filtering, filtering.view.lock

    def __enter__(self) -> None:
        t = time.perf_counter()
        self.lock.acquire()
        self.filtering.cost.lock_wait_s += time.perf_counter() - t

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


class Candidates:
    """The candidates stage's output: the verdict before steering and ranking, the nodes the pod's
    own defrag reservations steer it to, and how `rank` chooses (one ranking, or two: nodes held
    by other binds first, then the policy's best), and whether it came from a new shape's sample."""

    __slots__ = ("verdict", "steered", "_rankings", "sampled")

    def __init__(
        self, verdict: Verdict, steered: dict[str, Reservation], *rankings: Ranking, sampled: bool = False
    ) -> None:
        self.verdict, self.steered, self._rankings, self.sampled = verdict, steered, rankings, sampled

    def rankings(self) -> tuple[Ranking, ...]:
        return self._rankings


class Filter:
    """Answers filter requests from the view, a pod shape's answer kept up to date node by node."""

    def __init__(
        self,
        view: ClusterView,
        kube: Kube | None,
        placements: PlacementIndex,
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
        self.placements = placements
        self.scorer = scorer
        self.learner = learner
        self.metrics = metrics
        self.clock = clock
        # Filter passes only this many of the fitting nodes, the policy's best first (0: all of
        # them, and kube-scheduler's own scores and random ties pick among them with prioritize's).
        self.keep_best = keep_best
        # told of each pod filtered that parsed, and its request (the binder's pod memory)
        self.on_pod = on_pod
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

    def _locked(self) -> _CountedLock:
        """The view's lock, its wait counted in this filter's cost."""
        return _CountedLock(self)

    def _filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """parse -> candidates -> steer -> rank -> settle -> answer (filter_stages.py); a filter
        whose nodes all await a bind's room waits once for it and runs the stages after parsing
        again."""
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
        names = args.node_names
        for waited in (False, True):
            now = self.clock()
            with self._locked():
                c = self._candidates(pod, names, now)
                v = steer(c.verdict, c.steered)
                for how in c.rankings():
                    v = rank(v, names, how)
            if c.sampled:
                self.on_sampled(pod)
            unsettled, coming = (
                self.view.locks.about_to_take(pod.uid, None if waited else time.monotonic())
                if v.passed
                else ({}, {})
            )
            out = settle(v, unsettled, coming, waited)
            if isinstance(out, Wait):
                self._await_room(out.nodes, pod.uid)
                continue
            return self._answer(args, pod, out)
        raise AssertionError("settle waits only before the filter has waited")

    def _answer(self, args: ExtenderArgs, pod: PodRequest, out: Verdict | NotWhole) -> dict[str, Any]:
        """The extender/v1 answer of a settled verdict; with keep-best, the nodes answered are
        expected to take this pod (the next pod's filter steers clear of them)."""
        if isinstance(out, NotWhole):
            self.metrics.rejections.labels("not-whole").inc(len(out.by))
            return filter_result(
                args, [], {}, {},
                error="gpupack: the node(s) this pod fits are taking other pods whose GPUs are not "
                f"charged yet ({', '.join(sorted(set(out.by.values()))[:3])}); try again",
            )  # fmt: skip
        passed = list(out.passed)
        if self.keep_best > 0 and passed and pod.uid:
            # kube-scheduler binds there (one node: it skips prioritize, whose expectation this is):
            # the next pod's filter may come before this pod's bind and must steer clear of it
            self.view.locks.expect(
                pod.uid, pod.key, tuple(passed[:EXPECT_MAX_NODES]), time.monotonic() + EXPECT_S
            )
        for code, k in out.codes.items():
            self.metrics.rejections.labels(code).inc(k)
        return filter_result(args, passed, dict(out.failed), dict(out.unresolvable))

    def _candidates(self, pod: PodRequest, names: list[str], now: datetime) -> Candidates:
        """The nodes the pod fits and why the others do not, from the placement answer of its
        shape (or, for a new shape within its budget, a sample of the nodes), with how `rank`
        chooses among them. View lock held."""
        self.learner.observe(pod)
        self.on_asked(pod)
        sampled = self._sampled(pod, names, now)
        if sampled is not None:
            return sampled
        st = self.placements.filter_answer(pod, names, now)
        self.cost.fitted += self.placements.last_fitted
        codes = {c: k for c, k in st.codes.items() if k}
        if names and codes.get("unknown-node") == len(st.name_set):
            shown = ", ".join(names[:5])
            raise WireError(f"none of the {len(names)} node(s) is known to gpupack: {shown}")
        if self.keep_best > 0 and not st.steered:
            # only the policy's best few of the nodes that pass are answered: which pass is
            # wanted as a set, not as a list in the request's order (~1,000 nodes a pod)
            verdict = Verdict(set(st.ok), dict(st.failed), dict(st.unresolvable), codes)
            return Candidates(verdict, {}, self._whole_best(pod, names, now))
        if st.passed is None:
            ok = st.ok
            st.passed = [n for n in names if n in ok]
        verdict = Verdict(list(st.passed), dict(st.failed), dict(st.unresolvable), codes)
        locked = self.view.locks.locked_nodes(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        steered = dict(st.steered)
        keep = self.keep_best
        if keep <= 0:
            return Candidates(verdict, steered, Ranking(busy=locked.get if locked else None))

        def best(pool: Collection[str], keep: int, busy: Busy | None, skipped: dict[str, str]) -> list[str]:
            return self.scorer.best(pod, names, pool, now, keep)

        # nodes held by other binds leave first, then the policy's best of the rest are kept
        return Candidates(verdict, steered, Ranking(busy=locked.get if locked else None), Ranking(keep, best))

    def _whole_best(self, pod: PodRequest, names: list[str], now: datetime) -> Ranking:
        """keep-best over a shape's whole answer: the policy's best `keep_best` of the nodes that
        pass, none held by another pod's bind or handoff while another passes. Only the nodes the
        ranking looks at are asked whether they are held (BindLocks.lock_check), so handoffs
        pending elsewhere in the cluster cost nothing here. View lock held."""
        busy_on = self.view.locks.lock_check(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)

        def best(pool: Collection[str], keep: int, busy: Busy | None, skipped: dict[str, str]) -> list[str]:
            kept = self.scorer.best(pod, names, pool, now, keep, busy, skipped)
            self.cost.scored += self.scorer.last_scored
            self.cost.stale_order = self.scorer.last_stale
            return kept

        return Ranking(self.keep_best, best, busy_on)

    def _sampled(self, pod: PodRequest, names: list[str], now: datetime) -> Candidates | None:
        """A new shape's candidates from the nodes looked at within the budget (sampling.py): with
        keep_best ranked by the sample's scores, else every passing node in the request's order
        (prioritize scores them); None for the whole answer. View lock held."""
        if self.sampler is None or self.placements.knows(shape_of(pod)):
            return None
        busy_on = self.view.locks.lock_check(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        sample = self.sampler.sample(pod, names, now, busy_on)
        self.cost.fitted += self.sampler.fitted
        self.cost.scored += self.sampler.scored
        if sample is None:
            return None
        self.cost.sampled = (sample.looked, len(names))
        codes = {c: k for c, k in sample.codes.items() if k}
        codes["not-sampled"] = len(names) - sample.looked
        failed, unresolvable = dict(sample.failed), dict(sample.unresolvable)
        if self.keep_best <= 0:
            verdict = Verdict([n for n in names if n in sample.ok], failed, unresolvable, codes)
            return Candidates(verdict, {}, Ranking(busy=busy_on), sampled=True)
        tie = self.scorer.ranked_ties()

        def best(pool: Collection[str], keep: int, busy: Busy | None, skipped: dict[str, str]) -> list[str]:
            return sample.best(tie, keep, busy, skipped)

        verdict = Verdict(sample.ok.keys(), failed, unresolvable, codes)
        return Candidates(verdict, {}, Ranking(self.keep_best, best, busy_on, always=True), sampled=True)

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
