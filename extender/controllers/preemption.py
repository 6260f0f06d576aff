"""GPU-aware preemption: the leader's preemption controller.

kube-scheduler's own preemption asks its filters which pods to evict; they do not see GPU shares,
so with gpupack's profile it never finds a victim ("expected at least one victim pod"), for GPU
shares nor (NodeResourcesFit's filter being off) for CPU, memory or pod slots. This thread does it
instead, every `interval_s`, for the pods of gpupack's scheduler that kube-scheduler marked
Unschedulable. Here the decisions of a pass; what they do in Kubernetes is preempt_actions.py:

1. the victims are chosen by `gpupack.core.preemption.choose` over the view's nodes (defrag and
   preemption reservations held), with the running pods' priorities and PodDisruptionBudgets;
2. a reservation (owner kind `Pod`, the preemptor's name) is written on the node first, so that
   no other pod takes the room the victims leave; the preemptor is steered there;
3. the preemptor gets its record (`gpupack.io/preemption`) and `status.nominatedNodeName`, then
   each victim is evicted through the Eviction API (its own grace period); Events name both;
4. while a preemptor's victims are terminating it triggers nothing new; once they are gone it is
   asked to retry; when it is bound, or deleted, or bound elsewhere, the reservation goes.

All of that state is in Kubernetes (the reservation on the Node, the record on the pod), so a
new leader carries on where the last one stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from gpupack import handoff
from gpupack.contract import GPUShare, Reservation
from gpupack.core.model import FULL, Node
from gpupack.core.pod_filters import AFFINITY
from gpupack.core.preemption import Choice, Preemptor, Victim, choose, without
from gpupack.events import EventRecorder
from gpupack.kubeclient import ApiException, KubeClient, api_reason

from ..api.kube import NamespaceUnreadable
from ..api.lease import LeaseFence
from ..state import preempt_inputs as pin
from ..state import reservations as resv
from ..state.hostuse import NO_HOST_USE
from ..state.node_resources import HostedPodRequest
from ..verbs.framework import Extender
from . import preempt_feasibility as pf
from . import preempt_snapshot as snap
from .preempt_actions import Plan, PreemptionActions, in_parallel
from .preempt_backoff import ANN_BACKOFF, Backoffs, delay_s, next_backoff
from .preempt_feasibility import PodsInPlace

log = logging.getLogger("gpupack.extender.preemption")
# Nodes a preemptor's chosen victims are refused on (its other filters) before the pass gives up
# on it: each retry asks the chooser again, and the nodes left are most likely refused alike.
MAX_REFUSED = 16


class Preempter:
    """The controller; `run_once` is one pass (tests call it directly)."""

    def __init__(
        self,
        ext: Extender,
        kc: KubeClient,
        events: EventRecorder | None,
        fence: LeaseFence | None,
        interval_s: float = 2.0,
        hold_s: float = 120.0,
        marks: pin.Unschedulable | None = None,
    ) -> None:
        assert ext.kube is not None
        self.ext, self.view, self.kube, self.kc = ext, ext.view, ext.kube, kc
        self.events, self.fence = events, fence
        self.interval_s, self.hold_s = interval_s, hold_s
        self.act = PreemptionActions(ext, kc, events)
        self.metrics = self.act.metrics
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        # the pending-pod watch's: while it shows no waiting pod marked Unschedulable and this
        # controller holds no room, a pass reads nothing (None: every pass lists the waiting pods)
        self.marks = marks
        self.skipped = 0  # passes that found nothing to read
        self.backoffs = Backoffs()  # preemptors whose hold ran out unbound (also on the pod)

    # --- the thread ---------------------------------------------------------------------------
    def start(self) -> Preempter:
        self.thread = threading.Thread(target=self.run, name="preempter", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> bool:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout_s)
        return self.thread is None or not self.thread.is_alive()

    def run(self) -> None:
        while not self.view.synced.wait(0.5):
            if self.stop.is_set():
                return
        while not self.stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:
                log.exception("preemption pass failed")

    # --- one pass -----------------------------------------------------------------------------
    def run_once(self) -> dict[str, int]:
        done = {
            "evicted": 0,
            "waiting": 0,
            "released": 0,
            "no-room": 0,
            "infeasible": 0,
            "backoff": 0,
            "error": 0,
        }
        if not self.view.synced.is_set() or (self.fence is not None and self.fence.problem()):
            return done
        now, started = self.ext.clock(), time.monotonic()
        own = snap.own_reservations(self.view, now)
        if not own and self.marks is not None and self.marks.none():
            self.skipped += 1
            self.act.forget(set())  # no pod marked, no hold: no retry to ask for, nothing said
            return done
        unbound = self.kube.unscheduled_pods(self.ext.config.scheduler_name, cached=True)
        # what is kept per pod lives as long as the pod waits
        live = {pin.uid_of(p) for p in unbound}
        self.act.forget(live)
        self.backoffs.prune(live)
        pending = [p for p in unbound if pin.unschedulable(p)]
        wanting = [(p, req) for p in pending if (req := self._request(p)) is not None]
        if not wanting and not own:
            return done
        running = self.kube.list_pods().get("items") or []
        by_key = {pin.key_of(p): p for p in running}
        # every unbound pod, not only those marked Unschedulable right now: a preemptor that
        # kube-scheduler is trying again (after its victims left) keeps its hold
        unbound_by_key = {
            pin.key_of(p): p for p in unbound if not (p.get("metadata") or {}).get("deletionTimestamp")
        }
        done["released"] = self.act.release(own, unbound_by_key, by_key, now)
        # the victims of every hold and live record: on their way out, never picked again, and
        # their room counted as the holder's (whether or not kube-scheduler is retrying it now)
        taken: set[str] = {k for rs in own.values() for r in rs for k in r.evicted_pod.split(",") if k}
        held_for = {f"{r.namespace}/{r.owner_name}" for rs in own.values() for r in rs}
        waits = []
        for p in unbound_by_key.values():
            rec = pin.record_of(p)
            if rec is None:
                continue
            if any(r.id == rec.reservation for r in own.get(rec.node, [])):
                taken.update(v.rsplit(":", 1)[0] for v in rec.victims)
                waits.append((p, rec))
            elif (
                pin.key_of(p) not in by_key and pin.key_of(p) not in held_for and self._hold_ran_out(rec, now)
            ):
                done["backoff"] += self._isolated(p, partial(self._back_off, p, rec, now))
        waiting = {pin.key_of(p) for p, _ in waits}
        todo = []
        for p, req in wanting:
            key = pin.key_of(p)
            if key in waiting or key in held_for:
                # decided already (a hold whose record is not seen yet: the pending list comes
                # from the API server's cache, a moment old): never planned again
                continue
            if not pin.may_preempt(p):
                self.metrics.preemptions.labels("never").inc()
            elif self.backoffs.until(pin.uid_of(p), p, now) is None:
                todo.append((p, req))
        # a burst leaves many preemptors waiting at once, each maybe with an API call to make
        # (a nomination written again, an eviction retried, a retry asked for)
        done["waiting"] = sum(
            in_parallel(
                lambda w: self._isolated(w[0], lambda: self.act.wait_victims(w[0], w[1], by_key)), waits
            )
        )
        if not todo:
            return done
        pdbs = self.kc.list_all(self.kc.policy.list_pod_disruption_budget_for_all_namespaces)
        allowed = pin.budget_allows(pdbs)
        track = self.view.track_host
        nodes, gpu_nodes, constraints, classes, host, room, leaving = snap.pass_nodes(
            self.view, now, taken, running
        )
        pool = pin.victims_of(running, classes, pdbs, taken, host_only=track)
        pool = {
            k: replace(v, cpu_milli=host[k][0], ram_mib=host[k][1]) if k in host else v
            for k, v in pool.items()
        }
        todo.sort(
            key=lambda t: (
                -pin.priority_of(t[0]),
                (t[0].get("metadata") or {}).get("creationTimestamp") or "",
            )
        )
        place = PodsInPlace(running, snap.node_facts(self.view), self._ns_labels)
        pass_ = _Pass(nodes, gpu_nodes, constraints, room, leaving, pool, allowed, by_key, place, now)
        for p, req in todo:
            outcome = self._isolated(p, partial(self._plan, p, req, pass_), error=-1)
            if outcome == -1:
                done["error"] += 1
            elif outcome == 1:
                done["no-room"] += 1
            elif outcome == 2:
                done["infeasible"] += 1
        done["evicted"] = self.act.carry_out(pass_.plans, by_key, now)
        log.log(
            logging.INFO if pass_.plans else logging.DEBUG,
            "preemption pass: %d pending, %d waiting for victims, %d decided (%d victims), %d without room, "
            "%d refused, %d failed, %.1f s",
            len(pending), len(waits), len(pass_.plans), done["evicted"], done["no-room"], done["infeasible"],
            done["error"], time.monotonic() - started,
        )  # fmt: skip
        return done

    def _isolated(self, pod: dict[str, Any], fn: Callable[[], int], error: int = 0) -> int:
        """fn(), its failure kept to `pod`: logged once (per kind of failure) with its reason, an
        Event on the pod, counted (outcome "error"); the pass goes on for the others."""
        try:
            return fn()
        except Exception as e:
            self.metrics.preemptions.labels("error").inc()
            self.act.report(
                pod, f"error: {type(e).__name__}", "PreemptionFailed",
                f"gpupack's preemption for this pod failed ({type(e).__name__}: {e}); other pods are not affected",
                exc=e,
            )  # fmt: skip
            return error

    def _plan(self, p: dict[str, Any], req: Any, ps: _Pass) -> int:
        """One preemptor's decision, added to the pass's plans; 0 when decided (or it fits), 1 when
        no eviction makes room, 2 when it would not run where victims leave room."""
        why_not = pf.scheduler_refuses(p)
        if why_not is not None:
            return self._refused(p, why_not)
        pre = Preemptor(req, pin.priority_of(p), True)
        allowed = [
            n
            for name, n in ps.nodes.items()
            if (name in ps.gpu_nodes or not req.needs_gpu)
            and pin.node_allows(p, name, n.labels, ps.constraints[name])
        ]
        reachable = ps.place.reachable(p) if allowed else None
        cands = [n for n in allowed if reachable is not None and reachable(n.name)]
        refused: dict[str, str] = {}
        while True:
            choice = choose(
                cands, pre, ps.pool, ps.allowed, pod_room=ps.room, memo=ps.memo, admit=self.ext.policy.refuses
            )
            if choice is None:
                break
            why = ps.place.refusal(p, choice.node, choice.victims) or self._resources_short(pre, choice)
            if why is None:
                break
            refused[choice.node] = why
            if len(refused) >= MAX_REFUSED:
                choice = None
                break
            cands = [n for n in cands if n.name != choice.node]
        if choice is None:
            if refused:
                return self._refused(p, "; ".join(f"node {n}: {w}" for n, w in sorted(refused.items())[:4]))
            if allowed and not cands:
                return self._refused(
                    p, f"no node where it may run meets its required pod affinity ({AFFINITY})"
                )
            self.metrics.preemptions.labels("no-room").inc()
            return 1
        try:
            return self._decided(p, pre, choice, ps)
        except Exception:
            # whatever failed may be a victim's doing: the others do not pick it in this pass
            for k in choice.victims:
                ps.pool.pop(k, None)
            raise

    def _decided(self, p: dict[str, Any], pre: Preemptor, choice: Choice, ps: _Pass) -> int:
        """`choice` counted in the pass (its hold and plan added, its victims taken)."""
        nodes, room, leaving, pool = ps.nodes, ps.room, ps.leaving, ps.pool
        if not choice.victims:
            # room that is there, or will be once the pods on their way out are gone: counted
            # as this pod's for the rest of the pass, so no other preemptor counts it again
            self.metrics.preemptions.labels("fits").inc()
            if choice.node in room:
                room[choice.node] -= 1
            if choice.node in leaving and not snap.fits_now(
                self.view, choice.node, pre, ps.now, self.ext.policy.refuses
            ):
                # only once they are gone (another preemptor's victims): held for it as for
                # its own, so no lower-priority pod takes it meanwhile
                r = self._reservation(p, pre, choice, nodes[choice.node], ps.by_key, ps.now)
                ps.plans.append(Plan(p, pre, choice, r, {}))
                nodes[choice.node] = resv.hold(nodes[choice.node], [r])
            else:
                nodes[choice.node] = _charged(nodes[choice.node], pre, choice)
            return 0
        r = self._reservation(p, pre, choice, nodes[choice.node], ps.by_key, ps.now)
        ps.plans.append(Plan(p, pre, choice, r, {k: pool[k] for k in choice.victims}))
        for k in choice.victims:  # never picked again in this pass; their room is held
            for b in pool[k].budgets:
                ps.allowed[b] = ps.allowed.get(b, 0) - 1
        # the hold counts its GPUs and host room for the rest of the pass
        nodes[choice.node] = resv.hold(without(nodes[choice.node], choice.victims, pool), [r])
        for k in choice.victims:
            pool.pop(k, None)
        if choice.node in room:
            room[choice.node] += len(choice.victims) - 1
        leaving.add(choice.node)  # its victims leave: room the next preemptor may share
        return 0

    def _refused(self, p: dict[str, Any], why: str) -> int:
        """No eviction for `p`: it would not run where victims leave room (said once per pod)."""
        self.metrics.preemptions.labels("infeasible").inc()
        self.act.report(
            p, "infeasible", "NotPreempting",
            f"gpupack will not preempt for this pod: evicting pods would not let it run ({why})"[:1000],
        )  # fmt: skip
        return 2

    def _hold_ran_out(self, rec: pin.Record, now: datetime) -> bool:
        """The record's hold is gone with its pod unbound, at least `hold_s` after the evictions:
        it ran out (a hold removed sooner, with its node, is no failure of the pod)."""
        at = handoff.parse_rfc3339(rec.at)
        return at is not None and (now - at).total_seconds() >= self.hold_s

    def _back_off(self, p: dict[str, Any], rec: pin.Record, now: datetime) -> int:
        """A hold ran out with `p` unbound: no new evictions for it for a while (1 when this is
        news: a hold not counted before)."""
        uid = pin.uid_of(p)
        b = next_backoff(self.backoffs.current(uid, p), rec.reservation, now)
        if b is None:
            return 0
        self.backoffs.note(uid, b)
        self.metrics.preemptions.labels("backoff").inc()
        meta = p.get("metadata") or {}
        try:
            self.kube.patch_pod_metadata(
                meta.get("namespace") or "default", str(meta.get("name")), {ANN_BACKOFF: b.encode()}, {}, None
            )
        except ApiException as e:
            log.info("pod %s: cannot record its preemption back-off: %s", pin.key_of(p), api_reason(e))
        self.act.report(
            p, f"backoff: {rec.reservation}", "PreemptionBackoff",
            f"the room gpupack held for this pod on node {rec.node} ({len(rec.victims)} pod(s) evicted for it) "
            f"ran out before it was bound there: no evictions for it for {delay_s(b.failures):.0f} s "
            f"(back-off {b.failures})",
        )  # fmt: skip
        return 1

    def _ns_labels(self, ns: str) -> dict[str, str] | None:
        try:
            return self.kube.namespace_labels(ns)
        except NamespaceUnreadable:
            return None

    def _resources_short(self, pre: Preemptor, choice: Choice) -> str | None:
        """The node resources the chooser does not weigh, with the victims gone (host tracking)."""
        want = pre.pod.host if isinstance(pre.pod, HostedPodRequest) else NO_HOST_USE
        if not self.view.track_host or (want.eph_bytes <= 0 and not want.other):
            return None
        with self.view.lock:
            info = self.view.nodes.get(choice.node)
            if info is None:
                return "the node is gone"
            freed = [hp.use for k in choice.victims if (hp := self.view.host.pods.get(k)) is not None]
            return pf.resources_short(want, info.allocatable, info.requested, freed)

    def _request(self, pod: dict[str, Any]) -> Any:
        try:
            req = self.ext.pod_request(pod)
        except Exception:  # a bad pod: its filter answers say why
            return None
        # a pod needing no GPU waits for CPU, memory or a pod slot: those are counted only with
        # the view's host tracking (kube-scheduler's NodeResourcesFit filter off)
        return req if req.needs_gpu or self.view.track_host else None

    def _reservation(
        self,
        pod: dict[str, Any],
        pre: Preemptor,
        choice: Choice,
        node: Node,
        by_key: dict[str, dict[str, Any]],
        now: datetime,
    ) -> Reservation:
        """The hold for `pre`'s room on the chosen node: its GPU shares and host room, until its
        victims' longest grace period and `hold_s` have passed."""
        meta = pod.get("metadata") or {}
        ns, name, uid = meta.get("namespace") or "default", str(meta.get("name")), pin.uid_of(pod)
        grace = max((pin.grace_s(by_key[k]) for k in choice.victims), default=30)
        expires = now + timedelta(seconds=grace + self.hold_s)
        host = pre.pod.host if self.view.track_host and isinstance(pre.pod, HostedPodRequest) else NO_HOST_USE
        shares = []
        for i, (mem, milli, ex) in sorted(choice.fit.charged.items()):
            g = node.gpus[i]
            shares.append(
                GPUShare(g.uuid, i, g.mem_mib if ex else mem, 100 if ex else -(-milli * 100 // FULL), ex)
            )
        return Reservation(
            id=f"{pin.PREEMPT_PREFIX}{uid[:18]}-{int(time.time())}",
            namespace=ns,
            owner_kind="Pod",
            owner_name=name,
            pod_class=pre.pod.pod_class,
            containers={"preemptor": tuple(shares)} if shares else {},  # a CPU-only pod holds no GPU
            expires=handoff.rfc3339(expires),
            evicted_pod=",".join(choice.victims)[:1000],
            # its host room too, from every other pod (with host tracking; extender/state/placement_index.py)
            host_cpu_milli=host.cpu_milli,
            host_mem_bytes=host.mem_bytes,
            host_pods=1 if self.view.track_host else 0,
        )


@dataclass
class _Pass:
    """What one pass's decisions share and change as they are made."""

    nodes: dict[str, Node]
    gpu_nodes: set[str]
    constraints: dict[str, frozenset[tuple[str, str, str]]]
    room: dict[str, int]
    leaving: set[str]
    pool: dict[str, Victim]
    allowed: dict[str, int]
    by_key: dict[str, dict[str, Any]]
    place: PodsInPlace
    now: datetime
    plans: list[Plan] = field(default_factory=list)
    memo: dict[Any, Any] = field(
        default_factory=dict
    )  # preemptors of one shape ask the same of unchanged nodes


def _charged(node: Node, pre: Preemptor, choice: Choice) -> Node:
    """A copy of `node` with the preemptor counted on it for the rest of the pass: its GPUs and
    its host CPU and memory."""
    out = node.copy()
    for i, (mem, milli, ex) in choice.fit.charged.items():
        out.gpus[i].charge(pre.pod.key, mem, milli, ex, pre.pod.pod_class)
    if out.cpu_milli:
        out.cpu_used += pre.pod.cpu_milli
    if out.ram_mib:
        out.ram_used += pre.pod.ram_mib
    return out
