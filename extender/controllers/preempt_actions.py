"""What the preemption controller (extender/controllers/preemption.py) does in Kubernetes once it has decided:
hold the room, record the decision on the preemptor, evict the victims through the Eviction API
(deleting only where a budget had to be broken), nominate the preemptor, tell both sides in
Events; then follow each preemptor while its victims terminate, and release its hold once it is
bound or gone. Its metrics too."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from prometheus_client import Counter, Histogram

from gpupack import handoff
from gpupack.contract import Reservation
from gpupack.core.preemption import Choice, Preemptor, Victim
from gpupack.events import EventRecorder
from gpupack.kubeclient import ApiException, KubeClient, api_reason

from ..state import preempt_inputs as pin
from ..verbs.framework import Extender
from ..verbs.upkeep import ANN_REQUEUED
from .defrag.eviction import Evictor, budget_refusal
from .defrag.reserve import ReservationWriter, ReserveError

log = logging.getLogger("gpupack.extender.preemption")

# Nodes whose preemptions one pass carries out at once: each is a few API calls (hold, record,
# evictions, nomination), latency-bound; eight keep a burst's calls moving without crowding the
# API server's priority-and-fairness share for the scheduler's account.
EXECUTORS = 8
_T = TypeVar("_T")


class PreemptionMetrics:
    def __init__(self, ext: Extender) -> None:
        r = ext.metrics.registry
        self.preemptions = Counter(
            "gpupack_extender_preemptions_total",
            "Preemption decisions for pending GPU pods, by outcome (evicted, no-room, fits, never, failed;"
            " infeasible: the pod would not run where victims leave room; backoff: a hold expired with"
            " the pod unbound; error: planning for the pod failed)",
            ["outcome"],
            registry=r,
        )
        self.victims = Counter(
            "gpupack_extender_preemption_victims_total",
            "Pods evicted for a preemptor, by class and priority",
            ["pod_class", "priority"],
            registry=r,
        )
        self.bound = Histogram(
            "gpupack_extender_preemptor_pending_to_bound_seconds",
            "Time from a preemptor's creation to its bind on the node its victims left",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )


@dataclass(frozen=True)
class Plan:
    """One preemptor's decision, made in the pass and carried out after it."""

    pod: dict[str, Any]
    pre: Preemptor
    choice: Choice
    hold: Reservation
    victims: dict[str, Victim]  # the chosen ones, as the chooser saw them


class Reports:
    """What was said about each waiting pod (uid -> the kinds of report made), so that a pass
    every 2 s logs and records an Event once per pod and kind, not each time; pruned to the pods
    still waiting. Thread-safe (the executor threads report too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: dict[str, set[str]] = {}

    def first(self, uid: str, kind: str) -> bool:
        """True when the pod had no report of this kind yet."""
        with self._lock:
            kinds = self._said.setdefault(uid, set())
            if kind in kinds:
                return False
            kinds.add(kind)
            return True

    def prune(self, live: set[str]) -> None:
        with self._lock:
            for uid in [u for u in self._said if u not in live]:
                del self._said[uid]

    def __len__(self) -> int:
        with self._lock:
            return len(self._said)


def in_parallel(fn: Callable[[_T], int], items: list[_T]) -> list[int]:
    """fn over items, EXECUTORS at a time; the results in order."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(EXECUTORS, len(items)), thread_name_prefix="preempt") as ex:
        return list(ex.map(fn, items))


class PreemptionActions:
    """The controller's writes (shared by its pass and its executor threads)."""

    def __init__(self, ext: Extender, kc: KubeClient, events: EventRecorder | None) -> None:
        assert ext.kube is not None
        self.ext, self.view, self.kube, self.kc, self.events = ext, ext.view, ext.kube, kc, events
        self.evictor = Evictor(kc, poll_s=0.5)
        self.writer = ReservationWriter(kc)
        self.metrics = PreemptionMetrics(ext)
        self.touched: set[tuple[str, str]] = set()  # (uid, record time) asked to retry once
        self.reports = Reports()

    def forget(self, live: set[str]) -> None:
        """Drop what is kept of pods no longer waiting (`live`: the uids of those that are): a
        preemptor's retry mark lives as long as the pod waits, not as long as the process."""
        self.touched = {m for m in self.touched if m[0] in live}
        self.reports.prune(live)

    def report(
        self,
        pod: dict[str, Any],
        reason: str,
        event: str,
        message: str,
        warning: bool = True,
        exc: BaseException | None = None,
    ) -> bool:
        """Log (with `exc`'s traceback) and record an Event on the pod, once per pod and kind of
        report (`reason`); True when it was new."""
        meta = pod.get("metadata") or {}
        uid = pin.uid_of(pod)
        if not self.reports.first(uid, reason):
            return False
        log.warning("pod %s: %s", pin.key_of(pod), message, exc_info=exc)
        if self.events is not None:
            self.events.pod(
                meta.get("namespace") or "default", str(meta.get("name")), uid, event, message, warning
            )
        return True

    # --- waiting and releasing ----------------------------------------------------------------
    def wait_victims(self, pod: dict[str, Any], rec: pin.Record, by_key: dict[str, dict[str, Any]]) -> int:
        """1 while some victim of `rec` is still there (an eviction refused before is tried again);
        once all are gone the preemptor is asked, once, to retry now."""
        alive = []
        for v in rec.victims:
            key, _, uid = v.rpartition(":")
            p = by_key.get(key)
            if p is not None and pin.uid_of(p) == uid:
                alive.append(p)
        for p in alive:
            if not (p.get("metadata") or {}).get("deletionTimestamp"):
                self.evict(p, pin.key_of(pod))
        if alive:
            # kube-scheduler keeps a nomination only while victims it marked itself are terminating
            # (v1.36: their DisruptionTarget condition says PreemptionByScheduler); a failed attempt
            # in between clears ours, so it is written again while the room is held
            if (pod.get("status") or {}).get("nominatedNodeName") != rec.node:
                self.nominate(pod, rec.node)
            return 1
        mark = (pin.uid_of(pod), rec.at)
        if mark not in self.touched:
            self.touched.add(mark)
            meta = pod.get("metadata") or {}
            try:
                self.kube.patch_pod_metadata(
                    meta.get("namespace") or "default",
                    str(meta.get("name")),
                    {ANN_REQUEUED: handoff.rfc3339(self.ext.clock())},
                    {},
                    None,
                )
            except ApiException as e:
                log.info("pod %s: cannot ask for a retry: %s", pin.key_of(pod), api_reason(e))
        return 0

    def release(
        self,
        own: dict[str, list[Reservation]],
        pending: dict[str, dict[str, Any]],
        bound: dict[str, dict[str, Any]],
        now: datetime,
    ) -> int:
        """Remove the holds whose preemptor is bound (here or elsewhere) or gone (`pending`: every
        unbound pod of the scheduler, by key; `bound`: every pod with a node)."""
        n = 0
        for node, rs in own.items():
            drop = set()
            for r in rs:
                key = f"{r.namespace}/{r.owner_name}"
                if key in pending:
                    rec = pin.record_of(pending[key])
                    if rec is None or rec.reservation == r.id:
                        continue  # still waiting for its room
                p = bound.get(key)
                if p is not None and (p.get("spec") or {}).get("nodeName") == node:
                    created = handoff.parse_rfc3339((p.get("metadata") or {}).get("creationTimestamp") or "")
                    if created is not None:
                        self.metrics.bound.observe(max(0.0, (now - created).total_seconds()))
                drop.add(r.id)
            if drop:
                try:
                    self.writer.remove(node, drop, now)
                    n += len(drop)
                except (ApiException, ReserveError) as e:
                    log.warning("node %s: cannot release preemption hold(s) %s: %s", node, drop, e)
        return n

    # --- a decision carried out ---------------------------------------------------------------
    def carry_out(self, plans: list[Plan], by_key: dict[str, dict[str, Any]], now: datetime) -> int:
        """The pass's decisions carried out, the victims evicted; one node's in order (they write
        its reservations annotation), nodes side by side: a burst of preemptors costs the slowest
        node's API calls, not the sum of all. Returns the victims evicted for."""
        by_node: dict[str, list[Plan]] = {}
        for plan in plans:
            by_node.setdefault(plan.choice.node, []).append(plan)

        def node_plans(group: list[Plan]) -> int:
            n = 0
            for plan in group:
                try:
                    ok = self.execute(plan, by_key, now)
                except Exception as e:  # one preemptor's failure must not stop the others'
                    self.report(plan.pod, f"error: {type(e).__name__}", "PreemptionFailed",
                                f"gpupack could not carry out its preemption for this pod: {type(e).__name__}: {e}",
                                exc=e)  # fmt: skip
                    self.metrics.preemptions.labels("error").inc()
                    continue
                if not ok or plan.choice.victims:  # a hold alone was counted as "fits"
                    self.metrics.preemptions.labels("evicted" if ok else "failed").inc()
                n += len(plan.choice.victims) if ok else 0
            return n

        return sum(in_parallel(node_plans, list(by_node.values())))

    def execute(self, plan: Plan, by_key: dict[str, dict[str, Any]], now: datetime) -> bool:
        pod, pre, choice, r, pool = plan.pod, plan.pre, plan.choice, plan.hold, plan.victims
        meta = pod.get("metadata") or {}
        ns, name, uid = meta.get("namespace") or "default", str(meta.get("name")), pin.uid_of(pod)
        victims = [by_key[k] for k in choice.victims]
        try:
            self.writer.add(choice.node, r, now)
        except (ApiException, ReserveError) as e:
            log.warning("pod %s: cannot hold node %s for it: %s", pre.pod.key, choice.node, e)
            return False
        self.await_hold(choice.node, r.id)
        rec = pin.Record(
            choice.node,
            r.id,
            tuple(f"{pin.key_of(v)}:{pin.uid_of(v)}" for v in victims),
            handoff.rfc3339(now),
        )
        try:
            self.kube.patch_pod_metadata(ns, name, {pin.ANN_PREEMPTION: rec.encode()}, {}, None)
        except ApiException as e:
            log.warning("pod %s: cannot record its preemption: %s", pre.pod.key, api_reason(e))
            try:  # without a record the hold is no one's: give it back (it expires anyway)
                self.writer.remove(choice.node, {r.id}, now)
            except (ApiException, ReserveError) as e2:
                log.warning("node %s: cannot release hold %s: %s", choice.node, r.id, e2)
            return False
        names = ", ".join(f"{k} (priority {pool[k].priority}, {pool[k].pod_class})" for k in choice.victims)
        forced = (
            f"; {choice.budget_violations} of them covered by a PodDisruptionBudget that allows no disruption now,"
            " as no other choice existed: evicted once their budget allows it"
            if choice.budget_violations
            else ""
        )
        log.info(
            "preempting for %s (priority %d) on %s: %s%s",
            pre.pod.key,
            pre.priority,
            choice.node,
            names or "no victim (the room pods already leaving free is held for it)",
            forced,
        )
        if self.events is not None and victims:
            self.events.pod(
                ns, name, uid, "Preempting",
                f"gpupack evicts {len(victims)} pod(s) on node {choice.node} to make room for this pod: "
                f"{names}{forced}. The room is held for this pod until they are gone.",
                warning=bool(choice.budget_violations),
            )  # fmt: skip
        for v in victims:
            vic = pool[pin.key_of(v)]
            self.evict(v, pre.pod.key, priority=pre.priority, node=choice.node)
            self.metrics.victims.labels(vic.pod_class, str(vic.priority)).inc()
        # after the evictions, as kube-scheduler does: its next failed attempt then sees lower-priority
        # pods terminating on the nominated node and keeps the nomination (up to v1.28; later
        # versions clear it, and _wait_victims writes it again)
        self.nominate(pod, choice.node)
        return True

    def nominate(self, pod: dict[str, Any], node: str) -> None:
        meta = pod.get("metadata") or {}
        try:
            self.kc.merge_patch(
                self.kc.core.patch_namespaced_pod_status,
                str(meta.get("name")),
                meta.get("namespace") or "default",
                {"status": {"nominatedNodeName": node}},
            )
        except ApiException as e:  # bound meanwhile (refused on v1.36), or gone
            log.info("pod %s: cannot set its nominatedNodeName: %s", pin.key_of(pod), api_reason(e))

    def await_hold(self, node: str, rid: str, timeout_s: float = 3.0) -> None:
        """Until the view holds the reservation (the node watch brings it), so no bind in this
        process can take the room the first eviction leaves."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r.id == rid for r in self.view.active_reservations(node, self.ext.clock())):
                return
            time.sleep(0.02)
        log.warning("node %s: reservation %s not seen by the watch within %.0f s", node, rid, timeout_s)

    def evict(self, v: dict[str, Any], for_key: str, priority: int = 0, node: str = "") -> None:
        """Evict `v` through the Eviction API. A budget that refuses it is waited out (each pass
        tries again while the room is held), even when every choice had to break a budget: the
        extender holds no right to delete pods (its RBAC), so a budget is never overridden."""
        meta = v.get("metadata") or {}
        ns, name, uid = meta.get("namespace") or "default", str(meta.get("name")), pin.uid_of(v)
        try:
            self.evictor.evict_retrying(ns, name, uid)
        except ApiException as e:
            if e.status == 404:
                return
            refused = budget_refusal(e) if e.status == 429 else None
            log.info("eviction of %s for %s refused: %s", f"{ns}/{name}", for_key, refused or api_reason(e))
            return
        if self.events is not None and node:
            self.events.pod(
                ns, name, uid, "Preempted",
                f"evicted by gpupack for pod {for_key} (priority {priority} > {int((v.get('spec') or {}).get('priority') or 0)}), "
                f"which needs this pod's room on node {node}",
            )  # fmt: skip
