"""Stale GPU assignments on unbound pods (a bind that never posted its Binding, an extender killed
between the two, an older extender's two-write bind): whoever finds one removes it, with the pod's
resourceVersion as precondition, so what was judged stale is what is removed."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.contract import ANN_ALLOCATED, ANN_ASSIGNMENT, LABEL_MANAGED
from gpupack.kubeclient import api_reason

from ..api.kube import Kube
from ..api.lease import BindError, LeaseFence
from ..api.wire import BindArgs
from ..state.metrics import Metrics
from ..state.view import ClusterView
from .bind_pods import read_pod
from .collector import VerbActivity

log = logging.getLogger("gpupack.extender")


class StaleCleaner:
    def __init__(
        self,
        view: ClusterView,
        kube: Kube | None,
        fence: LeaseFence | None,
        metrics: Metrics,
        activity: VerbActivity,
    ) -> None:
        self.view = view
        self.kube = kube
        self.fence = fence
        self.metrics = metrics
        self.activity = activity

    def clean_own_stale(self, pod: dict[str, Any]) -> None:
        """The pod being filtered still carries an assignment from a bind that never posted its
        Binding (failed Binding and failed rollback, or an extender killed between the two): it
        must not count against the pod itself now, so it goes first."""
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if ANN_ASSIGNMENT not in ann or (pod.get("spec") or {}).get("nodeName") or self.kube is None:
            return
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        with self.view.lock:
            if key in self.view.locks.inflight:
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

    def without_stale_record(self, args: BindArgs, pod: dict[str, Any]) -> dict[str, Any]:
        """A Binding can add annotations, not remove them: a pod that still carries an assignment or
        allocation record (from an extender before the one-write bind, or a tool) is cleaned
        first, with its resourceVersion as precondition, and the pod as it is then returned."""
        assert self.kube is not None
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        if (ANN_ASSIGNMENT not in ann and ANN_ALLOCATED not in ann) or (pod.get("spec") or {}).get(
            "nodeName"
        ):
            return pod  # nothing old on it, or bound already (the Binding's 409 says so)
        meta = pod.get("metadata") or {}
        self.clean_unbound(args.key, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""))
        again = read_pod(self.kube, self.activity, args)
        if (again.get("spec") or {}).get("nodeName"):
            return again
        left = (again.get("metadata") or {}).get("annotations") or {}
        if ANN_ASSIGNMENT in left or ANN_ALLOCATED in left:
            raise BindError(
                f"pod {args.key} carries an old GPU assignment that could not be removed", "conflict"
            )
        return again
