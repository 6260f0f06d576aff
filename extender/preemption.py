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
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from gpupack import handoff
from gpupack.contract import GPUShare, Reservation
from gpupack.core.model import FULL, Node
from gpupack.core.preemption import Choice, Preemptor, Victim, choose, without
from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient

from . import preempt_inputs as pin
from . import reservations as resv
from .framework import Extender
from .hostuse import NO_HOST_USE, ram_mib
from .lease import LeaseFence
from .node_resources import HostedPodRequest
from .preempt_actions import Plan, PreemptionActions, in_parallel

log = logging.getLogger("gpupack.extender.preemption")


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
        own = self._own_reservations(now)
        if not own and self.marks is not None and self.marks.none():
            self.skipped += 1
            return done
        unbound = self.kube.unscheduled_pods(self.ext.config.scheduler_name, cached=True)
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
            if rec is not None and any(r.id == rec.reservation for r in own.get(rec.node, [])):
                taken.update(v.rsplit(":", 1)[0] for v in rec.victims)
                waits.append((p, rec))
        waiting = {pin.key_of(p) for p, _ in waits}
        todo = []
        for p, req in wanting:
            key = pin.key_of(p)
            if key in waiting or key in held_for:
                # decided already (a hold whose record is not seen yet: the pending list comes
                # from the API server's cache, a moment old): never planned again
                continue
            if pin.may_preempt(p):
                todo.append((p, req))
            else:
                self.metrics.preemptions.labels("never").inc()
        # a burst leaves many preemptors waiting at once, each maybe with an API call to make
        # (a nomination written again, an eviction retried, a retry asked for)
        done["waiting"] = sum(in_parallel(lambda w: self.act.wait_victims(w[0], w[1], by_key), waits))
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
        plans: list[Plan] = []
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
                    plans.append(Plan(p, pre, choice, r, {}))
                    nodes[choice.node] = resv.hold(nodes[choice.node], [r])
                else:
                    nodes[choice.node] = _charged(nodes[choice.node], pre, choice)
                continue
            r = self._reservation(p, pre, choice, nodes[choice.node], by_key, now)
            plans.append(Plan(p, pre, choice, r, {k: pool[k] for k in choice.victims}))
            for k in choice.victims:  # never picked again in this pass; their room is held
                for b in pool[k].budgets:
                    allowed[b] = allowed.get(b, 0) - 1
            # the hold counts its GPUs and host room for the rest of the pass
            nodes[choice.node] = resv.hold(without(nodes[choice.node], choice.victims, pool), [r])
            for k in choice.victims:
                pool.pop(k, None)
            if choice.node in room:
                room[choice.node] += len(choice.victims) - 1
            leaving.add(choice.node)  # its victims leave: room the next preemptor may share
        done["evicted"] = self.act.carry_out(plans, by_key, now)
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
