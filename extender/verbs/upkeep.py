"""Upkeep off the verb path, run by the leader's janitor and requeuer threads (requeue.py):
settling doubtful Bindings, giving up handoffs the kubelet never asked for, and touching pods that
kube-scheduler parked so that it tries them again."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.contract import ANN_HANDOFF, HANDOFF_FAILED
from gpupack.events import EventRecorder
from gpupack.kubeclient import api_reason

from ..api.kube import Kube
from ..api.lease import LeaseFence
from ..state.metrics import Metrics
from ..state.records import PodInfo
from ..state.view import ClusterView
from .config import ExtenderConfig
from .settling import Settler

log = logging.getLogger("gpupack.extender")

# Written on pods kube-scheduler may have parked while the extender was away: an update of the
# pod itself moves it from the scheduler's unschedulable pods back to its active queue.
ANN_REQUEUED = "gpupack.io/requeued-at"


class Upkeep:
    def __init__(
        self,
        view: ClusterView,
        kube: Kube | None,
        config: ExtenderConfig,
        metrics: Metrics,
        clock: Callable[[], datetime],
        fence: LeaseFence | None,
        events: EventRecorder | None,
        settler: Settler,
    ) -> None:
        self.view = view
        self.kube = kube
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.fence = fence
        # Events on pods for what their owners can act on and kube-scheduler cannot tell them
        # (a bind failure already reaches the pod as kube-scheduler's FailedScheduling event).
        self.events = events
        self.settler = settler

    def sweep(self) -> dict[str, int]:
        """One janitor pass (the leader's extender, every few seconds): assignments held for
        Bindings that got no answer are settled (see Settler.settle_doubtful), and a handoff
        pending on a bound pod for longer than `stale_handoff_s` is reported and marked failed, so
        its node takes GPU pods again. Releasing its claim is safe: if that kubelet admits the pod
        after all, the device plugin's PreStartContainer refuses its containers (handoff failed) and
        hands back whatever assignment its Allocate consumed, so no GPU is handed out twice.
        Returns what it did."""
        done = {"settled": 0, "failed": 0}
        if self.kube is None or not self.view.synced.is_set():
            return done
        if self.fence is not None and self.fence.problem():
            return done
        done["settled"] = self.settler.settle_doubtful()
        now = self.clock()
        for p in self.view.locks.pending_bound():
            age = handoff.handoff_age_s(p.pod_view(), now)
            if age is None or age <= self.config.stale_handoff_s:
                continue
            done["failed"] += self._fail_stale_handoff(p, age)
        return done

    def _fail_stale_handoff(self, p: PodInfo, age: float) -> bool:
        assert self.kube is not None
        ns, name = p.key.split("/", 1)
        limit = self.config.stale_handoff_s
        log.warning(
            "node %s: GPU handoff of pod %s pending for %.0f s (limit %.0f s); marking it failed so the node "
            "takes GPU pods again. Is gpupack's device plugin running there?",
            p.node,
            p.key,
            age,
            limit,
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
                f"{limit:.0f} s, so gpupack gave the handoff up and the node takes GPU pods "
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
        hit the extender while it was away parked them, and a v1.28 scheduler retries those only on
        a cluster event or its 5-minute flush. For the Requeuer (`parked_only`), only the pods the
        scheduler marked Unschedulable, at most `limit` of them (0: all), those not touched since
        `touched_since` (an RFC 3339 stamp of this clock) first and no others. Returns (touched,
        left over)."""
        if self.kube is None:
            return 0, 0
        if self.fence is not None and self.fence.problem():
            return 0, 0
        stamp = handoff.rfc3339(self.clock())
        scheduler = self.config.scheduler_name
        try:
            pods = self.kube.unscheduled_pods(scheduler, cached=parked_only)
        except ApiException as e:
            log.warning("cannot list the pods waiting for %s: %s", scheduler, api_reason(e))
            return 0, 0
        todo = [p for p in pods if _waiting(p, parked_only)]
        if touched_since:
            todo = [p for p in todo if _requeued_at(p) < touched_since]
        todo.sort(key=_requeued_at)  # the longest untouched first, so capped passes take turns
        left = max(0, len(todo) - limit) if limit > 0 else 0
        n = 0
        for pod in todo[: len(todo) - left]:
            n += self._touch(pod, stamp, parked_only)
        if n:
            log.info("asked kube-scheduler to retry %d waiting pod(s) now", n)
        return n, left

    def _touch(self, pod: dict[str, Any], stamp: str, parked_only: bool) -> int:
        """1 once the pod is touched. A conflict is read again: an update of kube-scheduler's own
        (a status-only change, which does not requeue the pod) can be what moved it."""
        assert self.kube is not None
        for _ in range(3):
            meta = pod.get("metadata") or {}
            ns, name = meta.get("namespace") or "default", meta["name"]
            try:
                self.kube.patch_pod_metadata(
                    ns, name, {ANN_REQUEUED: stamp}, {}, str(meta.get("resourceVersion") or "") or None
                )
                return 1
            except ApiException as e:
                if e.status == 409:
                    try:
                        pod = self.kube.get_pod(ns, name)
                    except ApiException:
                        return 0
                    if not _waiting(pod, parked_only):
                        return 0
                    continue
                if e.status != 404:  # gone
                    log.warning("cannot requeue pod %s/%s: %s", ns, name, api_reason(e))
                return 0
        return 0


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
