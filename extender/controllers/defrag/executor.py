"""Run a defrag plan against the cluster, one move at a time.

Per move: re-read the cluster and verify the move again on the live state (a plan is minutes
old by then); reserve the target GPUs in the target Node's annotation so the replacement pod
lands there (the extender honours it); wait until every PodDisruptionBudget covering the pod
allows a disruption (bounded by the budget wait; a budget still at 0 then skips the pod and the
rest of its drain group); evict through the Eviction API (a 429 naming a DisruptionBudget, a
race with another disruption, goes back to waiting on the budget; any other 429 is the API server
shedding load: retry after its Retry-After); wait until the controller's replacement is bound,
Running and Ready; drop the consumed reservation. A replacement that is not ready within the
per-move timeout stops the run. Every reservation the run wrote is removed at the end, whatever
happened.

With the nodes objective, a node is tainted (the cluster autoscaler's status-taint convention)
before its first pod moves, so the scheduler does not refill it while the run lasts; the taint is
removed at the end unless the node ended empty and the run was asked to keep it.

Freed GPUs and nodes are counted once the evicted pods are really gone (bounded by the settle
timeout), from a fresh read of the cluster: the run's output, its metric and its Events agree with
what the cluster shows afterwards.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from gpupack.contract import (
    ANN_ASSIGNMENT,
    ContractError,
    GPUShare,
    Reservation,
    decode_assignment,
)
from gpupack.core.defrag import Move, Plan, used_gpus
from gpupack.core.model import PlacementError
from gpupack.events import EventRecorder
from gpupack.kubeclient import ApiException, KubeClient

from .eviction import Evictor, budget_refusal
from .lease import LeaseHeld, RunLease
from .metrics import RunMetrics
from .reserve import ReservationWriter, ReserveError
from .snapshot import Snapshot
from .window import Window

log = logging.getLogger("gpupack.defrag")


@dataclass(frozen=True)
class ExecOptions:
    move_timeout_s: float = 600.0
    poll_s: float = 2.0
    reservation_ttl_s: float = 0.0  # 0: move timeout + 120 s
    window: Window | None = None
    force: bool = False
    budget_wait_s: float = 300.0  # longest wait for a PodDisruptionBudget to allow a disruption
    settle_s: float = 120.0  # longest wait, at the end, for evicted pods to be gone before counting
    objective: str = "gpus"  # "nodes": taint the nodes being emptied while the run lasts
    keep_taint: bool = False  # leave the taint on nodes the run emptied


@dataclass
class MoveResult:
    step: int
    pod: str
    outcome: (
        str  # done | pdb-refused | gone | changed | no-longer-fits | reserve-failed | group-skipped | timeout
    )
    detail: str = ""
    replacement: str = ""
    on_reservation: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunResult:
    moves: list[MoveResult] = field(default_factory=list)
    aborted: str = ""
    gpus_freed: list[str] = field(default_factory=list)  # "node/uuid" confirmed idle at the end
    nodes_freed: list[str] = field(default_factory=list)
    still_terminating: list[str] = field(default_factory=list)  # evicted pods not gone by the count
    tainted: list[str] = field(default_factory=list)  # nodes tainted during the run
    taint_kept: list[str] = field(default_factory=list)  # ... of which still tainted after it
    budget_waits_s: float = 0.0  # time spent waiting for disruption budgets
    evictions: int = 0
    # What the cluster gained, counted on the cluster before and after (a pod moved onto a GPU that
    # was idle frees one and fills one): GPUs and nodes holding any pod; -1 when not read.
    used_gpus_before: int = -1
    used_gpus_after: int = -1
    used_nodes_before: int = -1
    used_nodes_after: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {
            "aborted": self.aborted,
            "evictions": self.evictions,
            "gpus_freed": list(self.gpus_freed),
            "nodes_freed": list(self.nodes_freed),
            "still_terminating": list(self.still_terminating),
            "tainted": list(self.tainted),
            "taint_kept": list(self.taint_kept),
            "budget_waits_s": round(self.budget_waits_s, 3),
            "used_gpus_before": self.used_gpus_before,
            "used_gpus_after": self.used_gpus_after,
            "used_nodes_before": self.used_nodes_before,
            "used_nodes_after": self.used_nodes_after,
            "moves": [m.to_dict() for m in self.moves],
        }


def _fmt(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reservation_for(move: Move, snap: Snapshot, rid: str, expires: datetime) -> Reservation:
    node = snap.state.nodes[move.to_node]
    nvml = snap.gpu_indexes.get(move.to_node) or list(range(len(node.gpus)))
    containers = {
        cname: tuple(
            GPUShare(
                uuid=node.gpus[s.gpu_index].uuid,
                index=nvml[s.gpu_index],
                mem_mib=s.mem_mib,
                sm_pct=min(100, math.ceil(s.milli / 10)),
                exclusive=s.exclusive,
            )
            for s in shares
        )
        for cname, shares in move.placement.containers.items()
    }
    return Reservation(
        id=rid,
        namespace=move.namespace,
        owner_kind=move.owner_kind,
        owner_name=move.owner_name,
        pod_class=move.pod_class,
        containers=containers,
        expires=_fmt(expires),
        evicted_pod=move.pod,
    )


def _placed_through(meta: dict[str, Any], key: str, rid: str) -> bool:
    """Whether the pod with this metadata was placed through reservation `rid`."""
    try:
        return decode_assignment((meta.get("annotations") or {}).get(ANN_ASSIGNMENT), key).reservation == rid
    except ContractError:
        return False


TAINT_KEY = "status-taint.cluster-autoscaler.kubernetes.io/gpupack-defrag"
TAINT_VALUE = "emptying"  # while a run moves its pods; a later run removes a stale one
TAINT_EMPTIED = "emptied"  # left by --keep-taint on a node the run emptied; the operator's to remove
# A node the operator (or CA itself) says must never be scaled down: emptying it gains nothing.
CA_SCALE_DOWN_DISABLED = "cluster-autoscaler.kubernetes.io/scale-down-disabled"


def set_taint(kc: KubeClient, node: str, value: str | None) -> bool:
    """Set the defrag status taint on `node` to `value` (NoSchedule), or remove it (None)."""
    for _ in range(8):
        raw = kc.json(kc.core.read_node, node)
        taints = list((raw.get("spec") or {}).get("taints") or [])
        mine = [t for t in taints if t.get("key") == TAINT_KEY]
        if (value is None and not mine) or (value is not None and [t.get("value") for t in mine] == [value]):
            return False
        taints = [t for t in taints if t.get("key") != TAINT_KEY]
        if value is not None:
            taints.append({"key": TAINT_KEY, "value": value, "effect": "NoSchedule"})
        body = {
            "metadata": {"resourceVersion": raw["metadata"]["resourceVersion"]},
            "spec": {"taints": taints or None},
        }
        try:
            kc.merge_patch(kc.core.patch_node, node, body)
            return True
        except ApiException as e:
            if e.status != 409:
                raise
    raise ApiException(status=409, reason=f"node {node} kept changing while setting its taint")


class Executor:
    def __init__(
        self,
        kc: KubeClient,
        rebuild: Callable[[], Snapshot],
        opts: ExecOptions,
        run_id: str,
        events: EventRecorder,
        metrics: RunMetrics,
        lease: RunLease | None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kc = kc
        self.core = kc.core
        self.rebuild = rebuild
        self.opts = opts
        self.run_id = run_id
        self.events = events
        self.metrics = metrics
        self.lease = lease
        self.now = now
        self.policy = kc.policy
        self.writer = ReservationWriter(kc)
        self.evictor = Evictor(kc, opts.poll_s)
        self.written: dict[str, set[str]] = {}  # node -> reservation ids this run holds
        self.evicted: list[tuple[str, str, str, int]] = []  # (namespace, name, uid, group)
        self.tainted: set[str] = set()

    # --- pieces --------------------------------------------------------------------------------

    def _taint(self, node: str, value: str | None) -> bool:
        """Set this run's NoSchedule status taint to `value`, or remove it (None); read-modify-write
        with the Node's resourceVersion, so a concurrent writer is never overwritten. True when it
        changed anything."""
        return set_taint(self.kc, node, value)

    def _untaint_all(self, res: RunResult) -> None:
        for node in sorted(self.tainted):
            if self.opts.keep_taint and node in res.nodes_freed:
                try:
                    self._taint(node, TAINT_EMPTIED)
                    res.taint_kept.append(node)
                    continue
                except ApiException as e:
                    log.warning("could not mark node %s emptied: %s %s", node, e.status, e.reason)
            try:
                self._taint(node, None)
            except ApiException as e:
                log.warning(
                    "could not remove taint %s from node %s: %s %s", TAINT_KEY, node, e.status, e.reason
                )
                res.taint_kept.append(node)

    def _settle(self, res: RunResult, groups: set[int]) -> None:
        """Wait (bounded) until every pod this run evicted is gone: until then it holds its GPUs."""
        deadline = time.monotonic() + self.opts.settle_s
        while True:
            left = []
            by_ns: dict[str, dict[str, str]] = {}
            for ns, name, uid, grp in self.evicted:
                if grp not in groups:
                    continue
                if ns not in by_ns:
                    items = self.kc.json(self.core.list_namespaced_pod, ns)
                    by_ns[ns] = {
                        str((p.get("metadata") or {}).get("name")): str((p.get("metadata") or {}).get("uid"))
                        for p in items.get("items") or []
                    }
                if by_ns[ns].get(name) == uid:
                    left.append(f"{ns}/{name}")
            if not left or time.monotonic() >= deadline:
                res.still_terminating = left
                if left:
                    log.warning(
                        "%d evicted pod(s) still terminating after %gs; their GPUs are not counted as freed: %s",
                        len(left),
                        self.opts.settle_s,
                        " ".join(left),
                    )
                return
            time.sleep(self.opts.poll_s)

    def _release(self, node: str, ids: set[str]) -> None:
        if not ids:
            return
        try:
            self.writer.remove(node, ids, self.now())
            self.written.get(node, set()).difference_update(ids)
        except (ApiException, ReserveError) as e:
            log.warning("could not remove reservations %s from node %s: %s", sorted(ids), node, e)

    def release_all(self) -> None:
        for node, ids in list(self.written.items()):
            self._release(node, set(ids))

    # --- the loop ------------------------------------------------------------------------------
    def _usage(self) -> tuple[int, int]:
        """GPUs and nodes holding a pod now, as a fresh read of the cluster shows them."""
        state = self.rebuild().state
        return used_gpus(state), sum(1 for n in state.nodes.values() if any(not g.empty for g in n.gpus))

    def run(self, plan: Plan) -> RunResult:
        res = RunResult()
        try:
            res.used_gpus_before, res.used_nodes_before = self._usage()
        except ApiException as e:
            log.warning("could not read the cluster to count the GPUs in use: %s", e)
        self.evictor.budget_waited = 0.0
        broken: set[int] = set()
        done_per_group: dict[int, int] = {}
        groups = {g.id: g for g in plan.groups}
        try:
            for m in plan.moves:
                if m.group in broken:
                    res.moves.append(
                        MoveResult(m.step, m.pod, "group-skipped", "an earlier move of its group failed")
                    )
                    self.metrics.moves.labels("skipped").inc()
                    continue
                why = self._gate()
                if why:
                    res.aborted = why
                    self.metrics.moves_aborted.inc()
                    break
                g = groups.get(m.group)
                if self.opts.objective == "nodes" and g is not None and g.node not in self.tainted:
                    # Keep the scheduler (and anything else) from refilling the node being emptied.
                    self._taint(g.node, TAINT_VALUE)
                    self.tainted.add(g.node)
                    res.tainted.append(g.node)
                    log.info(
                        "tainted node %s %s=%s:NoSchedule while it is emptied", g.node, TAINT_KEY, TAINT_VALUE
                    )
                r = self._move(m, res)
                res.moves.append(r)
                if r.outcome == "done":
                    done_per_group[m.group] = done_per_group.get(m.group, 0) + 1
                    self.metrics.moves.labels("done").inc()
                elif r.outcome == "timeout":
                    res.aborted = f"move {m.step} ({m.pod}): {r.detail}"
                    self.metrics.moves.labels("aborted").inc()
                    self.metrics.moves_aborted.inc()
                    break
                else:
                    broken.add(m.group)
                    self.metrics.moves.labels("skipped").inc()
        finally:
            self.release_all()
            res.budget_waits_s = self.evictor.budget_waited
            try:
                whole = {g.id for g in plan.groups if done_per_group.get(g.id, 0) == len(g.pods)}
                # Only groups that moved entirely free anything, so only their pods are waited for.
                if any(grp in whole for *_, grp in self.evicted):
                    self._settle(res, whole)
                self._tally(plan, res, done_per_group)
                if res.used_gpus_before >= 0:
                    try:
                        res.used_gpus_after, res.used_nodes_after = self._usage()
                    except ApiException as e:
                        log.warning("could not read the cluster to count the GPUs in use: %s", e)
            finally:
                self._untaint_all(res)
        return res

    def _gate(self) -> str:
        """Why no further move may start now ('' = go on)."""
        if self.opts.window is not None and not self.opts.force and not self.opts.window.contains(self.now()):
            return f"the allowed window {self.opts.window.text} closed"
        if self.lease is not None:
            try:
                self.lease.renew()
            except (LeaseHeld, ApiException) as e:
                return f"lost the run lease: {e}"
        return ""

    def _move(self, m: Move, res: RunResult) -> MoveResult:
        """One move, phase by phase: verify it on the live state, reserve the target, evict once
        the budgets allow, wait for the replacement, drop the reservation."""
        snap = self.rebuild()
        stale = self._verify(m, snap)
        if stale is not None:
            return stale
        obj = snap.pods[m.pod]
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        rid = f"{self.run_id}-{m.step}"
        failed = self._reserve(m, snap, rid)
        if failed is not None:
            return failed
        before = self._replica_uids(m)
        not_evicted = self._evict_within_budget(m, obj, uid, rid)
        if not_evicted is not None:
            return not_evicted
        self._record_eviction(m, res, uid, rid)
        rep, why = self.evictor.wait_replacement(m, before, self.opts.move_timeout_s)
        if rep is None:
            return self._abort_move(m, uid, why)
        return self._finish_move(m, rep, rid)

    def _verify(self, m: Move, snap: Snapshot) -> MoveResult | None:
        """Check the move again on the live state before anything is written or evicted; None
        when it still holds, else why not."""
        obj = snap.pods.get(m.pod)
        entry = snap.state.pods.get(m.pod)
        if obj is None or entry is None:
            return MoveResult(m.step, m.pod, "gone", "the pod no longer holds GPUs")
        req, placement, _ = entry
        if placement.node != m.from_node:
            return MoveResult(m.step, m.pod, "changed", f"the pod now runs on {placement.node}")
        live = snap.state.clone()
        dst = live.nodes.get(m.to_node)
        if dst is None or any(
            i >= len(dst.gpus) or dst.gpus[i].uuid != u
            for i, u in zip(sorted(m.charged), m.to_gpus, strict=False)
        ):
            return MoveResult(m.step, m.pod, "no-longer-fits", f"node {m.to_node}'s GPUs changed")
        live.release(m.pod)
        try:
            if any(not dst.gpus[i].healthy for i in m.charged):
                raise PlacementError("a target GPU is unhealthy")
            live.place(req, m.placement, m.charged)
        except PlacementError as e:
            return MoveResult(m.step, m.pod, "no-longer-fits", str(e))
        return None

    def _reserve(self, m: Move, snap: Snapshot, rid: str) -> MoveResult | None:
        """Reserve the target GPUs for the replacement; None when written, else the failure."""
        now = self.now()
        ttl = self.opts.reservation_ttl_s or (self.opts.move_timeout_s + 120)
        resv = reservation_for(m, snap, rid, now + timedelta(seconds=ttl))
        try:
            self.writer.add(m.to_node, resv, now)
        except (ReserveError, ApiException) as e:
            return MoveResult(m.step, m.pod, "reserve-failed", str(e))
        self.written.setdefault(m.to_node, set()).add(rid)
        return None

    def _replica_uids(self, m: Move) -> set[str]:
        """The UIDs of the owner's pods now: a replacement is a pod not among them."""
        pods = self.evictor.pods_of(m.pod.split("/", 1)[0], m.owner_kind, m.owner_name)
        return {str((p.get("metadata") or {}).get("uid")) for p in pods}

    def _evict_within_budget(self, m: Move, obj: dict[str, Any], uid: str, rid: str) -> MoveResult | None:
        """Evict the pod once every PodDisruptionBudget covering it allows a disruption; None when
        evicted, else the move's outcome (its reservation released). Other API errors propagate."""
        ns, name = m.pod.split("/", 1)
        budget_deadline = time.monotonic() + self.opts.budget_wait_s
        while True:
            why_not = self.evictor.wait_budget(obj, budget_deadline)
            if why_not:
                refusal = f"waited {self.opts.budget_wait_s:g}s for a disruption budget: {why_not}"
                return self._refused(m, uid, rid, refusal)
            try:
                self.evictor.evict_retrying(ns, name, uid)
                return None
            except ApiException as e:
                budget = budget_refusal(e) if e.status == 429 else None
                if budget is None:
                    self._release(m.to_node, {rid})
                    if e.status not in (404, 409):
                        self.metrics.evictions.labels("error").inc()
                        raise
                    self.metrics.evictions.labels("gone").inc()
                    return MoveResult(m.step, m.pod, "gone", f"{e.status} {e.reason}")
                if time.monotonic() >= budget_deadline:
                    return self._refused(m, uid, rid, f"429 TooManyRequests: {budget}")
                # Another disruption took the budget between our read and the eviction.
                log.info("move %d %s: %s; waiting for the budget again", m.step, m.pod, budget)

    def _refused(self, m: Move, uid: str, rid: str, refusal: str) -> MoveResult:
        ns, name = m.pod.split("/", 1)
        self._release(m.to_node, {rid})
        self.metrics.evictions.labels("pdb-refused").inc()
        msg = (
            f"eviction refused by a PodDisruptionBudget ({refusal}); "
            f"gpupack defrag skipped moving it to {m.to_node}"
        )
        self.events.pod(ns, name, uid, "DefragEvictionRefused", msg, warning=True)
        log.info("move %d %s: %s", m.step, m.pod, msg, extra={"pod": m.pod})
        return MoveResult(m.step, m.pod, "pdb-refused", refusal)

    def _record_eviction(self, m: Move, res: RunResult, uid: str, rid: str) -> None:
        ns, name = m.pod.split("/", 1)
        self.evicted.append((ns, name, uid, m.group))
        res.evictions += 1
        self.metrics.evictions.labels("evicted").inc()
        target = f"{m.to_node} GPU(s) {', '.join(m.to_gpus)}"
        self.events.pod(
            ns,
            name,
            uid,
            "DefragEvicted",
            f"evicted by gpupack defrag to free GPU(s) {', '.join(m.from_gpus)} on {m.from_node}; "
            f"its replacement is reserved on {target} (reservation {rid})",
        )
        log.info(
            "move %d: evicted %s from %s, replacement reserved on %s", m.step, m.pod, m.from_node, target,
            extra={"pod": m.pod, "node": m.from_node, "fields": {"to": target, "step": m.step}},
        )  # fmt: skip

    def _abort_move(self, m: Move, uid: str, why: str) -> MoveResult:
        """The replacement did not come up in time: the run stops here."""
        ns, name = m.pod.split("/", 1)
        msg = (
            f"replacement of {m.pod} not running on {m.to_node} within {self.opts.move_timeout_s:g}s "
            f"({why}); defrag run stopped and its reservations released"
        )
        self.events.pod(ns, name, uid, "DefragAborted", msg, warning=True)
        self.events.node(m.to_node, "", "DefragAborted", msg, warning=True)
        log.error("move %d: %s", m.step, msg, extra={"pod": m.pod, "node": m.to_node})
        return MoveResult(m.step, m.pod, "timeout", msg)

    def _finish_move(self, m: Move, rep: dict[str, Any], rid: str) -> MoveResult:
        """The replacement is Ready: drop its reservation and say where it landed."""
        rmeta = rep.get("metadata") or {}
        rep_key = f"{rmeta.get('namespace')}/{rmeta.get('name')}"
        on_res = _placed_through(rmeta, rep_key, rid)
        rep_node = (rep.get("spec") or {}).get("nodeName")
        self._release(m.to_node, {rid})
        if not on_res:
            log.warning(
                "move %d: replacement %s runs on %s without reservation %s", m.step, rep_key, rep_node, rid
            )
        self.events.pod(
            str(rmeta.get("namespace")),
            str(rmeta.get("name")),
            str(rmeta.get("uid") or ""),
            "DefragMoved",
            f"replaces {m.pod} (moved by gpupack defrag from {m.from_node}); placed on {rep_node}"
            + (f" through reservation {rid}" if on_res else " (not through its reservation)"),
        )
        return MoveResult(m.step, m.pod, "done", "", rep_key, on_res)

    def _tally(self, plan: Plan, res: RunResult, done_per_group: dict[int, int]) -> None:
        """GPUs and nodes freed, as the cluster shows them now (not as the plan hoped)."""
        terminating = set(res.still_terminating)
        complete = [
            g
            for g in plan.groups
            if done_per_group.get(g.id, 0) == len(g.pods) and not terminating.intersection(g.pods)
        ]
        if not complete:
            return
        try:
            snap = self.rebuild()
        except ApiException as e:
            log.warning("could not re-read the cluster to count freed GPUs: %s", e)
            return
        for g in complete:
            node = snap.state.nodes.get(g.node)
            if node is None:
                continue
            freed = [u for u in g.gpus_freed if (gpu := node.gpu(u)) is not None and gpu.empty]
            res.gpus_freed += [f"{g.node}/{u}" for u in freed]
            if freed:
                uid = str(((snap.nodes.get(g.node) or {}).get("metadata") or {}).get("uid") or "")
                self.events.node(
                    g.node,
                    uid,
                    "DefragFreedGPUs",
                    f"gpupack defrag freed GPU(s) {', '.join(freed)} by moving {', '.join(g.pods)}",
                )
        for name in sorted({g.node for g in complete}):
            node = snap.state.nodes.get(name)
            if node is not None and node.gpus and all(gg.empty for gg in node.gpus):
                res.nodes_freed.append(name)
                uid = str(((snap.nodes.get(name) or {}).get("metadata") or {}).get("uid") or "")
                after = (
                    f"it keeps the taint {TAINT_KEY}:NoSchedule"
                    if self.opts.keep_taint and name in self.tainted
                    else "nothing keeps pods off it now"
                )
                self.events.node(
                    name,
                    uid,
                    "DefragFreedNode",
                    f"gpupack defrag moved every GPU pod off this node; {after}. A cluster autoscaler "
                    "removes an empty node after its scale-down-unneeded-time",
                )
        self.metrics.gpus_freed.set(len(res.gpus_freed))
        self.metrics.nodes_freed.set(len(res.nodes_freed))
