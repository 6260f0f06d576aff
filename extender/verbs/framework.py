"""The extender: the scheduling steps behind the HTTP verbs, in the kube-scheduler framework's
shape, wired from one part per responsibility:

- filter (`filtering.Filter`): fit per node with reasons (the placement index,
  `state.placement_index.PlacementIndex`), and with keep_best N only the policy's N best
  (`scoring.Scorer.best`), so kube-scheduler's own scores cannot override the policy; a new pod
  shape's from the nodes fitted within a time budget (`sampling.NewShapeSampler`);
- prioritize (`scoring.Scorer`): the policy's scores, 0..10;
- bind (`binding.Binder`): fit again under the view's lock, assume, and post one Binding that
  carries the assignment (`settling` for Bindings that got no answer, `stale` for assignments
  left on unbound pods);
- learning (`learning.Learner`): shows a learning policy the pods it is asked about, in batches;
- warming (`warming.ShapeWarmer`): pod shapes' answers computed off kube-scheduler's cycle, for
  pods waiting to be scheduled and after the policy learnt;
- upkeep (`upkeep.Upkeep`): the janitor's and the requeuer's passes.

Filter and prioritize answers are cached per pod shape and node version (`placement_index`):
only nodes whose state changed since are fitted again. Bind never uses those caches, so a cached
answer can never over-commit.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpupack.core.policies import Policy
from gpupack.events import EventRecorder

from ..api.kube import Kube, NamespaceUnreadable
from ..api.lease import LeaseFence
from ..api.wire import BindArgs, ExtenderArgs, PodRequestError
from ..state.metrics import Metrics
from ..state.node_resources import HostedPodRequest
from ..state.placement_index import PlacementIndex
from ..state.view import ClusterView
from ..state.view_upkeep import view_sizes
from .binding import Binder
from .collector import VerbActivity
from .config import ExtenderConfig
from .filtering import Filter
from .learning import Learner
from .pod_requests import pod_request
from .sampling import NewShapeSampler
from .scoring import Scorer
from .settling import Settler
from .stale import StaleCleaner
from .upkeep import Upkeep
from .warming import ShapeWarmer


def utcnow() -> datetime:
    return datetime.now(UTC)


class Extender:
    """The verbs (filter, prioritize, bind) and the upkeep passes over one cluster view."""

    def __init__(
        self,
        view: ClusterView,
        policy: Policy,
        kube: Kube | None = None,
        config: ExtenderConfig | None = None,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], datetime] = utcnow,
        fence: LeaseFence | None = None,
        events: EventRecorder | None = None,
        activity: VerbActivity | None = None,
    ) -> None:
        self.config = config = config or ExtenderConfig()
        self.view = view
        self.policy = policy
        self.kube = kube
        self.metrics = metrics = metrics or Metrics()
        self.clock = clock
        self.activity = activity = activity or VerbActivity()
        self.learner = Learner(policy)
        self.placements = PlacementIndex(view, policy)
        self.scorer = Scorer(view, policy, self.placements, self.learner)
        settler = Settler(view, kube, clock)
        self.cleaner = StaleCleaner(view, kube, fence, metrics, activity)
        self.binder = Binder(
            view, kube, self.placements, config, metrics, clock, fence, activity, settler, self.cleaner
        )
        self.filtering = Filter(
            view,
            kube,
            self.placements,
            self.scorer,
            self.learner,
            metrics,
            clock,
            config.keep_best,
            self._filtered,
            self.activity,
        )
        if config.new_shape_budget_s > 0:
            self.filtering.sampler = NewShapeSampler(
                view, self.placements, self.scorer, config.new_shape_budget_s, scored=config.keep_best > 0
            )
        self.upkeep = Upkeep(view, kube, config, metrics, clock, fence, events, settler)
        # idle until started (main.py): tests drive it with drain()
        self.warmer = ShapeWarmer(view, self.filtering, self.scorer, self.activity, metrics, clock)
        self.warmer.on_gone = self._pending_gone
        metrics.attach_extender(self)

    def _pending_gone(self, uid: str) -> None:
        # a pod kube-scheduler asked about is bound or deleted: what was kept for its bind goes
        self.binder.pods.forget(uid)
        with self.view.lock:
            self.view.locks.forget_pod(uid)
            self.learner.batcher.forget(uid)  # learnt once already; it is not asked about again

    def tracked_sizes(self) -> dict[str, int]:
        """How many entries every map, set and queue this extender keeps holds, by name: the
        view's (view_upkeep.view_sizes) and its caches'. Those kept per pod fall back when the
        pods go; those kept per pod shape are capped (placement_index.CACHE_SHAPES, the learnt mix's
        gpupack.core.workload.LEARNT_SHAPES_MAX). The `gpupack_extender_tracked_entries` gauge."""
        out = view_sizes(self.view)
        with self.view.lock:
            out.update(self.placements.tracked_sizes())
            out.update(self.scorer.tracked_sizes())
            out.update(self.learner.tracked_sizes())
        out.update(self.warmer.tracked_sizes())
        out["binder.pods"] = len(self.binder.pods)
        out["binder.node_locks"] = len(self.binder.node_locks())
        if self.kube is not None:
            out.update(self.kube.tracked_sizes())
        return out

    def _filtered(self, pod: dict[str, Any], request: HostedPodRequest) -> None:
        # a stale assignment of its own must not count against the pod; the bind that follows
        # works from the pod as filter saw it, and from the request filter parsed from it
        self.cleaner.clean_own_stale(pod)
        self.binder.pods.remember(pod, request)

    def pod_request(self, pod: dict[str, Any]) -> HostedPodRequest:
        return pod_request(pod, self.kube)

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        return self.filtering.filter(args)

    def scores_for(self, args: ExtenderArgs) -> tuple[list[str], list[int]]:
        """Prioritize's answer as (node names, scores 0..MAX_SCORE), in the request's order."""
        try:
            pod = self.pod_request(args.pod)
        except (PodRequestError, NamespaceUnreadable):
            # filter has already rejected every node with the reason; nothing here is better
            return args.node_names, [0] * len(args.node_names)
        return args.node_names, self.scorer.prioritize(pod, args.node_names, self.clock())

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        names, scores = self.scores_for(args)
        return [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]

    def bind(self, args: BindArgs) -> dict[str, str]:
        return self.binder.bind(args)

    def sweep(self) -> dict[str, int]:
        return self.upkeep.sweep()

    def requeue_waiting(
        self, parked_only: bool = False, limit: int = 0, touched_since: str = ""
    ) -> tuple[int, int]:
        return self.upkeep.requeue_waiting(parked_only, limit, touched_since)
