"""The bind verb: claim the node, wait for its pending GPU handoff, fit again under the view's
lock, and post ONE Binding that carries the assignment, under the scheduler's Lease."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.contract import ANN_ASSIGNMENT, Assignment, GPUShare
from gpupack.core.fit import Fit, FitFailure
from gpupack.core.model import FULL, Node, PlacementError, PodRequest
from gpupack.kubeclient import api_reason

from ..api.kube import Kube, NamespaceUnreadable
from ..api.lease import BindError, LeaseFence
from ..api.wire import BindArgs, PodRequestError, WireError, bind_result
from ..state.metrics import Metrics
from ..state.node_resources import HostedPodRequest
from ..state.placement_index import PlacementIndex
from ..state.records import init_names, pod_slots
from ..state.view import ClusterView
from .bind_pods import PodMemory, read_pod
from .collector import VerbActivity
from .config import ExtenderConfig
from .pod_requests import pod_request, requests_gpupack
from .settling import Settler
from .stale import StaleCleaner

log = logging.getLogger("gpupack.extender")

BIND_BUSY = "gpupack extender: every bind slot stayed busy for the whole bind wait"


def fit_error(node: str, f: FitFailure) -> BindError:
    """The bind's error for a pod that no longer fits `node`, naming the node once."""
    at = f"node {node}"
    return BindError(f.reason if f.reason.startswith(at) else f"{at}: {f.reason}", f"fit-{f.code}")


def assignment_from_fit(
    node: Node,
    pod: PodRequest,
    f: Fit,
    now: datetime,
    reservation: str = "",
    device_index: list[int] | None = None,
) -> Assignment:
    by_name = {}
    for cname, shares in f.placement.containers.items():
        out = []
        for s in shares:
            g = node.gpus[s.gpu_index]
            out.append(
                GPUShare(
                    uuid=g.uuid,
                    index=device_index[s.gpu_index] if device_index else g.index,
                    mem_mib=g.mem_mib if s.exclusive else s.mem_mib,
                    sm_pct=100 if s.exclusive else -(-s.milli * 100 // FULL),
                    exclusive=s.exclusive,
                )
            )
        by_name[cname] = tuple(out)
    order = [c.name for c in (*pod.init_containers, *pod.containers)]
    containers = {c: by_name[c] for c in order if c in by_name}
    return Assignment(
        pod_uid=pod.uid,
        node=node.name,
        pod_class=pod.pod_class,
        containers=containers,
        bound_at=handoff.rfc3339(now),
        reservation=reservation,
    )


class _Held:
    """The assignment a bind holds in the view from its arrival (see Binder._hold), and whether it
    was handed on to the Binding; one not handed on is released when the bind ends."""

    __slots__ = ("a", "handed_on")

    def __init__(self) -> None:
        self.a: Assignment | None = None
        self.handed_on = False


class _BindTurn:
    """The view's lock taken by a bind: after the verb being answered (VerbActivity.wait_quiet),
    then in turn behind the other binds."""

    __slots__ = ("binder",)

    def __init__(self, binder: Binder) -> None:
        self.binder = binder

    def __enter__(self) -> None:
        b = self.binder
        b.activity.wait_quiet()
        b._turn.acquire()
        try:
            b.view.lock.acquire()
        except BaseException:
            b._turn.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self.binder.view.lock.release()
        self.binder._turn.release()


class Binder:
    def __init__(
        self,
        view: ClusterView,
        kube: Kube | None,
        placements: PlacementIndex,
        config: ExtenderConfig,
        metrics: Metrics,
        clock: Callable[[], datetime],
        fence: LeaseFence | None,
        activity: VerbActivity,
        settler: Settler,
        cleaner: StaleCleaner,
    ) -> None:
        self.view = view
        self.kube = kube
        self.placements = placements
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.fence = fence
        # filter and prioritize tell it when they run; bind threads stand aside for them at
        # their next step (VerbActivity.wait_quiet: before the view's lock, the pod read and the
        # Lease reads; not between the Lease read and the Binding but for the fit under the lock)
        self.activity = activity
        self.settler = settler
        self.cleaner = cleaner
        self.pods = PodMemory()
        # Binds past their claim at most this many at a time (0: no limit): a burst of pods must
        # not become a burst of API calls the API server answers only after the API timeout (seen
        # at 1,000 nodes: 150 of 620 binds failed so with 128 at once). The rest wait their turn,
        # within the same bind wait as for a pending handoff.
        n = config.bind_concurrency
        self._slots = threading.BoundedSemaphore(n) if n > 0 else None
        # A bind's short sections under the view's lock on its way (claim, in-flight marks, fit
        # and assume, marking it bound) take a turn through this first (see _view). The Lease
        # read that concurrent binds share wakes them all at once; each then queued on the view's
        # lock for its few lines, and a filter arriving behind 20 of them waited 7-22 ms (1,000
        # nodes, 500-pod burst), on kube-scheduler's serial cycle. Now those sections queue here,
        # one bind at a time at the view's lock. Taken only outside the view's lock, and never
        # around a wait on it (the handoff wait and the rare failure paths take the view's lock as
        # before).
        self._turn = threading.Lock()
        self._node_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def bind(self, args: BindArgs) -> dict[str, str]:
        try:
            self._bind(args)
        except BindError as e:
            self.metrics.bind_failures.labels(e.reason).inc()
            log.info("bind %s -> %s failed (%s): %s", args.key, args.node, e.reason, e)
            return bind_result(str(e))
        self.metrics.binds.inc()
        return bind_result("")

    def _view(self) -> _BindTurn:
        """The view's lock, for a bind thread: behind the other binds, not among them, and after
        the verb being answered."""
        return _BindTurn(self)

    def node_locks(self) -> list[str]:
        """The nodes a bind lock is kept for: every node a GPU pod was bound to since the start
        (nodes are the operator's, not a tenant's; a lock is not dropped with its node, as a bind
        may hold it still)."""
        with self._locks_guard:
            return list(self._node_locks)

    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_guard:
            lock = self._node_locks.get(node)
            if lock is None:
                lock = self._node_locks[node] = threading.Lock()
            return lock

    def _bind(self, args: BindArgs) -> None:
        if self.kube is None:
            raise BindError("the extender runs without API access", "api")
        pod, parsed = self.pods.recall(args)
        early = self._early_request(pod, parsed)
        held = _Held()
        with self._view():
            if args.node not in self.view.nodes:
                raise WireError(f"node {args.node} is not known to gpupack", 404)
            key = f"{args.pod_namespace}/{args.pod_name}"
            # Claimed before anything slow: the scheduler's next pod is filtered while this bind
            # reads the pod, and must already be steered elsewhere (or it would queue behind this
            # handoff).
            self.view.locks.claim(args.node, key, args.pod_uid)
            if early is not None:
                held.a = self._hold(args, early, pod)
                if held.a is not None:
                    self.view.locks.settle_claim(key)
        deadline = time.monotonic() + self.config.bind_wait_s
        try:
            slots = self._slots
            if slots is None:
                self._bind_claimed(args, key, deadline, pod, parsed, held)
                return
            if not slots.acquire(timeout=self.config.bind_wait_s):
                raise BindError(f"{BIND_BUSY}; try again", "busy")
            try:
                self._bind_claimed(args, key, deadline, pod, parsed, held)
            finally:
                slots.release()
        finally:
            with self._view():
                if held.a is not None and not held.handed_on:
                    self.view.unassume(key, args.pod_uid, held.a)
                self.view.locks.unclaim(args.node, key)

    def _early_request(
        self, pod: dict[str, Any] | None, parsed: HostedPodRequest | None
    ) -> HostedPodRequest | None:
        """The request of a GPU pod its filter sent (no API read: the pod is in memory; `parsed`:
        its request as the filter parsed it), to hold its room at the claim; None when there is
        none, or it cannot be had without waiting."""
        if pod is None or self.kube is None or not requests_gpupack(pod):
            return None
        if self.fence is not None and self.fence.problem(fresh=False):
            return None  # a standby holds nothing; the bind refuses below, with the reason
        req = parsed
        if req is None:
            try:
                req = pod_request(pod, self.kube)
            except (PodRequestError, NamespaceUnreadable):
                return None
        return req if req.needs_gpu else None

    def _hold(self, args: BindArgs, req: HostedPodRequest, pod: dict[str, Any] | None) -> Assignment | None:
        """Fit the pod on the node and hold the assignment in the view from the bind's arrival on
        (view lock held), before it queues for the node: a filter answered meanwhile fits the next
        pods next to it, so the bind never refuses a fit that filter passed. Without it, binds
        queued behind a node's pending handoff were each fitted only once their turn came, and the
        pods filtered meanwhile fitted against a node without them (6-11 binds failed so after an
        extender restart, when kube-scheduler retried every parked pod at once). Not held (None):
        a pod with a record in the view already (a re-bind, a Binding of unknown outcome), one
        that does not fit (the bind's own fit says why), or one not remembered from its filter."""
        if pod is None or req.key in self.view.pods or req.key in self.view.locks.doubtful:
            return None
        try:
            a = self._fit_assume(args, pod, req, inflight=False)
        except PlacementError:
            return None
        return a if isinstance(a, Assignment) else None

    def _fit_assume(
        self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest, inflight: bool = True
    ) -> Assignment | FitFailure:
        """The pod fitted on the node now and its assignment assumed in the view (view lock held);
        the fit's failure when it does not fit. PlacementError when the view refuses it."""
        now = self.clock()
        f, reservation = self.placements.node_fit(args.node, req, now, None)
        if isinstance(f, FitFailure):
            return f
        a = assignment_from_fit(
            self.view.state.nodes[args.node],
            req,
            f,
            now,
            reservation.id if reservation else "",
            self.view.nodes[args.node].gpu_indexes,
        )
        self.view.assume(req.key, req.uid, a, init_names(pod), pod_slots(pod), req.host, inflight=inflight)
        return a

    def _bind_claimed(
        self,
        args: BindArgs,
        key: str,
        deadline: float,
        remembered: dict[str, Any] | None,
        parsed: HostedPodRequest | None,
        held: _Held,
    ) -> None:
        assert self.kube is not None
        if self.fence is not None:
            self.activity.wait_quiet()
            self.fence.check(fresh=False)  # a standby's extender answers no bind at all
        # The pod before queueing: a missing pod is answered at once, not after the wait.
        # If it changes while we wait, the Binding's resourceVersion precondition catches it.
        pod = remembered or read_pod(self.kube, self.activity, args)
        if pod is not remembered:
            parsed = None  # read now: parsed below
        if not requests_gpupack(pod):
            self._bind_host_only(args, key, pod, parsed)
            return
        lock = self._node_lock(args.node)
        t0 = time.monotonic()
        if not lock.acquire(timeout=max(0.0, deadline - t0)):
            self.metrics.bind_wait.observe(time.monotonic() - t0)
            raise BindError(f"node {args.node}: too many binds queued; try again", "node-busy")
        try:
            try:
                self._wait_handoff(args.node, args.pod_uid, deadline)
            finally:
                self.metrics.bind_wait.observe(time.monotonic() - t0)
            req = self._request_to_bind(args, pod, parsed)
            if req is None:
                return
            with self._view():
                self.view.locks.inflight.add(key)
            self._reserve_and_bind(args, pod, req, held)
        finally:
            with self._view():
                self.view.locks.inflight.discard(key)
            lock.release()

    def _wait_handoff(self, node: str, uid: str, deadline: float) -> None:
        with self.view.changed:
            while True:
                blocker = self.view.locks.blocking_handoff(node, uid)
                if blocker is None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.view.changed.wait(min(left, 0.5))
        age = handoff.handoff_age_s(blocker, self.clock())
        if age is not None and age > self.config.stale_handoff_s:
            log.warning(
                "node %s: handoff of pod %s pending for %.0f s; is the device plugin running there?",
                node,
                blocker.key,
                age,
            )
            self.metrics.problems.labels("stale-handoff").inc()
        raise BindError(handoff.blocking_message(node, blocker), "handoff-wait")

    def _request_to_bind(
        self, args: BindArgs, pod: dict[str, Any], parsed: HostedPodRequest | None = None
    ) -> HostedPodRequest | None:
        """The request of the pod to bind (`parsed`: as the filter parsed this pod), or None when
        it is bound already (answered as such)."""
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound:
            self._already_bound(args, pod, bound)
            return None
        if parsed is not None:
            return parsed
        try:
            return pod_request(pod, self.kube)
        except NamespaceUnreadable as e:
            raise BindError(f"gpupack: {e}", "api") from e

    def _bind_host_only(
        self, args: BindArgs, key: str, pod: dict[str, Any], parsed: HostedPodRequest | None = None
    ) -> None:
        """Bind a CPU-only pod: fit its CPU/memory again under the view's lock, charge them on the
        node (the next filter sees them before the watch does), post the Binding under the Lease.
        No assignment, no handoff, no node lock: nothing of it waits for the kubelet."""
        assert self.kube is not None
        req = self._request_to_bind(args, pod, parsed)
        if req is None:
            return
        if req.needs_gpu:  # cannot be: requests_gpupack said no gpupack resource
            raise BindError(f"pod {key} requests gpupack GPU resources after all; try again", "conflict")
        with self._view():
            f, _ = self.placements.node_fit(args.node, req, self.clock(), None)
            if isinstance(f, FitFailure):
                raise fit_error(args.node, f)
            try:
                self.view.host.assume(key, req.uid, args.node, req.host)
            except PlacementError as e:
                raise BindError(f"node {args.node}: {e}", "conflict") from e
            self.view.locks.settle_claim(key)
        why = self.fence.problem() if self.fence is not None else ""
        if why:
            self.view.host.unassume(key, req.uid)
            raise BindError(why, "not-leader")
        try:
            self.kube.bind(args.pod_namespace, args.pod_name, req.uid, args.node)
        except ApiException as e:
            if e.status == 409:
                try:
                    again = self.kube.get_pod(args.pod_namespace, args.pod_name)
                    if (again.get("spec") or {}).get("nodeName") == args.node:
                        self.view.host.bound(key, req.uid)
                        return  # our own earlier attempt went through
                except ApiException:
                    pass
            self.view.host.unassume(key, req.uid)
            why = f"Binding pod {key} to node {args.node} failed: {api_reason(e)}"
            raise BindError(why, "binding") from e
        self.view.host.bound(key, req.uid)

    def _already_bound(self, args: BindArgs, pod: dict[str, Any], bound: str) -> None:
        """A retried bind whose first attempt went through is a success; anything else is not."""
        raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_ASSIGNMENT)
        if bound == args.node and (raw or not requests_gpupack(pod)):
            return
        raise BindError(f"pod {args.key} is already bound to node {bound}", "already-bound")

    def _held_or_fit(
        self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest, held: _Held | None
    ) -> Assignment:
        """The assignment held since the bind's arrival while the view still charges it (handed on
        to the Binding), else a fresh fit (see _assume_fit)."""
        if held is not None and held.a is not None and not held.handed_on:
            held.handed_on = True
            with self._view():
                p = self.view.pods.get(req.key)
                if p is not None and p.uid == req.uid and p.assumed and p.assignment_raw == held.a.to_json():
                    return held.a
        return self._assume_fit(args, pod, req)

    def _assume_fit(self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest) -> Assignment:
        """Fit the pod on the node again under the view's lock and hold the assignment (the next
        filter sees it before any watch does); BindError when it no longer fits."""
        with self._view():
            try:
                a = self._fit_assume(args, pod, req)
            except PlacementError as e:
                raise BindError(f"node {args.node}: {e}", "conflict") from e
            if isinstance(a, FitFailure):
                raise fit_error(args.node, a)
            self.view.locks.settle_claim(req.key)
        return a

    def _reserve_and_bind(
        self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest, held: _Held | None = None
    ) -> None:
        """Assume the assignment and post ONE Binding that carries it: the API server sets the pod's
        node and copies the Binding's annotations onto it in the same write, with the pod's uid and
        resourceVersion as preconditions. A pod is never bound without its assignment, nor holds
        one while unbound, and a Binding that failed left nothing to roll back. On 409 (the pod
        changed since it was read) the pod is read again and fitted again. `held`: the assignment
        held at the bind's arrival (see _hold), written by the first attempt; from here on the
        outcome of the Binding decides what becomes of it, as of one assumed here."""
        assert self.kube is not None
        self.settler.before_rebind(req)
        for _attempt in range(5):
            pod = self.cleaner.without_stale_record(args, pod)
            if self.fence is not None:
                # read afresh right before the write: a scheduler that shuts down releases its
                # Lease at once (ReleaseOnCancel), so a read even 1 s old may name a holder no more
                self.activity.wait_quiet()
                self.fence.check()
            a = self._held_or_fit(args, pod, req, held)
            rv = str((pod.get("metadata") or {}).get("resourceVersion") or "")
            try:
                self.kube.bind(
                    args.pod_namespace,
                    args.pod_name,
                    req.uid,
                    args.node,
                    handoff.binding_annotations(a),
                    rv or None,
                )
                with self._view():
                    self.view.mark_bound(req.key, args.node)
                return
            except ApiException as e:
                err = e
            again = self.settler.outcome(args, req, a, rv, err)
            if again is None:
                return  # it went through after all
            pod = again
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                self._already_bound(args, pod, bound)
                return
        raise BindError(f"pod {req.key} kept changing while it was being bound (409 x5)", "conflict")
