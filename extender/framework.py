"""The scheduling steps behind the HTTP verbs, in the kube-scheduler framework's shape:
Filter (fit per node, reasons) -> Score (policy, 0..10) -> Reserve (assume in the view) ->
Bind (one Binding that carries the assignment: the pod's node and its GPUs in one write). With `keep_best` N, filter
scores the fitting nodes itself and passes only the policy's N best (ties as the simulator's
schedule() breaks them), so kube-scheduler's own scores cannot override the policy.

Filter results are cached per pod *shape* and node version (an equivalence cache): pods of one
Deployment share a shape, and only nodes whose state changed since are fitted again. Bind never
uses the cache; it fits again under the view's lock, so a cached answer can never over-commit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_FAILED,
    LABEL_MANAGED,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    Assignment,
    ContractError,
    GPUShare,
    Reservation,
)
from gpupack.core.fit import Fit, FitFailure
from gpupack.core.model import FULL, Node, Placement, PlacementError, PodRequest
from gpupack.core.policies import Policy
from gpupack.core.request import RequestError, parse_pod
from gpupack.events import EventRecorder
from gpupack.kubeclient import api_reason

from . import reservations as resv
from .answers import (
    FitCache,
    _BestIndex,
    _FilterAnswer,
    _MemoFailure,
    _normalise,
    _PriorityAnswer,
    _signature,
    shape_of,
    sorted_index,
)
from .collector import VerbActivity
from .kube import Kube, NamespaceUnreadable
from .lease import BindError, LeaseFence
from .metrics import Metrics
from .node_resources import HostedPodRequest, hosted, node_resources_fit
from .view import (
    ClusterView,
    NodeInfo,
    PodInfo,
    _init_names,
    pod_host_request,
    pod_slots,
)
from .wire import (
    BindArgs,
    ExtenderArgs,
    PodRequestError,
    WireError,
    bind_result,
    filter_result,
    unresolvable_result,
)

log = logging.getLogger("gpupack.extender")

# Learning batches (see Extender._observe): the first pod at once, then up to OBSERVE_WARMUP pods
# learned each batch OBSERVE_GROWTH times the pods learned so far (1, 3, 12, 48), and no sooner
# than OBSERVE_MIN_GAP_S after the last flush; after the warm-up a flush per OBSERVE_BATCH_MAX new
# pods, or per OBSERVE_FLUSH_S, whichever comes first.
OBSERVE_WARMUP = 64
OBSERVE_GROWTH = 3
OBSERVE_MIN_GAP_S = 1.0
OBSERVE_BATCH_MAX = 4096
OBSERVE_FLUSH_S = 60.0
POD_MEMORY = 4096  # filtered pods kept for their bind
# Prioritize expects the pod on its top-scored nodes when at most this many share the top score
# (more: kube-scheduler's random pick among them rarely repeats), until its bind arrives or for
# at most EXPECT_S.
EXPECT_MAX_NODES = 4
EXPECT_S = 2.0
STATE_IDS_MAX = 10_000  # node states numbered (Extender._state); ~1.2 KB each at 8 GPUs
BIND_BUSY = "gpupack extender: every bind slot stayed busy for the whole bind wait"
# Written on pods kube-scheduler may have parked while the extender was away: an update of the
# pod itself moves it from the scheduler's unschedulable pods back to its active queue.
ANN_REQUEUED = "gpupack.io/requeued-at"
# Written, with a Binding's resourceVersion as precondition, when that Binding got no answer: a
# late arrival of it then fails its precondition, so whether the pod is bound is known for good.
ANN_BIND_FENCED = "gpupack.io/bind-fenced"


def _busy(node: str, key: str) -> str:
    return f"node {node}: pod {key} is being bound there or waits for its kubelet (GPU handoff)"


def fit_error(node: str, f: FitFailure) -> BindError:
    """The bind's error for a pod that no longer fits `node`, naming the node once."""
    at = f"node {node}"
    return BindError(f.reason if f.reason.startswith(at) else f"{at}: {f.reason}", f"fit-{f.code}")


def utcnow() -> datetime:
    return datetime.now(UTC)


GPUPACK_RESOURCES = (RES_GPU, RES_GPU_MEM, RES_GPU_SM)


def requests_gpupack(pod: dict[str, Any]) -> bool:
    """Whether any container names a gpupack resource (the bind's cheap test for its GPU path; a
    CPU-only pod's bind waits for no handoff and writes no assignment)."""
    spec = pod.get("spec") or {}
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            res = (c.get("resources") or {}) if isinstance(c, dict) else {}
            for part in ("limits", "requests"):
                d = res.get(part) if isinstance(res, dict) else None
                if isinstance(d, dict) and any(r in d for r in GPUPACK_RESOURCES):
                    return True
    return False


def host_fit(node: Node, pod: PodRequest) -> Fit | FitFailure:
    """A CPU-only pod on a node without gpupack GPUs: CPU and memory only (the core's fit refuses
    GPU-less nodes, which only CPU-only pods may use)."""
    if not node.schedulable:
        return FitFailure(f"node {node.name} is cordoned", "unschedulable", True)
    if node.cpu_milli and pod.cpu_milli > node.cpu_milli:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; node has {node.cpu_milli}m", "cpu", True)
    if node.ram_mib and pod.ram_mib > node.ram_mib:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; node has {node.ram_mib} MiB", "ram", True)
    if node.cpu_milli and pod.cpu_milli > node.free_cpu:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; {node.free_cpu}m free", "cpu")
    if node.ram_mib and pod.ram_mib > node.free_ram:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; {node.free_ram} MiB free", "ram")
    return Fit(Placement(node.name, {}), {})


def _fit_on(f: Fit, node: str) -> Fit:
    """`f` (a fit on another node in the same state: the same GPUs) as a fit on `node`."""
    return Fit(Placement(node, f.placement.containers), f.charged)


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


class Extender:
    def __init__(
        self,
        view: ClusterView,
        policy: Policy,
        kube: Kube | None,
        metrics: Metrics | None = None,
        bind_wait_s: float = 4.0,
        stale_handoff_s: float = 120.0,
        clock: Callable[[], datetime] = utcnow,
        fence: LeaseFence | None = None,
        scheduler_name: str = "gpupack-scheduler",
        bind_concurrency: int = 0,
        keep_best: int = 0,
        events: EventRecorder | None = None,
        activity: VerbActivity | None = None,
    ) -> None:
        self.fence = fence
        # filter and prioritize tell it when they run; bind threads stand aside for them at
        # their next step (VerbActivity.wait_quiet: before the view's lock, the pod read and the
        # Lease reads; not between the Lease read and the Binding but for the fit under the lock)
        self.activity = activity or VerbActivity()
        # Events on pods for what their owners can act on and kube-scheduler cannot tell them
        # (a bind failure already reaches the pod as kube-scheduler's FailedScheduling event).
        self.events = events
        # Filter passes only this many of the fitting nodes, the policy's best first (0: all of
        # them, and kube-scheduler's own scores and random ties pick among them with prioritize's).
        self.keep_best = keep_best
        # Binds past their claim at most this many at a time (0: no limit): a burst of pods must
        # not become a burst of API calls the API server answers only after the API timeout (seen
        # at 1,000 nodes: 150 of 620 binds failed so with 128 at once). The rest wait their turn,
        # within the same bind wait as for a pending handoff.
        self._bind_slots = threading.BoundedSemaphore(bind_concurrency) if bind_concurrency > 0 else None
        # A bind's short sections under the view's lock on its way (claim, in-flight marks, fit
        # and assume, marking it bound) take a turn through this first (see _bind_view). The
        # Lease read that concurrent binds share wakes them all at once; each then queued on the
        # view's lock for its few lines, and a filter arriving behind 20 of them waited 7-22 ms
        # (1,000 nodes, 500-pod burst), on kube-scheduler's serial cycle. Now those sections
        # queue here, one bind at a time at the view's lock. Taken only outside the view's lock,
        # and never around a wait on it (the handoff wait and the rare failure paths take the
        # view's lock as before).
        self._bind_turn = threading.Lock()
        self.scheduler_name = scheduler_name
        self.view = view
        self.policy = policy
        self.kube = kube
        self.metrics = metrics or Metrics()
        self.bind_wait_s = bind_wait_s
        self.stale_handoff_s = stale_handoff_s
        self.clock = clock
        self.cache: FitCache[Fit | FitFailure] = FitCache()
        self._node_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._observed: OrderedDict[str, None] = OrderedDict()
        self._unobserved: list[PodRequest] = []
        self._observed_total = 0
        self._monotonic: Callable[[], float] = time.monotonic  # learning batches' clock (tests set it)
        self._last_flush = self._monotonic()
        self.epoch = 0  # bumped whenever the policy was shown new pods
        self.scores: FitCache[float | None] = (
            FitCache()
        )  # (shape, epoch) -> node -> (version, raw score | None)
        # The last filter answer per shape and prioritize answer per (shape, epoch), updated for
        # the nodes changed since (the view's journal) when the next request names the same nodes.
        self.filters: FitCache[Any] = FitCache()
        self.priorities: FitCache[Any] = FitCache()
        self.best: FitCache[Any] = FitCache()  # (shape, epoch) -> _BestIndex
        self._states: dict[str, tuple[int, int | None]] = {}
        self._last_names: tuple[list[str], set[str]] | None = None
        self._ranked: tuple[int, list[str]] = (-1, [])  # _tie_ranked
        self._state_ids: dict[tuple, int] = {}
        self._state_seq = itertools.count()
        # uid -> the Pod kube-scheduler sent with its last filter: the bind that follows uses it
        # instead of reading the pod again (the Binding's resourceVersion precondition still catches
        # any change since), one API round trip less per pod.
        self._pods: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._pods_lock = threading.Lock()

    # --- request parsing ---------------------------------------------------------------------
    def pod_request(self, pod: dict[str, Any]) -> HostedPodRequest:
        meta = pod.get("metadata") or {}
        ns = meta.get("namespace") or "default"
        # NamespaceUnreadable propagates: filter answers an Error (retried), never a guessed class
        ns_labels = self.kube.namespace_labels(ns) if self.kube is not None else {}
        try:
            req = parse_pod(pod, ns_labels)
        except (RequestError, ContractError) as e:
            raise PodRequestError(str(e)) from e
        req = hosted(req, pod_host_request(pod))
        if not req.needs_gpu:
            # CPU-only: the policy places it too (on a GPU node it may strand GPUs), by CPU/memory
            return req
        try:
            served_by_kubelet = handoff.gpu_containers(pod)
        except ContractError as e:
            raise PodRequestError(str(e)) from e
        if not served_by_kubelet:
            # The kubelet calls the device plugin only for the resource it registered
            # (gpupack.io/gpu): without it no Allocate ever comes, the handoff would stay pending
            # and block every later GPU pod on the node.
            raise PodRequestError(
                f"pod {req.key}: no container sets {RES_GPU} in its limits, so the kubelet would never "
                f"hand it a GPU; add {RES_GPU}: 1 next to gpu-mem/gpu-sm, or install gpupack's admission "
                "webhook, which adds it"
            )
        return req

    def _observe(self, pod: PodRequest) -> None:
        """Show the policy each new pod once, in batches. A learning policy's scores change with
        every pod it is shown; batching keeps them stable between flushes (an epoch), so scores
        of nodes that did not change can be reused. Each flush costs: the first filter (or
        prioritize) of every pod shape after it scores all its nodes again (~0.15 ms a node, so
        ~150 ms at 1,000 nodes, on kube-scheduler's serial cycle). The first pod is learned at
        once (with nothing learned the policy has no workload to score against); while the
        learned workload is small each batch is OBSERVE_GROWTH times what was learned so far, and
        flushes are at least OBSERVE_MIN_GAP_S apart, so a burst of pods at ~30 pods/s costs 3
        flushes instead of one per doubling (7). Later a workload's mix changes slowly, so a
        flush per minute (or per OBSERVE_BATCH_MAX pods) keeps up.

        "Exact" with learning on means: filter's best node is schedule()'s for the current view
        and the policy as of the last flush; pods seen since are not in the policy yet (the same
        lag as before, at most a batch or OBSERVE_MIN_GAP_S). Call with the view's lock held."""
        if not getattr(self.policy, "learn", False):
            # a given workload (--workload-file), or a policy that learns nothing (bestfit,
            # random): a flush would only make every shape score every node again for nothing
            return
        ident = pod.uid or pod.key
        if ident in self._observed:
            return
        self._observed[ident] = None
        if len(self._observed) > 10_000:
            self._observed.popitem(last=False)
        self._unobserved.append(pod)
        now = self._monotonic()
        total = self._observed_total
        since = now - self._last_flush
        if total == 0:
            due = True
        else:
            batch = total * OBSERVE_GROWTH if total < OBSERVE_WARMUP else OBSERVE_BATCH_MAX
            due = (len(self._unobserved) >= batch and since >= OBSERVE_MIN_GAP_S) or since > OBSERVE_FLUSH_S
        if due:
            for p in self._unobserved:
                self.policy.observe(p)
            self._observed_total += len(self._unobserved)
            self._unobserved.clear()
            self._last_flush = now
            self.epoch += 1

    # --- filter ----------------------------------------------------------------------------------
    def node_fit(
        self, name: str, pod: PodRequest, now: datetime, table: dict | None, memo: dict | None = None
    ) -> tuple[Fit | FitFailure, Reservation | None]:
        """Fit on one node, honouring defrag reservations. Call with the view's lock held."""
        info = self.view.nodes.get(name)
        node = self.view.state.nodes.get(name)
        if info is None or node is None:
            return FitFailure(
                f"node {name} is not in gpupack's view of the cluster (yet)", "unknown-node"
            ), None
        if self.view.track_host and isinstance(pod, HostedPodRequest):
            # kube-scheduler's NodeResourcesFit filter, off in the shipped profile (node_resources.py)
            short = node_resources_fit(info, pod.host)
            if short is not None:
                return short, None
        if not pod.needs_gpu:
            return self._host_only_fit(name, node, pod, now, table), None
        if info.inventory_error:
            return FitFailure(
                f"node {name}: its {('gpupack.io/inventory')} annotation is unreadable ({info.inventory_error})",
                "corrupt-inventory",
                True,
            ), None
        if info.slots <= 0:
            return FitFailure(
                f"node {name}: no {RES_GPU} slots allocatable (the gpupack device plugin is not registered "
                "with its kubelet, or has gone)",
                "no-slots",
            ), None
        need = pod.gpu_slots
        free = self.view.slots_free(name)
        if need > free:
            return FitFailure(
                f"node {name}: {need} {RES_GPU} slot(s) needed, {max(free, 0)} of {info.slots} free "
                "(the kubelet admits no more GPU containers)",
                "slots",
            ), None
        held = self.view.active_reservations(name, now)
        if not held:
            if table is not None:
                hit = table.get(name)
                if hit is not None and hit[0] == info.version:
                    f = hit[1]
                    if isinstance(f, Fit) and f.placement.node != name:
                        f = _fit_on(f, name)  # a node in the same state's (_fit_every_node)
                    return f, None
            r: Fit | FitFailure | None = None
            if memo is not None:
                # Nodes in the same state give the same answer (a fresh or evenly filled cluster).
                sig = self._state(name, info)
                hit_r = memo.get(sig)
                if isinstance(hit_r, Fit):
                    r = _fit_on(hit_r, name)
                elif hit_r is not None and hit_r.reason.find(hit_r.node) < 0:
                    r = hit_r.failure
            if r is None:
                r = self.policy.fit(node, pod)
                if memo is not None:
                    memo[sig] = r if isinstance(r, Fit) else _MemoFailure(r, name)
            if table is not None:
                table[name] = (info.version, r)
            return r, None
        last: Fit | FitFailure = FitFailure("no fit", "none")
        for cand, reservation in resv.candidates(node, held, pod, now, set()):
            r = self.policy.fit(cand, pod)
            if r:
                return r, reservation
            last = r
        if isinstance(last, FitFailure) and "reservation" not in last.reason:
            last = FitFailure(f"{last.reason} (with {len(held)} defrag reservation(s) held)", last.code)
        return last, None

    def _host_only_fit(
        self, name: str, node: Node, pod: PodRequest, now: datetime, table: dict | None
    ) -> Fit | FitFailure:
        """A CPU-only pod's fit: no slots, no handoff, no inventory needed (it never meets the device
        plugin). On a GPU node the policy's own fit, as the simulator's schedule() runs it; defrag
        reservations hold their GPUs there, but none steers it (it takes no GPU). View lock held."""
        info = self.view.nodes[name]
        held = self.view.active_reservations(name, now)
        if not held and table is not None:
            hit = table.get(name)
            if hit is not None and hit[0] == info.version:
                return hit[1]
        if not node.gpus:
            r = host_fit(node, pod)
        else:
            r = self.policy.fit(resv.hold(node, held) if held else node, pod)
        if not held and table is not None:
            table[name] = (info.version, r)
        return r

    def _todo(
        self, answers: FitCache, key: tuple, names: list[str], factory: Callable[[list[str]], Any]
    ) -> tuple[Any, Any]:
        """The last answer for `key` and the nodes it must look at again: those changed since (or
        holding reservations, whose answer depends on the time), and those not asked about last
        time; nodes no longer asked about are dropped from it. A fresh answer and every node when
        there is none, or the view's journal no longer reaches back to it. View lock held."""
        st = answers.data.get(key)
        added: set[str] = set()
        if st is not None and st.names != names:
            # kube-scheduler's list of the nodes that passed its own filters starts where its last
            # search stopped and is filled in parallel, so with percentageOfNodesToScore: 100 it is
            # the same set in a new order almost every time; and a node its own filters now refuse
            # (its CPU is taken, say) leaves it, without changing the answer for any other node.
            asked = self._name_set(names)
            if asked != st.name_set:
                for n in st.name_set - asked:
                    st.forget(n)
                added = asked - st.name_set
                st.name_set = set(asked)
            st.reorder(names)
        if st is not None:
            answers.data.move_to_end(key)
            changed = self.view.changed_since(st.pos)
            if changed is not None:
                todo = set(changed)
                todo.update(self.view.reserved)
                todo &= st.name_set
                todo |= added
                return st, todo
        st = factory(names)
        answers.data[key] = st
        while len(answers.data) > answers.shapes:
            answers.data.popitem(last=False)
        return st, names

    def _fit_every_node(
        self, st: _FilterAnswer, names: list[str], pod: PodRequest, now: datetime, table: dict
    ) -> None:
        """Fill a new answer (`st`, nothing in it yet): the first filter of a pod shape, so every
        asked node. node_fit's answer for each, with its work done once per node state (_state)
        instead of once per node: kube-scheduler waits for this filter, and with a few dozen
        states among 1,000 nodes the per-node cost is what is left (~5 ms a new shape at 1,000
        nodes through node_fit, ~27 ms at 5,000). A failure whose reason names its node is not
        handed on to another; a Fit is, in the fit table only (its placement names the state's
        first node; node_fit copies it for the node asked about). View lock held."""
        nodes = self.view.nodes
        states = self._states
        host = pod.host if self.view.track_host and isinstance(pod, HostedPodRequest) else None
        by_state: dict[int, Fit | _MemoFailure] = {}  # as node_fit's memo keeps them
        ok, failed, unresolvable = st.ok, st.failed, st.unresolvable
        code_of, codes = st.code_of, st.codes
        for n in names:
            info = nodes.get(n)
            if info is None or info.reservations:
                r, res = self.node_fit(n, pod, now, table)
                st.update(n, r, res)
                continue
            if host is not None:
                short = node_resources_fit(info, host)
                if short is not None:
                    st.update(n, short, None)
                    continue
            hit = table.get(n)
            if hit is not None and hit[0] == info.version:
                st.update(n, hit[1], None)
                continue
            sh = states.get(n)
            state = sh[1] if sh is not None and sh[0] == info.version else self._state(n, info)
            known = by_state.get(state) if state is not None else None
            if known is None or (known.__class__ is _MemoFailure and known.reason.find(known.node) >= 0):
                r, _ = self.node_fit(n, pod, now, table)
                if state is not None and known is None:
                    by_state[state] = r if isinstance(r, Fit) else _MemoFailure(r, n)
                st.update(n, r, None)
                continue
            if isinstance(known, Fit):
                r = known  # the table keeps the first node's Fit: node_fit hands out this node's
                ok.add(n)
            else:
                r = known.failure
                (unresolvable if r.unresolvable else failed)[n] = r.reason
                code_of[n] = r.code
                codes[r.code] += 1
            table[n] = (info.version, r)
        st.passed = None

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        try:
            pod = self.pod_request(args.pod)
        except PodRequestError as e:
            log.info("filter: %s", e)
            self.metrics.rejections.labels("invalid-request").inc(len(args.node_names))
            return unresolvable_result(args, f"gpupack cannot place this pod: {e}")
        except NamespaceUnreadable as e:
            log.warning("filter: %s", e)
            return filter_result(args, [], {}, {}, error=f"gpupack: {e}")
        self._clean_own_stale(args.pod)
        self._remember(args.pod)
        now = self.clock()
        names = args.node_names
        with self.view.lock:
            self._observe(pod)
            shape = shape_of(pod)
            table = self.cache.table(shape)
            st, todo = self._todo(self.filters, shape, names, _FilterAnswer)
            pos = self.view.seq
            nodes = self.view.nodes
            if todo is names and pod.needs_gpu:
                self._fit_every_node(st, names, pod, now, table)
            else:
                memo: dict = {}
                update = st.update
                for n in todo:
                    info = nodes.get(n)
                    res = None
                    if info is not None and not info.reservations:
                        hit = table.get(n)
                        r = hit[1] if hit is not None and hit[0] == info.version else None
                        if r is None:
                            r, res = self.node_fit(n, pod, now, table, memo)
                    else:
                        r, res = self.node_fit(n, pod, now, table, memo)
                    update(n, r, res)
            st.pos = pos
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
                steer: Reservation = st.steered[target]
                wanted = {n: st.steered[n] for n in steered}
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
        locked = self.view.locked_nodes(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        if cand is not None:
            passed = self._best_of(pod, names, cand, locked, failed, codes, now)
        elif locked and any(n in locked for n in passed):
            free = [n for n in passed if n not in locked]
            if free:
                # A bind there would wait for the kubelet to admit the other pod first; another
                # node that fits is better than a bind that waits and maybe fails into back-off.
                for n in passed:
                    if n in locked:
                        failed[n] = _busy(n, locked[n])
                        codes["handoff-pending"] = codes.get("handoff-pending", 0) + 1
                passed = free
        if cand is None and self.keep_best > 0 and len(passed) > self.keep_best:
            # The others are left out of the answer without a reason: kube-scheduler reads reasons
            # only when no node passes (and one always does here), and this one would only say that
            # another node was chosen. At 1,000 nodes that was ~50 KB of JSON per pod to write here
            # and to parse there, on the scheduler's serial cycle.
            kept = self._keep_best(pod, names, passed, now)
            codes["not-best"] = codes.get("not-best", 0) + len(passed) - len(kept)
            passed = kept
        if self.keep_best > 0 and passed and pod.uid:
            # kube-scheduler binds there (one node: it skips prioritize, whose expectation this is):
            # the next pod's filter may come before this pod's bind and must steer clear of it
            self.view.expect(pod.uid, pod.key, tuple(passed[:EXPECT_MAX_NODES]), time.monotonic() + EXPECT_S)
        for code, k in codes.items():
            self.metrics.rejections.labels(code).inc(k)
        return filter_result(args, passed, failed, unresolvable)

    def _best_of(
        self,
        pod: PodRequest,
        names: list[str],
        cand: set[str],
        locked: dict[str, str],
        failed: dict[str, str],
        codes: dict[str, int],
        now: datetime,
    ) -> list[str]:
        """filter's answer with keep_best from `cand`, the nodes that pass (no defrag steering):
        as filter would answer from them in the request's order, without that list. Nodes locked
        by another pod's bind or handoff are left out (with the reason) while another passes."""
        busy = [n for n in locked if n in cand]
        if busy and len(busy) < len(cand):
            for n in busy:
                failed[n] = _busy(n, locked[n])
            codes["handoff-pending"] = codes.get("handoff-pending", 0) + len(busy)
            cand.difference_update(busy)
        if len(cand) > self.keep_best:
            kept = self._keep_best(pod, names, cand, now)
            codes["not-best"] = codes.get("not-best", 0) + len(cand) - len(kept)
            return kept
        return [n for n in names if n in cand]

    def _name_set(self, names: list[str]) -> set[str]:
        """set(names), built once per request (filter asks two answers about the same list)."""
        last = self._last_names
        if last is not None and last[0] is names:
            return last[1]
        asked = set(names)
        self._last_names = (names, asked)
        return asked

    def _keep_best(
        self, pod: PodRequest, names: list[str], passed: Collection[str], now: datetime
    ) -> list[str]:
        """The `keep_best` nodes the policy prefers among those that pass (`passed`, out of the
        request's `names`). Order as
        :func:`gpupack.core.policies.schedule` picks: highest score, ties to the node first in the
        policy's seeded node order (ranked over every node of the view, in the order the view first
        saw them, as schedule() ranks its state's nodes). So for the same state, the node kept first
        is schedule()'s, and the bind's fit there its GPUs. The order of the request's nodes is kept
        per (shape, epoch) and only the nodes changed since the last request are scored again."""
        with self.view.lock:
            tie = self.policy.tie_key
            if not self.view.state.nodes.keys() <= tie.keys():
                self.policy.rank_nodes(self.view.state.nodes)
            idx, todo = self._todo(self.best, (shape_of(pod), self.epoch), names, _BestIndex)
            pos = self.view.seq
            todo = list(todo)
            scored = self._raw_scores(pod, todo, now)
            get = scored.get
            # a node whose fit changed since (no score) stays a candidate only after every scored one
            if idx.key_of:
                for n in todo:
                    idx.set(n, (get(n) is None, -(get(n) or 0.0), tie.get(n, 2.0)))
            else:
                idx.key_of = {n: (get(n) is None, -(get(n) or 0.0), tie.get(n, 2.0)) for n in todo}
                idx.order = sorted_index(idx.key_of, scored, self._tie_ranked())
            idx.pos = pos
            want = passed if isinstance(passed, set) else set(passed)
            keep: list[str] = []
            for _key, n in idx.order:
                if n in want:
                    keep.append(n)
                    if len(keep) == self.keep_best:
                        break
        return keep

    def _tie_ranked(self) -> list[str]:
        """Every node the policy has ranked, in its tie order (ties of that order by name). The
        ranking only ever grows, so its size says whether this list is still current."""
        tie = self.policy.tie_key
        if self._ranked[0] != len(tie):
            self._ranked = (len(tie), sorted(tie, key=lambda n: (tie[n], n)))
        return self._ranked[1]

    def _raw_scores(self, pod: PodRequest, names: list[str], now: datetime) -> dict[str, float]:
        """The policy's raw score of each node in `names` the pod fits (view lock held); cached per
        (shape, epoch) and node version like prioritize's."""
        shape = shape_of(pod)
        fits = self.cache.table(shape)
        table = self.scores.table((shape, self.epoch))
        nodes = self.view.nodes
        out: dict[str, float] = {}
        # Nodes in the same state fit and score the same (a fresh or evenly filled cluster, and after
        # the policy learned more pods, when every node is scored again), as in scores_for. Here
        # only the score is wanted, so a node in a state already scored in this call costs two
        # lookups: after a learning flush every node of every shape is scored again, ~1,000 nodes
        # on kube-scheduler's serial cycle, mostly in a few dozen states.
        memo: dict[tuple, float] = {}
        fit_memo: dict = {}
        by_state: dict[int, float | None] = {}
        for n in names:
            info = nodes.get(n)
            if info is None:
                continue
            if not info.reservations:
                hit = table.get(n)
                if hit is not None and hit[0] == info.version:
                    if hit[1] is not None:
                        out[n] = hit[1]
                    continue
                state = self._state(n, info)
                if state is not None:
                    if state in by_state:
                        score = by_state[state]
                        table[n] = (info.version, score)
                    else:
                        score = by_state[state] = self._raw_score(
                            n, info, pod, now, fits, table, fit_memo, memo
                        )[0]
                    if score is not None:
                        out[n] = score
                    continue
            score, _res = self._raw_score(n, info, pod, now, fits, table, fit_memo, memo)
            if score is not None:
                out[n] = score
        return out

    def _raw_score(
        self,
        n: str,
        info: NodeInfo,
        pod: PodRequest,
        now: datetime,
        fits: dict[str, tuple[int, Fit | FitFailure]],
        table: dict[str, tuple[int, float | None]],
        fit_memo: dict,
        memo: dict[tuple, float],
    ) -> tuple[float | None, Reservation | None]:
        """The policy's raw score of node `n` (None: the pod does not fit there), cached in `table`
        per node version unless the node holds defrag reservations (their answer depends on the
        time), and the reservation the fit would use. Nodes in the same state score the same
        (`memo`: a fresh or evenly filled cluster, common fill patterns). View lock held."""
        if not info.reservations:
            hit = table.get(n)
            if hit is not None and hit[0] == info.version:
                return hit[1], None
        r, res = self.node_fit(n, pod, now, fits, fit_memo)
        score = None
        if isinstance(r, Fit):
            node = self.view.state.nodes[n]
            sig = (self._state(n, info), tuple(sorted(r.charged.items())))
            score = memo.get(sig)
            if score is None:
                score = memo[sig] = self.policy.node_score(node, pod, r)
        if not info.reservations:
            table[n] = (info.version, score)
        return score, res

    # --- prioritize ------------------------------------------------------------------------------
    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        names, scores = self.scores_for(args)
        return [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]

    def scores_for(self, args: ExtenderArgs) -> tuple[list[str], list[int]]:
        """Prioritize's answer as (node names, scores 0..MAX_SCORE), in the request's order."""
        try:
            pod = self.pod_request(args.pod)
        except (PodRequestError, NamespaceUnreadable):
            # filter has already rejected every node with the reason; nothing here is better
            return args.node_names, [0] * len(args.node_names)
        now = self.clock()
        names = args.node_names
        with self.view.lock:
            self._observe(pod)
            shape = shape_of(pod)
            fits = self.cache.table(shape)
            key = (shape, self.epoch)
            # node -> (node version, raw score or None when the pod does not fit there)
            table = self.scores.table(key)
            st, todo = self._todo(self.priorities, key, names, _PriorityAnswer)
            pos = self.view.seq
            nodes = self.view.nodes
            raw, steered = st.raw, st.steered
            memo: dict[tuple, float] = {}
            fit_memo: dict = {}
            for n in todo:
                st.out = None
                steered.discard(n)
                raw.pop(n, None)
                info = nodes.get(n)
                if info is None:
                    continue
                score, res = self._raw_score(n, info, pod, now, fits, table, fit_memo, memo)
                if score is None:
                    continue
                if res is not None:
                    steered.add(n)  # the pod's own defrag reservation: it goes there
                else:
                    raw[n] = score
            st.pos = pos
            if st.out is None:
                st.out = _normalise(names, raw, steered)
            out = st.out
        locked = self.view.locked_nodes(pod.uid, time.monotonic(), handoffs=pod.needs_gpu)
        if locked:
            out = [0 if n in locked else v for n, v in zip(names, out, strict=True)]
        self._expect(pod, names, out)
        return names, out

    def _expect(self, pod: PodRequest, names: list[str], scores: list[int]) -> None:
        """Note where kube-scheduler will most likely bind `pod` (see ClusterView.expected): the
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
        self.view.expect(pod.uid, pod.key, tuple(best), time.monotonic() + EXPECT_S)

    def _state(self, name: str, info: NodeInfo) -> int | None:
        """A number for everything node_fit's answer on a node without reservations depends on,
        apart from the node's name: its signature, its free and allocatable slots, whether its
        inventory reads (None: a node gpupack does not know). Nodes with the same number fit and
        score the same. A number, not the tuple: hashing a node's signature (a tuple per GPU) is
        what a lookup by it costs, ~2 µs a node. Cached per node version, as every input is
        charged under one (a slot's use too). View lock held."""
        hit = self._states.get(name)
        if hit is not None and hit[0] == info.version:
            return hit[1]
        node = self.view.state.nodes.get(name)
        state = None
        if node is not None:
            key = (_signature(node), self.view.slots_free(name), info.slots, bool(info.inventory_error))
            state = self._state_ids.get(key)
            if state is None:
                if len(self._state_ids) >= STATE_IDS_MAX:
                    self._state_ids.clear()  # numbers are never reused: new ones from here on
                state = self._state_ids[key] = next(self._state_seq)
        self._states[name] = (info.version, state)
        return state

    # --- bind ------------------------------------------------------------------------------------
    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_guard:
            lock = self._node_locks.get(node)
            if lock is None:
                lock = self._node_locks[node] = threading.Lock()
            return lock

    def _wait_handoff(self, node: str, uid: str, deadline: float) -> None:
        with self.view.changed:
            while True:
                blocker = self.view.blocking_handoff(node, uid)
                if blocker is None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.view.changed.wait(min(left, 0.5))
        age = handoff.handoff_age_s(blocker, self.clock())
        if age is not None and age > self.stale_handoff_s:
            log.warning(
                "node %s: handoff of pod %s pending for %.0f s; is the device plugin running there?",
                node,
                blocker.key,
                age,
            )
            self.metrics.problems.labels("stale-handoff").inc()
        raise BindError(handoff.blocking_message(node, blocker), "handoff-wait")

    def _remember(self, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        # a pod with an assignment may just have been cleaned (its resourceVersion changed): read it
        if not uid or not meta.get("resourceVersion") or ANN_ASSIGNMENT in (meta.get("annotations") or {}):
            return
        with self._pods_lock:
            self._pods[uid] = pod
            self._pods.move_to_end(uid)
            while len(self._pods) > POD_MEMORY:
                self._pods.popitem(last=False)

    def _pod_for_bind(self, args: BindArgs) -> dict[str, Any]:
        """The pod as its last filter saw it when that is the pod being bound, else a fresh read."""
        with self._pods_lock:
            pod = self._pods.pop(args.pod_uid, None) if args.pod_uid else None
        meta = (pod or {}).get("metadata") or {}
        if (
            pod is None
            or meta.get("name") != args.pod_name
            or (meta.get("namespace") or "default") != args.pod_namespace
            or meta.get("deletionTimestamp")
            or (pod.get("spec") or {}).get("nodeName")
        ):
            return self._get_pod(args)
        return pod

    def _get_pod(self, args: BindArgs) -> dict[str, Any]:
        assert self.kube is not None
        try:
            self.activity.wait_quiet()
            pod = self.kube.get_pod(args.pod_namespace, args.pod_name)
        except ApiException as e:
            if e.status == 404:
                raise WireError(f"pod {args.key} not found", 404) from e
            raise BindError(f"could not read pod {args.key}: {api_reason(e)}", "api") from e
        uid = (pod.get("metadata") or {}).get("uid", "")
        if args.pod_uid and uid != args.pod_uid:
            raise BindError(
                f"pod {args.key} was recreated (UID {uid}; bind was for {args.pod_uid})", "pod-gone"
            )
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            raise BindError(f"pod {args.key} is being deleted", "pod-gone")
        return pod

    def bind(self, args: BindArgs) -> dict[str, str]:
        try:
            self._bind(args)
        except BindError as e:
            self.metrics.bind_failures.labels(e.reason).inc()
            log.info("bind %s -> %s failed: %s", args.key, args.node, e)
            return bind_result(str(e))
        self.metrics.binds.inc()
        return bind_result("")

    @contextlib.contextmanager
    def _bind_view(self) -> Iterator[None]:
        """The view's lock, for a bind thread: behind the other binds, not among them, and after
        the verb being answered."""
        self.activity.wait_quiet()
        with self._bind_turn, self.view.lock:
            yield

    def _bind(self, args: BindArgs) -> None:
        if self.kube is None:
            raise BindError("the extender runs without API access", "api")
        with self._bind_view():
            if args.node not in self.view.nodes:
                raise WireError(f"node {args.node} is not known to gpupack", 404)
            key = f"{args.pod_namespace}/{args.pod_name}"
            # Claimed before anything slow: the scheduler's next pod is filtered while this bind
            # reads the pod, and must already be steered elsewhere (or it would queue behind this
            # handoff).
            self.view.claim(args.node, key, args.pod_uid)
        deadline = time.monotonic() + self.bind_wait_s
        try:
            slots = self._bind_slots
            if slots is None:
                self._bind_claimed(args, key, deadline)
                return
            if not slots.acquire(timeout=self.bind_wait_s):
                raise BindError(f"{BIND_BUSY}; try again", "busy")
            try:
                self._bind_claimed(args, key, deadline)
            finally:
                slots.release()
        finally:
            with self._bind_view():
                self.view.unclaim(args.node, key)

    def _bind_claimed(self, args: BindArgs, key: str, deadline: float) -> None:
        assert self.kube is not None
        if self.fence is not None:
            self.activity.wait_quiet()
            self.fence.check(fresh=False)  # a standby's extender answers no bind at all
        # The pod before queueing: a missing pod is answered at once, not after the wait.
        # If it changes while we wait, the Binding's resourceVersion precondition catches it.
        pod = self._pod_for_bind(args)
        if not requests_gpupack(pod):
            self._bind_host_only(args, key, pod)
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
            req = self._request_to_bind(args, pod)
            if req is None:
                return
            with self._bind_view():
                self.view.inflight.add(key)
            self._reserve_and_bind(args, pod, req)
        finally:
            with self._bind_view():
                self.view.inflight.discard(key)
            lock.release()

    def _request_to_bind(self, args: BindArgs, pod: dict[str, Any]) -> HostedPodRequest | None:
        """The request of the pod to bind, or None when it is bound already (answered as such)."""
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound:
            self._already_bound(args, pod, bound)
            return None
        try:
            return self.pod_request(pod)
        except NamespaceUnreadable as e:
            raise BindError(f"gpupack: {e}", "api") from e

    def _bind_host_only(self, args: BindArgs, key: str, pod: dict[str, Any]) -> None:
        """Bind a CPU-only pod: fit its CPU/memory again under the view's lock, charge them on the
        node (the next filter sees them before the watch does), post the Binding under the Lease.
        No assignment, no handoff, no node lock: nothing of it waits for the kubelet."""
        assert self.kube is not None
        req = self._request_to_bind(args, pod)
        if req is None:
            return
        if req.needs_gpu:  # cannot be: requests_gpupack said no gpupack resource
            raise BindError(f"pod {key} requests gpupack GPU resources after all; try again", "conflict")
        with self._bind_view():
            f, _ = self.node_fit(args.node, req, self.clock(), None)
            if isinstance(f, FitFailure):
                raise fit_error(args.node, f)
            try:
                self.view.assume_host(key, req.uid, args.node, req.host)
            except PlacementError as e:
                raise BindError(f"node {args.node}: {e}", "conflict") from e
        why = self.fence.problem() if self.fence is not None else ""
        if why:
            self.view.unassume_host(key, req.uid)
            raise BindError(why, "not-leader")
        try:
            self.kube.bind(args.pod_namespace, args.pod_name, req.uid, args.node)
        except ApiException as e:
            if e.status == 409:
                try:
                    again = self.kube.get_pod(args.pod_namespace, args.pod_name)
                    if (again.get("spec") or {}).get("nodeName") == args.node:
                        self.view.host_bound(key, req.uid)
                        return  # our own earlier attempt went through
                except ApiException:
                    pass
            self.view.unassume_host(key, req.uid)
            why = f"Binding pod {key} to node {args.node} failed: {api_reason(e)}"
            raise BindError(why, "binding") from e
        self.view.host_bound(key, req.uid)

    def _already_bound(self, args: BindArgs, pod: dict[str, Any], bound: str) -> None:
        """A retried bind whose first attempt went through is a success; anything else is not."""
        raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_ASSIGNMENT)
        if bound == args.node and (raw or not requests_gpupack(pod)):
            return
        raise BindError(f"pod {args.key} is already bound to node {bound}", "already-bound")

    def _assume_fit(self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest) -> Assignment:
        """Fit the pod on the node again under the view's lock and hold the assignment (the next
        filter sees it before any watch does); BindError when it no longer fits."""
        with self._bind_view():
            now = self.clock()
            f, reservation = self.node_fit(args.node, req, now, None)
            if isinstance(f, FitFailure):
                raise fit_error(args.node, f)
            a = assignment_from_fit(
                self.view.state.nodes[args.node],
                req,
                f,
                now,
                reservation.id if reservation else "",
                self.view.nodes[args.node].gpu_indexes,
            )
            try:
                self.view.assume(req.key, req.uid, a, _init_names(pod), pod_slots(pod), req.host)
            except PlacementError as e:
                raise BindError(f"node {args.node}: {e}", "conflict") from e
        return a

    def _reserve_and_bind(self, args: BindArgs, pod: dict[str, Any], req: HostedPodRequest) -> None:
        """Assume the assignment and post ONE Binding that carries it: the API server sets the pod's
        node and copies the Binding's annotations onto it in the same write, with the pod's uid and
        resourceVersion as preconditions. A pod is never bound without its assignment, nor holds
        one while unbound, and a Binding that failed left nothing to roll back. On 409 (the pod
        changed since it was read) the pod is read again and fitted again."""
        assert self.kube is not None
        self._settle_before_rebind(args, req)
        for _attempt in range(5):
            pod = self._without_stale_record(args, pod)
            if self.fence is not None:
                # read afresh right before the write: a scheduler that shuts down releases its
                # Lease at once (ReleaseOnCancel), so a read even 1 s old may name a holder no more
                self.activity.wait_quiet()
                self.fence.check()
            a = self._assume_fit(args, pod, req)
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
                with self._bind_view():
                    self.view.mark_bound(req.key, args.node)
                return
            except ApiException as e:
                err = e
            again = self._binding_outcome(args, req, a, rv, err)
            if again is None:
                return  # it went through after all
            pod = again
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                self._already_bound(args, pod, bound)
                return
        raise BindError(f"pod {req.key} kept changing while it was being bound (409 x5)", "conflict")

    def _binding_outcome(
        self, args: BindArgs, req: PodRequest, a: Assignment, rv: str, err: ApiException
    ) -> dict[str, Any] | None:
        """After a Binding that answered `err`: None when it took effect after all (an answer lost on
        the way back); the pod as it is now when it is bound (by an earlier attempt, or another
        writer) or when it changed (409: try again); otherwise BindError. The assumption is taken
        back unless the Binding took effect. A refusal (4xx but 409/429) changed nothing. With no
        answer (429, 5xx, timeouts) the Binding may yet land: a PATCH with its resourceVersion as
        precondition first makes any late arrival fail; if even that cannot be done, the assignment
        stays held (see `settle_doubtful`)."""
        assert self.kube is not None
        why = f"Binding pod {req.key} to node {args.node} failed: {api_reason(err)}"
        conflict = err.status == 409
        if 400 <= (err.status or 0) < 500 and not conflict and err.status != 429:
            self.view.unassume(req.key, req.uid, a)
            if err.status == 404:
                raise WireError(f"pod {args.key} not found", 404) from err
            raise BindError(why, "binding") from err
        try:
            pod = self._settle(args.pod_namespace, args.pod_name, req.uid, rv, fence=not conflict)
        except ApiException as e2:
            if conflict:  # refused: it never took effect
                self.view.unassume(req.key, req.uid, a)
                raise BindError(f"{why}; cannot read the pod again: {api_reason(e2)}", "binding") from err
            self.view.hold_doubtful(req.key, req.uid, rv)
            raise BindError(f"{why}; its outcome is not known yet ({api_reason(e2)})", "binding") from err
        pod = self._judge_settled(args, req, a, pod, why)
        if pod is None or conflict or (pod.get("spec") or {}).get("nodeName"):
            return pod
        raise BindError(why, "binding") from err

    def _settle(self, ns: str, name: str, uid: str, rv: str, fence: bool) -> dict[str, Any] | None:
        """The pod after a Binding posted with precondition `rv`, such that this Binding can no
        longer take effect later (None: the pod is gone, or replaced by another of the same name).
        `fence`: the Binding's fate is unknown (no answer), so first change the pod's
        resourceVersion under the same precondition; a 409 then means the pod changed anyway."""
        assert self.kube is not None
        if fence and rv:
            try:
                return self.kube.patch_pod_metadata(
                    ns, name, {ANN_BIND_FENCED: handoff.rfc3339(self.clock())}, {}, rv
                )
            except ApiException as e:
                if e.status == 404:
                    return None
                if e.status != 409:
                    raise
        try:
            pod = self.kube.get_pod(ns, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        if fence and not rv and not (pod.get("spec") or {}).get("nodeName"):
            raise ApiException(status=504, reason="no resourceVersion to fence the Binding with")
        return pod if (pod.get("metadata") or {}).get("uid") == uid else None

    def _judge_settled(
        self, args: BindArgs, req: PodRequest, a: Assignment, pod: dict[str, Any] | None, why: str
    ) -> dict[str, Any] | None:
        """What `_binding_outcome` makes of the pod as `_settle` found it."""
        if pod is None:
            self.view.unassume(req.key, req.uid, a)
            raise BindError(f"{why}; pod {req.key} is gone", "pod-gone")
        meta = pod.get("metadata") or {}
        bound = (pod.get("spec") or {}).get("nodeName")
        raw = (meta.get("annotations") or {}).get(ANN_ASSIGNMENT)
        if bound == args.node and raw == a.to_json():
            self.view.mark_bound(req.key, args.node)
            return None
        self.view.unassume(req.key, req.uid, a)
        if bound and raw:
            # bound by an earlier attempt of this pod's bind (the assume above replaced that one's
            # charge): charge what the pod really holds now, not only once the watch shows it
            self.view.apply_pod(pod)
        return pod

    def settle_doubtful(self) -> int:
        """Resolve assignments held for Bindings whose outcome was unknown (the janitor, each pass):
        keep the charge of a pod bound with it, release the others. The number resolved."""
        n = 0
        for key, uid, rv in self.view.doubtful_items():
            try:
                self._settle_doubt(key, uid, rv)
            except ApiException as e:
                log.info("pod %s: outcome of its Binding still unknown: %s", key, api_reason(e))
                continue
            n += 1
        return n

    def _settle_doubt(self, key: str, uid: str, rv: str) -> None:
        ns, name = key.split("/", 1)
        self.view.resolve_doubtful(key, uid, self._settle(ns, name, uid, rv, fence=True))

    def _settle_before_rebind(self, args: BindArgs, req: PodRequest) -> None:
        """A pod whose earlier Binding's outcome is unknown is settled before it is bound again:
        otherwise that Binding could still land after this bind gave up, with no GPU charged."""
        with self.view.lock:
            doubt = self.view.doubtful.get(req.key)
        if doubt is None or doubt[0] != req.uid:
            return
        try:
            self._settle_doubt(req.key, doubt[0], doubt[1])
        except ApiException as e:
            raise BindError(
                f"pod {req.key}: the outcome of its earlier Binding is still unknown ({api_reason(e)})",
                "binding",
            ) from e

    def _without_stale_record(self, args: BindArgs, pod: dict[str, Any]) -> dict[str, Any]:
        """A Binding can add annotations, not remove them: a pod that still carries an assignment or
        allocation record (from an extender before the one-write bind, or a tool) is cleaned
        first, with its resourceVersion as precondition, and the pod as it is then returned."""
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        if (ANN_ASSIGNMENT not in ann and ANN_ALLOCATED not in ann) or (pod.get("spec") or {}).get(
            "nodeName"
        ):
            return pod  # nothing old on it, or bound already (the Binding's 409 says so)
        meta = pod.get("metadata") or {}
        self.clean_unbound(args.key, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""))
        again = self._get_pod(args)
        if (again.get("spec") or {}).get("nodeName"):
            return again
        left = (again.get("metadata") or {}).get("annotations") or {}
        if ANN_ASSIGNMENT in left or ANN_ALLOCATED in left:
            raise BindError(
                f"pod {args.key} carries an old GPU assignment that could not be removed", "conflict"
            )
        return again

    # --- stale state: whoever finds it cleans it -------------------------------------------------
    def _clean_own_stale(self, pod: dict[str, Any]) -> None:
        """The pod being filtered still carries an assignment from a bind that never posted its
        Binding (failed Binding and failed rollback, or an extender killed between the two): it
        must not count against the pod itself now, so it goes first."""
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if ANN_ASSIGNMENT not in ann or (pod.get("spec") or {}).get("nodeName") or self.kube is None:
            return
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        with self.view.lock:
            if key in self.view.inflight:
                return
        if self.fence is not None and self.fence.problem():
            return
        self.clean_unbound(key, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""))

    def clean_unbound(self, key: str, uid: str, rv: str) -> bool:
        """Remove the assignment of a pod that has none of a node, with a resourceVersion
        precondition (what was judged stale is what is cleaned); True when it was removed."""
        assert self.kube is not None
        ns, name = key.split("/", 1)
        for _attempt in range(2):
            try:
                self.kube.patch_pod_metadata(
                    ns, name, handoff.rollback_annotations(), {LABEL_MANAGED: None}, rv
                )
                self.view.forget(key, uid)
                self.metrics.problems.labels("stale-assignment-cleaned").inc()
                log.warning("pod %s: removed a GPU assignment left without a Binding (pod unbound)", key)
                return True
            except ApiException as e:
                if e.status == 404:
                    return False
                if e.status != 409:
                    log.warning("pod %s: cannot remove its stale GPU assignment: %s", key, api_reason(e))
                    return False
            try:  # 409: look again; clean only if it is still an unbound pod with an assignment
                pod = self.kube.get_pod(ns, name)
            except ApiException:
                return False
            meta = pod.get("metadata") or {}
            if (
                (pod.get("spec") or {}).get("nodeName")
                or ANN_ASSIGNMENT not in (meta.get("annotations") or {})
                or (uid and meta.get("uid") != uid)
            ):
                return False
            rv = str(meta.get("resourceVersion") or "")
        return False

    def sweep(self) -> dict[str, int]:
        """One janitor pass (the leader's extender, every few seconds): assignments held for
        Bindings that got no answer are settled (see `settle_doubtful`), and a handoff pending on a
        bound pod for longer than `stale_handoff_s` is reported and marked failed, so its node
        takes GPU pods again (if that kubelet admits the pod after all, Allocate refuses it: no GPU
        is handed out twice). Returns what it did."""
        done = {"settled": 0, "failed": 0}
        if self.kube is None or not self.view.synced.is_set():
            return done
        if self.fence is not None and self.fence.problem():
            return done
        done["settled"] = self.settle_doubtful()
        now = self.clock()
        for p in self.view.pending_bound():
            age = handoff.handoff_age_s(p.pod_view(), now)
            if age is None or age <= self.stale_handoff_s:
                continue
            done["failed"] += self._fail_stale_handoff(p, age)
        return done

    def _fail_stale_handoff(self, p: PodInfo, age: float) -> bool:
        assert self.kube is not None
        ns, name = p.key.split("/", 1)
        log.warning(
            "node %s: GPU handoff of pod %s pending for %.0f s (limit %.0f s); marking it failed so the node "
            "takes GPU pods again. Is gpupack's device plugin running there?",
            p.node,
            p.key,
            age,
            self.stale_handoff_s,
        )
        self.metrics.problems.labels("stale-handoff").inc()
        try:
            self.kube.patch_pod_metadata(
                ns, name, {ANN_HANDOFF: HANDOFF_FAILED}, {}, p.resource_version or None
            )
        except ApiException as e:
            log.warning("pod %s: cannot mark its stale handoff failed: %s", p.key, api_reason(e))
            return False
        self.metrics.problems.labels("stale-handoff-resolved").inc()
        if self.events is not None:
            self.events.pod(
                ns, name, p.uid, "GPUHandoffFailed",
                f"node {p.node}: the kubelet did not ask gpupack's device plugin for this pod's GPUs within "
                f"{self.stale_handoff_s:.0f} s, so gpupack gave the handoff up and the node takes GPU pods "
                "again. Check the gpupack-device-plugin pod on that node; delete this pod to place it anew.",
                warning=True,
            )  # fmt: skip
        return True

    def requeue_waiting(
        self, parked_only: bool = False, limit: int = 0, touched_since: str = ""
    ) -> tuple[int, int]:
        """Touch the pods kube-scheduler has not bound yet: an update of the pod itself moves it
        from the scheduler's unschedulable pods back to its active queue, for that pod alone.

        Once after this extender (re)started, every such pod that failed an attempt: attempts that
        hit the extender while it was away parked them, and a v1.28 scheduler retries those only on a cluster event or its
        5-minute flush. For the Requeuer (`parked_only`), only the pods the scheduler marked
        Unschedulable, at most `limit` of them (0: all), those not touched since `touched_since`
        (an RFC 3339 stamp of this clock) first and no others. Returns (touched, left over)."""
        if self.kube is None:
            return 0, 0
        if self.fence is not None and self.fence.problem():
            return 0, 0
        stamp = handoff.rfc3339(self.clock())
        try:
            pods = self.kube.unscheduled_pods(self.scheduler_name, cached=parked_only)
        except ApiException as e:
            log.warning("cannot list the pods waiting for %s: %s", self.scheduler_name, api_reason(e))
            return 0, 0
        todo = [p for p in pods if _waiting(p, parked_only)]
        if touched_since:
            todo = [p for p in todo if _requeued_at(p) < touched_since]
        todo.sort(key=_requeued_at)  # the longest untouched first, so capped passes take turns
        left = max(0, len(todo) - limit) if limit > 0 else 0
        n = 0
        for pod in todo[: len(todo) - left]:
            meta = pod.get("metadata") or {}
            try:
                self.kube.patch_pod_metadata(
                    meta.get("namespace") or "default",
                    meta["name"],
                    {ANN_REQUEUED: stamp},
                    {},
                    str(meta.get("resourceVersion") or "") or None,
                )
                n += 1
            except ApiException as e:
                if e.status not in (404, 409):  # gone, or updated anyway (which requeues it too)
                    log.warning(
                        "cannot requeue pod %s/%s: %s", meta.get("namespace"), meta.get("name"), api_reason(e)
                    )
        if n:
            log.info("asked kube-scheduler to retry %d waiting pod(s) now", n)
        return n, left


def _requeued_at(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_REQUEUED) or "")


def _waiting(pod: dict[str, Any], parked_only: bool) -> bool:
    """Unbound, not being deleted, Pending, and an attempt of the scheduler's failed (PodScheduled
    False; with `parked_only`, reason Unschedulable: the pods it parks until a cluster event). A pod
    not tried yet is in the scheduler's active queue already: touching it would only make its bind
    read it again (its resourceVersion changed since its filter)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or (pod.get("spec") or {}).get("nodeName"):
        return False
    if status.get("phase") not in ("Pending", None):
        return False
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and (not parked_only or c.get("reason") == "Unschedulable")
        for c in status.get("conditions") or []
        if isinstance(c, dict)
    )
