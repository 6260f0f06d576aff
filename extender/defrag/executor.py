"""Run a defrag plan against the cluster, one move at a time.

Per move: re-read the cluster and verify the move again on the live state (a plan is minutes
old by then); reserve the target GPUs in the target Node's annotation so the replacement pod
lands there (the extender honours it); evict through the Eviction API (HTTP 429 naming a
PodDisruptionBudget: skip the pod and the rest of its drain group, go on; any other 429 is the
API server shedding load: retry after its Retry-After); wait until
the controller's replacement is bound, Running and Ready; drop the consumed reservation. A
replacement that is not ready within the per-move timeout stops the run. Every reservation the
run wrote is removed at the end, whatever happened.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from gpupack.contract import ANN_ASSIGNMENT, ContractError, GPUShare, Reservation, decode_assignment
from gpupack.core.defrag import Move, Plan
from gpupack.core.model import PlacementError

from .events import EventRecorder
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
    evictions: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "aborted": self.aborted,
            "evictions": self.evictions,
            "gpus_freed": list(self.gpus_freed),
            "nodes_freed": list(self.nodes_freed),
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


def _owned_by(pod: dict[str, Any], kind: str, name: str) -> bool:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (
            isinstance(ref, dict)
            and ref.get("controller")
            and ref.get("kind") == kind
            and ref.get("name") == name
        ):
            return True
    return False


EVICT_THROTTLE_RETRIES = 3


def _budget_refusal(e: ApiException) -> str | None:
    """Why a PodDisruptionBudget refused an eviction (the Eviction API's 429 names the budget in a
    `DisruptionBudget` cause), or None when the 429 is not a budget's."""
    try:
        status = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        return None
    causes = (status.get("details") or {}).get("causes") if isinstance(status, dict) else None
    for c in causes or []:
        if isinstance(c, dict) and c.get("reason") == "DisruptionBudget":
            return str(c.get("message") or status.get("message") or "DisruptionBudget")
    return None


def _retry_after(e: ApiException) -> float:
    try:
        return min(10.0, max(0.1, float((e.headers or {}).get("Retry-After") or 1)))
    except (TypeError, ValueError):
        return 1.0


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


class Executor:
    def __init__(
        self,
        api: client.ApiClient,
        rebuild: Callable[[], Snapshot],
        opts: ExecOptions,
        run_id: str,
        events: EventRecorder,
        metrics: RunMetrics,
        lease: RunLease | None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.rebuild = rebuild
        self.opts = opts
        self.run_id = run_id
        self.events = events
        self.metrics = metrics
        self.lease = lease
        self.now = now
        self.writer = ReservationWriter(api)
        self.written: dict[str, set[str]] = {}  # node -> reservation ids this run holds

    # --- pieces --------------------------------------------------------------------------------
    def _evict(self, namespace: str, name: str, uid: str) -> None:
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False)

    def _evict_retrying(self, namespace: str, name: str, uid: str) -> None:
        """Evict; a 429 that is not a budget's refusal is the API server shedding load (priority
        and fairness): wait as it asks and try again a few times."""
        for attempt in range(EVICT_THROTTLE_RETRIES + 1):
            try:
                self._evict(namespace, name, uid)
                return
            except ApiException as e:
                if e.status != 429 or _budget_refusal(e) is not None or attempt == EVICT_THROTTLE_RETRIES:
                    raise
                wait = _retry_after(e)
                log.info("eviction of %s/%s throttled (429); retrying in %gs", namespace, name, wait)
                time.sleep(wait)

    def _pods_of(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        raw = json.loads(self.core.list_namespaced_pod(namespace, _preload_content=False).data)
        return [p for p in raw.get("items") or [] if _owned_by(p, kind, name)]

    def _wait_replacement(self, move: Move, before: set[str], rid: str) -> tuple[dict[str, Any] | None, str]:
        deadline = time.monotonic() + self.opts.move_timeout_s
        last = "no replacement pod yet"
        while True:
            for p in self._pods_of(move.namespace, move.owner_kind, move.owner_name):
                meta = p.get("metadata") or {}
                if meta.get("uid") in before or meta.get("deletionTimestamp"):
                    continue
                node = (p.get("spec") or {}).get("nodeName")
                phase = (p.get("status") or {}).get("phase")
                # Running is not serving: until readiness passes the workload is one replica short
                # (its PodDisruptionBudget does not count the pod either), so the move is not over.
                if node and phase == "Running" and _ready(p):
                    return p, ""
                state = "Running but not Ready" if phase == "Running" else (phase or "?")
                last = f"replacement {meta.get('name')} is {state}" + (f" on {node}" if node else ", unbound")
            if time.monotonic() >= deadline:
                return None, last
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
    def run(self, plan: Plan) -> RunResult:
        res = RunResult()
        broken: set[int] = set()
        done_per_group: dict[int, int] = {}
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
        self._tally(plan, res, done_per_group)
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
        ns, name = m.pod.split("/", 1)
        snap = self.rebuild()
        obj = snap.pods.get(m.pod)
        entry = snap.state.pods.get(m.pod)
        if obj is None or entry is None:
            return MoveResult(m.step, m.pod, "gone", "the pod no longer holds GPUs")
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        req, placement, _ = entry
        if placement.node != m.from_node:
            return MoveResult(m.step, m.pod, "changed", f"the pod now runs on {placement.node}")
        # Verify the move again on the live state before anything is written or evicted.
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

        rid = f"{self.run_id}-{m.step}"
        now = self.now()
        ttl = self.opts.reservation_ttl_s or (self.opts.move_timeout_s + 120)
        resv = reservation_for(m, snap, rid, now + timedelta(seconds=ttl))
        try:
            self.writer.add(m.to_node, resv, now)
        except (ReserveError, ApiException) as e:
            return MoveResult(m.step, m.pod, "reserve-failed", str(e))
        self.written.setdefault(m.to_node, set()).add(rid)
        before = {
            str((p.get("metadata") or {}).get("uid")) for p in self._pods_of(ns, m.owner_kind, m.owner_name)
        }
        try:
            self._evict_retrying(ns, name, uid)
        except ApiException as e:
            self._release(m.to_node, {rid})
            budget = _budget_refusal(e) if e.status == 429 else None
            if budget is not None:
                self.metrics.evictions.labels("pdb-refused").inc()
                msg = (
                    f"eviction refused by a PodDisruptionBudget ({budget}); "
                    f"gpupack defrag skipped moving it to {m.to_node}"
                )
                self.events.pod(ns, name, uid, "DefragEvictionRefused", msg, warning=True)
                log.info("move %d %s: %s", m.step, m.pod, msg)
                return MoveResult(m.step, m.pod, "pdb-refused", f"429 TooManyRequests: {budget}")
            if e.status in (404, 409):
                self.metrics.evictions.labels("gone").inc()
                return MoveResult(m.step, m.pod, "gone", f"{e.status} {e.reason}")
            self.metrics.evictions.labels("error").inc()
            raise
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
            "move %d: evicted %s from %s, replacement reserved on %s", m.step, m.pod, m.from_node, target
        )
        rep, why = self._wait_replacement(m, before, rid)
        if rep is None:
            msg = (
                f"replacement of {m.pod} not running on {m.to_node} within {self.opts.move_timeout_s:g}s "
                f"({why}); defrag run stopped and its reservations released"
            )
            self.events.pod(ns, name, uid, "DefragAborted", msg, warning=True)
            self.events.node(m.to_node, "", "DefragAborted", msg, warning=True)
            log.error("move %d: %s", m.step, msg)
            return MoveResult(m.step, m.pod, "timeout", msg)
        rmeta = rep.get("metadata") or {}
        rep_key = f"{rmeta.get('namespace')}/{rmeta.get('name')}"
        on_res = False
        try:
            a = decode_assignment((rmeta.get("annotations") or {}).get(ANN_ASSIGNMENT), rep_key)
            on_res = a.reservation == rid
        except ContractError:
            pass
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
        complete = [g for g in plan.groups if done_per_group.get(g.id, 0) == len(g.pods)]
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
        self.metrics.gpus_freed.set(len(res.gpus_freed))
        self.metrics.nodes_freed.set(len(res.nodes_freed))
