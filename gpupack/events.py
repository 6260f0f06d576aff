"""Kubernetes Events gpupack's components leave on pods and nodes: the defrag run on the pods it
moves and the nodes it frees, the extender on a pod whose GPU handoff it had to give up.

Best effort by design: an Event that cannot be written is logged, never a reason to stop the work
it reports. Node events go to the `default` namespace, as the kubelet's do.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from gpupack.kubeclient import ApiException, KubeClient

log = logging.getLogger("gpupack.events")


class EventRecorder:
    def __init__(self, kc: KubeClient | None, instance: str, component: str = "gpupack-defrag") -> None:
        self.kc = kc
        self.instance = instance
        self.component = component
        self.written = 0

    def _emit(
        self, namespace: str, kind: str, name: str, uid: str, reason: str, message: str, warning: bool
    ) -> None:
        if self.kc is None:
            return
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": kind,
                "name": name,
                "namespace": namespace if kind == "Pod" else "",
                "uid": uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        if kind != "Pod":
            del body["involvedObject"]["namespace"]
        try:
            self.kc.json(self.kc.core.create_namespaced_event, namespace, body)
            self.written += 1
        except ApiException as e:
            log.warning("could not record event %s on %s %s: %s %s", reason, kind, name, e.status, e.reason)

    def pod(
        self, namespace: str, name: str, uid: str, reason: str, message: str, warning: bool = False
    ) -> None:
        self._emit(namespace, "Pod", name, uid, reason, message, warning)

    def node(self, name: str, uid: str, reason: str, message: str, warning: bool = False) -> None:
        self._emit("default", "Node", name, uid, reason, message, warning)
