"""GPU-aware preemption: the leader's preemption controller.

kube-scheduler's own preemption asks its filters which pods to evict; they do not see GPU shares,
so with gpupack's profile it never finds a victim ("expected at least one victim pod"). This
thread does it instead, every `interval_s`, for the pods kube-scheduler marked Unschedulable that
ask for gpupack resources:

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from kubernetes import client
from prometheus_client import Counter, Histogram

from gpupack import handoff
from gpupack.contract import GPUShare, Reservation
from gpupack.core.model import FULL, Node
from gpupack.core.preemption import Choice, Preemptor, Victim, choose, without
from gpupack.events import EventRecorder
from gpupack.kubeclient import ApiException, KubeClient, api_reason

from . import preempt_inputs as pin
from . import reservations as resv
from .defrag.eviction import Evictor, budget_refusal
from .defrag.reserve import ReservationWriter, ReserveError
from .framework import Extender
from .hostuse import NO_HOST_USE, ram_mib
from .lease import LeaseFence
from .node_resources import HostedPodRequest
from .upkeep import ANN_REQUEUED

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
            "Preemption decisions for pending GPU pods, by outcome (evicted, no-room, fits, never, failed)",
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
    ) -> None:
        assert ext.kube is not None
        self.ext, self.view, self.kube, self.kc = ext, ext.view, ext.kube, kc
        self.events, self.fence = events, fence
        self.interval_s, self.hold_s = interval_s, hold_s
        self.evictor = Evictor(kc, poll_s=0.5)
        self.writer = ReservationWriter(kc)
        self.metrics = PreemptionMetrics(ext)
        self.touched: set[tuple[str, str]] = set()  # (uid, record time) asked to retry once
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

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
        done = {"evicted": 0, "waiting": 0, "released": 0, "no-room": 0}
        if not self.view.synced.is_set() or (self.fence is not None and self.fence.problem()):
            return done
        now, started = self.ext.clock(), time.monotonic()
        pending = [
            p
            for p in self.kube.unscheduled_pods(self.ext.config.scheduler_name, cached=True)
            if pin.unschedulable(p)
        ]
        own = self._own_reservations(now)
        wanting = [(p, req) for p in pending if (req := self._request(p)) is not None]
        if not wanting and not own:
            return done
        running = self.kube.list_pods().get("items") or []
        by_key = {pin.key_of(p): p for p in running}
        pending_by_key = {pin.key_of(p): p for p in pending}
        done["released"] = self._release(own, pending_by_key, by_key, now)
        taken: set[str] = set()
        todo = []
        waits = []
        for p, req in wanting:
            rec = pin.record_of(p)
            if rec is not None and any(r.id == rec.reservation for r in own.get(rec.node, [])):
                taken.update(v.rsplit(":", 1)[0] for v in rec.victims)
                waits.append((p, rec))
            elif pin.may_preempt(p):
                todo.append((p, req))
            else:
                self.metrics.preemptions.labels("never").inc()
        # a burst leaves many preemptors waiting at once, each maybe with an API call to make
        # (a nomination written again, an eviction retried, a retry asked for)
        done["waiting"] = sum(self._in_parallel(lambda w: self._wait_victims(w[0], w[1], by_key), waits))
        if not todo:
            return done
        pdbs = self.kc.list_all(self.kc.policy.list_pod_disruption_budget_for_all_namespaces)
        allowed = pin.budget_allows(pdbs)
        track = self.view.track_host
        nodes, gpu_nodes, constraints, classes, host, room, leaving = self._nodes(now, taken, running)
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
        memo: dict[Any, Any] = {}  # preemptors of one shape ask the same of unchanged nodes
        plans: list[_Plan] = []
        for p, req in todo:
            pre = Preemptor(req, pin.priority_of(p), True)
            cands = [
                n
                for name, n in nodes.items()
                if (name in gpu_nodes or not req.needs_gpu)
                and pin.node_allows(p, name, n.labels, constraints[name])
            ]
            choice = choose(cands, pre, pool, allowed, pod_room=room, memo=memo)
            if choice is None:
                self.metrics.preemptions.labels("no-room").inc()
                done["no-room"] += 1
                continue
            if not choice.victims:
                # room that is there, or will be once the pods on their way out are gone: counted
                # as this pod's for the rest of the pass, so no other preemptor counts it again
                self.metrics.preemptions.labels("fits").inc()
                if choice.node in room:
                    room[choice.node] -= 1
                if choice.node in leaving and not self._fits_now(choice.node, pre, now):
                    # only once they are gone (another preemptor's victims): held for it as for
                    # its own, so no lower-priority pod takes it meanwhile
                    r = self._reservation(p, pre, choice, nodes[choice.node], by_key, now)
                    plans.append(_Plan(p, pre, choice, r, {}, set()))
                    nodes[choice.node] = resv.hold(nodes[choice.node], [r])
                else:
                    nodes[choice.node] = _charged(nodes[choice.node], pre, choice)
                continue
            r = self._reservation(p, pre, choice, nodes[choice.node], by_key, now)
            exhausted = {b for b, n in allowed.items() if n <= 0}
            plans.append(_Plan(p, pre, choice, r, {k: pool[k] for k in choice.victims}, exhausted))
            for k in choice.victims:  # never picked again in this pass; their room is held
                for b in pool[k].budgets:
                    allowed[b] = allowed.get(b, 0) - 1
            # the hold counts its GPUs and host room for the rest of the pass
            nodes[choice.node] = resv.hold(without(nodes[choice.node], choice.victims, pool), [r])
            for k in choice.victims:
                pool.pop(k, None)
            if choice.node in room:
                room[choice.node] += len(choice.victims) - 1
        done["evicted"] = self._carry_out(plans, by_key, now)
        log.log(
            logging.INFO if plans else logging.DEBUG,
            "preemption pass: %d pending, %d waiting for victims, %d decided (%d victims), %d without room, %.1f s",
            len(pending), len(waits), len(plans), done["evicted"], done["no-room"], time.monotonic() - started,
        )  # fmt: skip
        return done

    def _request(self, pod: dict[str, Any]) -> Any:
        try:
            req = self.ext.pod_request(pod)
        except Exception:  # a bad pod: its filter answers say why
            return None
        # a pod needing no GPU waits for CPU, memory or a pod slot: those are counted only with
        # the view's host tracking (kube-scheduler's NodeResourcesFit filter off)
        return req if req.needs_gpu or self.view.track_host else None

    def _own_reservations(self, now: datetime) -> dict[str, list[Reservation]]:
        with self.view.lock:
            out: dict[str, list[Reservation]] = {}
            for name, info in self.view.nodes.items():
                # consumed ones too: the hold of a pod bound there is removed like any other
                mine = [
                    r
                    for r in resv.active(info.reservations, now)
                    if r.owner_kind == "Pod" and r.id.startswith(pin.PREEMPT_PREFIX)
                ]
                if mine:
                    out[name] = mine
            return out

    def _nodes(
        self, now: datetime, taken: set[str], running: list[dict[str, Any]]
    ) -> tuple[
        dict[str, Node],
        set[str],
        dict[str, frozenset[tuple[str, str, str]]],
        dict[str, str],
        dict[str, tuple[int, int]],
        dict[str, int],
        set[str],
    ]:
        """Copies of the view's schedulable nodes as they will be: the pods already on their way
        out (`taken` victims, pods being deleted) gone, their host room too, and every active
        reservation held; the nodes a GPU pod can start on (the device plugin registered); each
        node's taints; the class each pod holds its GPUs for; the host CPU (milli) and memory
        (MiB) each pod frees when it goes; and, with host tracking, the pods each node can still
        take; the nodes pods are leaving. Counting the leavers as gone lets a second preemptor use the room a first one's
        victims leave beyond its hold (two 40 GB shares on one GPU: one GPU's victims, not two)."""
        leaving: dict[str, set[str]] = {}
        for p in running:
            where = str((p.get("spec") or {}).get("nodeName") or "")
            k = pin.key_of(p)
            if where and (k in taken or (p.get("metadata") or {}).get("deletionTimestamp")):
                leaving.setdefault(where, set()).add(k)
        with self.view.lock:
            track = self.view.track_host
            for k, gp in self.view.pods.items():
                if k in taken or gp.deleting:
                    leaving.setdefault(gp.node, set()).add(k)
            host: dict[str, tuple[int, int]] = {}
            if track:
                for k, hp in self.view.host.pods.items():
                    host[k] = (hp.use.cpu_milli, ram_mib(hp.use.mem_bytes))
            for k, gp in self.view.pods.items():
                host.setdefault(k, (gp.host.cpu_milli, ram_mib(gp.host.mem_bytes)))
            freed = {k: Victim(k, cpu_milli=c, ram_mib=m) for k, (c, m) in host.items()}
            nodes: dict[str, Node] = {}
            gpu_nodes: set[str] = set()
            taints: dict[str, frozenset[tuple[str, str, str]]] = {}
            room: dict[str, int] = {}
            for name, node in self.view.state.nodes.items():
                info = self.view.nodes.get(name)
                if info is None or info.unschedulable:
                    continue
                if info.slots > 0 and node.gpus:
                    gpu_nodes.add(name)
                elif not track:
                    continue  # no device plugin there: no GPU pod can start on it
                gone = leaving.get(name, set())
                base = without(node, gone, freed) if gone else node
                nodes[name] = resv.hold(base, self.view.active_reservations(name, now))
                taints[name] = info.taints
                if track and info.pods_allowed > 0:
                    held = sum(r.host_pods for r in self.view.active_reservations(name, now))
                    room[name] = info.pods_allowed - info.pod_count + len(gone) - held
            classes = {k: p.assignment.pod_class for k, p in self.view.pods.items()}
            return nodes, gpu_nodes, taints, classes, host, room, {n for n, ks in leaving.items() if ks}

    def _fits_now(self, name: str, pre: Preemptor, now: datetime) -> bool:
        """Whether `pre` fits on the node as the view has it, the pods on their way out still there."""
        with self.view.lock:
            node = self.view.state.nodes.get(name)
            if node is None:
                return False
            held = resv.hold(node, self.view.active_reservations(name, now))
        return choose([held], pre, {}) is not None

    # --- waiting and releasing ----------------------------------------------------------------
    def _wait_victims(self, pod: dict[str, Any], rec: pin.Record, by_key: dict[str, dict[str, Any]]) -> int:
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
                self._evict(p, pin.key_of(pod), deleting_ok=False)
        if alive:
            # kube-scheduler keeps a nomination only while victims it marked itself are terminating
            # (v1.36: their DisruptionTarget condition says PreemptionByScheduler); a failed attempt
            # in between clears ours, so it is written again while the room is held
            if (pod.get("status") or {}).get("nominatedNodeName") != rec.node:
                self._nominate(pod, rec.node)
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

    def _release(
        self,
        own: dict[str, list[Reservation]],
        pending: dict[str, dict[str, Any]],
        bound: dict[str, dict[str, Any]],
        now: datetime,
    ) -> int:
        """Remove the holds whose preemptor is bound (here or elsewhere) or gone."""
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
    def _carry_out(self, plans: list[_Plan], by_key: dict[str, dict[str, Any]], now: datetime) -> int:
        """The pass's decisions carried out, the victims evicted; one node's in order (they write
        its reservations annotation), nodes side by side: a burst of preemptors costs the slowest
        node's API calls, not the sum of all. Returns the victims evicted for."""
        by_node: dict[str, list[_Plan]] = {}
        for plan in plans:
            by_node.setdefault(plan.choice.node, []).append(plan)

        def node_plans(group: list[_Plan]) -> int:
            n = 0
            for plan in group:
                try:
                    ok = self._execute(plan, by_key, now)
                except Exception:  # one preemptor's failure must not stop the others'
                    log.exception("preemption for %s failed", plan.pre.pod.key)
                    ok = False
                self.metrics.preemptions.labels("evicted" if ok else "failed").inc()
                n += len(plan.choice.victims) if ok else 0
            return n

        return sum(self._in_parallel(node_plans, list(by_node.values())))

    def _in_parallel(self, fn: Callable[[_T], int], items: list[_T]) -> list[int]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(min(EXECUTORS, len(items)), thread_name_prefix="preempt") as ex:
            return list(ex.map(fn, items))

    def _execute(self, plan: _Plan, by_key: dict[str, dict[str, Any]], now: datetime) -> bool:
        pod, pre, choice, r, pool = plan.pod, plan.pre, plan.choice, plan.hold, plan.victims
        meta = pod.get("metadata") or {}
        ns, name, uid = meta.get("namespace") or "default", str(meta.get("name")), pin.uid_of(pod)
        victims = [by_key[k] for k in choice.victims]
        try:
            self.writer.add(choice.node, r, now)
        except (ApiException, ReserveError) as e:
            log.warning("pod %s: cannot hold node %s for it: %s", pre.pod.key, choice.node, e)
            return False
        self._await_hold(choice.node, r.id)
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
            f"; {choice.budget_violations} of them against a PodDisruptionBudget, as no other choice existed"
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
            must = bool(choice.budget_violations) and any(b in plan.exhausted for b in vic.budgets)
            self._evict(v, pre.pod.key, deleting_ok=must, priority=pre.priority, node=choice.node)
            self.metrics.victims.labels(vic.pod_class, str(vic.priority)).inc()
        # after the evictions, as kube-scheduler does: its next failed attempt then sees lower-priority
        # pods terminating on the nominated node and keeps the nomination (up to v1.28; later
        # versions clear it, and _wait_victims writes it again)
        self._nominate(pod, choice.node)
        return True

    def _nominate(self, pod: dict[str, Any], node: str) -> None:
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
            # its host room too, from every other pod (with host tracking; extender/fitting.py)
            host_cpu_milli=host.cpu_milli,
            host_mem_bytes=host.mem_bytes,
            host_pods=1 if self.view.track_host else 0,
        )

    def _await_hold(self, node: str, rid: str, timeout_s: float = 3.0) -> None:
        """Until the view holds the reservation (the node watch brings it), so no bind in this
        process can take the room the first eviction leaves."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r.id == rid for r in self.view.active_reservations(node, self.ext.clock())):
                return
            time.sleep(0.02)
        log.warning("node %s: reservation %s not seen by the watch within %.0f s", node, rid, timeout_s)

    def _evict(
        self, v: dict[str, Any], for_key: str, deleting_ok: bool, priority: int = 0, node: str = ""
    ) -> None:
        """Evict `v` through the Eviction API. A budget that refuses it is waited out (next pass)
        unless the choice had to violate one (`deleting_ok`): then it is deleted as kube-scheduler's
        own preemption deletes, with its grace period."""
        meta = v.get("metadata") or {}
        ns, name, uid = meta.get("namespace") or "default", str(meta.get("name")), pin.uid_of(v)
        try:
            self.evictor.evict_retrying(ns, name, uid)
        except ApiException as e:
            if e.status == 404:
                return
            refused = budget_refusal(e) if e.status == 429 else None
            if refused is None or not deleting_ok:
                log.info(
                    "eviction of %s for %s refused: %s", f"{ns}/{name}", for_key, refused or api_reason(e)
                )
                return
            try:
                opts = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
                self.kc.json(self.kc.core.delete_namespaced_pod, name, ns, body=opts)
            except ApiException as e2:
                log.warning("deleting %s/%s for %s failed: %s", ns, name, for_key, api_reason(e2))
                return
        if self.events is not None and node:
            self.events.pod(
                ns, name, uid, "Preempted",
                f"evicted by gpupack for pod {for_key} (priority {priority} > {int((v.get('spec') or {}).get('priority') or 0)}), "
                f"which needs this pod's room on node {node}",
            )  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """One preemptor's decision, made in the pass and carried out after it."""

    pod: dict[str, Any]
    pre: Preemptor
    choice: Choice
    hold: Reservation
    victims: dict[str, Victim]  # the chosen ones, as the chooser saw them
    exhausted: set[str]  # budgets that allowed no more disruptions when it was made


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
