"""Which Pod object a bind works from: the one its filter was sent (kept briefly), or a fresh
read when that is not the pod being bound."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import orjson
from kubernetes.client.rest import ApiException

from gpupack.contract import ANN_ASSIGNMENT
from gpupack.kubeclient import api_reason

from ..api.kube import Kube
from ..api.lease import BindError
from ..api.wire import BindArgs, WireError
from ..state.node_resources import HostedPodRequest
from .collector import VerbActivity

POD_MEMORY = 4096  # filtered pods kept for their bind
# ...and at most this many bytes of them (as JSON). A tenant's pod may carry ~1.5 MB (annotations,
# the API server's request limit), and pods that cannot be placed are filtered again and again:
# 4,096 of them would hold gigabytes. A pod pushed out costs its bind one read of the pod.
POD_MEMORY_BYTES = 32 << 20


def read_pod(kube: Kube, activity: VerbActivity, args: BindArgs) -> dict[str, Any]:
    """The pod to bind as the API server has it now; WireError 404 when gone, BindError when it was
    recreated (another UID) or is being deleted."""
    try:
        activity.wait_quiet()
        pod = kube.get_pod(args.pod_namespace, args.pod_name)
    except ApiException as e:
        if e.status == 404:
            raise WireError(f"pod {args.key} not found", 404) from e
        raise BindError(f"could not read pod {args.key}: {api_reason(e)}", "api") from e
    uid = (pod.get("metadata") or {}).get("uid", "")
    if args.pod_uid and uid != args.pod_uid:
        raise BindError(f"pod {args.key} was recreated (UID {uid}; bind was for {args.pod_uid})", "pod-gone")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        raise BindError(f"pod {args.key} is being deleted", "pod-gone")
    return pod


class PodMemory:
    """uid -> the Pod kube-scheduler sent with its last filter: the bind that follows uses it
    instead of reading the pod again (the Binding's resourceVersion precondition still catches any
    change since), one API round trip less per pod."""

    def __init__(self, size: int = POD_MEMORY, max_bytes: int = POD_MEMORY_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        # uid -> the pod, its request as the filter parsed it (a bind's hold and fit need it;
        # parsing the pod again, containers, quantities and host use, was a third of a bind's CPU),
        # and its size as JSON (~3 us to measure for a 3 KB pod)
        self._pods: OrderedDict[str, tuple[dict[str, Any], HostedPodRequest | None, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def remember(self, pod: dict[str, Any], request: HostedPodRequest | None = None) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        # a pod with an assignment may just have been cleaned (its resourceVersion changed): read it
        if not uid or not meta.get("resourceVersion") or ANN_ASSIGNMENT in (meta.get("annotations") or {}):
            return
        size = len(orjson.dumps(pod))
        if size > self.max_bytes // 4:
            self.forget(uid)  # one pod must not push out most of the others: its bind reads it
            return
        with self._lock:
            old = self._pods.pop(uid, None)
            if old is not None:
                self.bytes -= old[2]
            self._pods[uid] = (pod, request, size)
            self.bytes += size
            while len(self._pods) > self.size or self.bytes > self.max_bytes:
                self.bytes -= self._pods.popitem(last=False)[1][2]

    def forget(self, uid: str) -> None:
        """The pod `uid` is bound or gone (the pending-pod watch no longer shows it): its bind, if
        any, came already. So a pod filtered and then deleted is not kept for the LRU to push out."""
        with self._lock:
            old = self._pods.pop(uid, None)
            if old is not None:
                self.bytes -= old[2]

    def __len__(self) -> int:
        return len(self._pods)

    def recall(self, args: BindArgs) -> tuple[dict[str, Any] | None, HostedPodRequest | None]:
        """The pod as its last filter saw it when that is the pod being bound (taken out), and the
        request the filter parsed from it (None: not parsed); (None, None) when there is none."""
        with self._lock:
            kept = self._pods.pop(args.pod_uid, None) if args.pod_uid else None
            if kept is not None:
                self.bytes -= kept[2]
        pod, request = (kept[0], kept[1]) if kept is not None else (None, None)
        meta = (pod or {}).get("metadata") or {}
        if (
            pod is None
            or meta.get("name") != args.pod_name
            or (meta.get("namespace") or "default") != args.pod_namespace
            or meta.get("deletionTimestamp")
            or (pod.get("spec") or {}).get("nodeName")
        ):
            return None, None
        return pod, request
