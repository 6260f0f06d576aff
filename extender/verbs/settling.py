"""Bindings whose outcome is not known (no answer, 429, 5xx, timeouts): made final by a fenced
PATCH with the Binding's resourceVersion as precondition, so a late arrival can no longer land,
and the view's charge kept or released by what the pod then holds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack import handoff
from gpupack.contract import ANN_ASSIGNMENT, Assignment
from gpupack.core.model import PodRequest
from gpupack.kubeclient import api_reason

from ..api.kube import Kube
from ..api.lease import BindError
from ..api.wire import BindArgs, WireError
from ..state.view import ClusterView

log = logging.getLogger("gpupack.extender")

# Written, with a Binding's resourceVersion as precondition, when that Binding got no answer: a
# late arrival of it then fails its precondition, so whether the pod is bound is known for good.
ANN_BIND_FENCED = "gpupack.io/bind-fenced"


class Settler:
    def __init__(self, view: ClusterView, kube: Kube | None, clock: Callable[[], datetime]) -> None:
        self.view = view
        self.kube = kube
        self.clock = clock

    def outcome(
        self, args: BindArgs, req: PodRequest, a: Assignment, rv: str, err: ApiException
    ) -> dict[str, Any] | None:
        """After a Binding that answered `err`: None when it took effect after all (an answer lost on
        the way back); the pod as it is now when it is bound (by an earlier attempt, or another
        writer) or when it changed (409: try again); otherwise BindError. The assumption is taken
        back unless the Binding took effect. A refusal (4xx but 409/429) changed nothing. With no
        answer (429, 5xx, timeouts) the Binding may yet land: a PATCH with its resourceVersion as
        precondition first makes any late arrival fail; if even that cannot be done, the assignment
        stays held (see `settle_doubtful`)."""
        why = f"Binding pod {req.key} to node {args.node} failed: {api_reason(err)}"
        conflict = err.status == 409
        if 400 <= (err.status or 0) < 500 and not conflict and err.status != 429:
            self.view.unassume(req.key, req.uid, a)
            if err.status == 404:
                raise WireError(f"pod {args.key} not found", 404) from err
            raise BindError(why, "binding") from err
        try:
            pod = self.settle(args.pod_namespace, args.pod_name, req.uid, rv, fence=not conflict)
        except ApiException as e2:
            if conflict:  # refused: it never took effect
                self.view.unassume(req.key, req.uid, a)
                raise BindError(f"{why}; cannot read the pod again: {api_reason(e2)}", "binding") from err
            self.view.locks.hold_doubtful(req.key, req.uid, rv)
            raise BindError(f"{why}; its outcome is not known yet ({api_reason(e2)})", "binding") from err
        pod = self._judge(args, req, a, pod, why)
        if pod is None or conflict or (pod.get("spec") or {}).get("nodeName"):
            return pod
        raise BindError(why, "binding") from err

    def settle(self, ns: str, name: str, uid: str, rv: str, fence: bool) -> dict[str, Any] | None:
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

    def _judge(
        self, args: BindArgs, req: PodRequest, a: Assignment, pod: dict[str, Any] | None, why: str
    ) -> dict[str, Any] | None:
        """What `outcome` makes of the pod as `settle` found it."""
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
        for key, uid, rv in self.view.locks.doubtful_items():
            try:
                self._settle_doubt(key, uid, rv)
            except ApiException as e:
                log.info("pod %s: outcome of its Binding still unknown: %s", key, api_reason(e))
                continue
            n += 1
        return n

    def _settle_doubt(self, key: str, uid: str, rv: str) -> None:
        ns, name = key.split("/", 1)
        self.view.resolve_doubtful(key, uid, self.settle(ns, name, uid, rv, fence=True))

    def before_rebind(self, req: PodRequest) -> None:
        """A pod whose earlier Binding's outcome is unknown is settled before it is bound again:
        otherwise that Binding could still land after this bind gave up, with no GPU charged."""
        with self.view.lock:
            doubt = self.view.locks.doubtful.get(req.key)
        if doubt is None or doubt[0] != req.uid:
            return
        try:
            self._settle_doubt(req.key, doubt[0], doubt[1])
        except ApiException as e:
            raise BindError(
                f"pod {req.key}: the outcome of its earlier Binding is still unknown ({api_reason(e)})",
                "binding",
            ) from e
