"""Which Pod object a bind works from: the one its filter was sent (kept briefly), or a fresh
read when that is not the pod being bound."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from kubernetes.client.rest import ApiException

from gpupack.contract import ANN_ASSIGNMENT
from gpupack.kubeclient import api_reason

from .collector import VerbActivity
from .kube import Kube
from .lease import BindError
from .node_resources import HostedPodRequest
from .wire import BindArgs, WireError

POD_MEMORY = 4096  # filtered pods kept for their bind


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

    def __init__(self, size: int = POD_MEMORY) -> None:
        self.size = size
        # uid -> the pod, and its request as the filter parsed it (a bind's hold and fit need it;
        # parsing the pod again, containers, quantities and host use, was a third of a bind's CPU)
        self._pods: OrderedDict[str, tuple[dict[str, Any], HostedPodRequest | None]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, pod: dict[str, Any], request: HostedPodRequest | None = None) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        # a pod with an assignment may just have been cleaned (its resourceVersion changed): read it
        if not uid or not meta.get("resourceVersion") or ANN_ASSIGNMENT in (meta.get("annotations") or {}):
            return
        with self._lock:
            self._pods[uid] = (pod, request)
            self._pods.move_to_end(uid)
            while len(self._pods) > self.size:
                self._pods.popitem(last=False)

    def recall(self, args: BindArgs) -> tuple[dict[str, Any] | None, HostedPodRequest | None]:
        """The pod as its last filter saw it when that is the pod being bound (taken out), and the
        request the filter parsed from it (None: not parsed); (None, None) when there is none."""
        with self._lock:
            pod, request = self._pods.pop(args.pod_uid, (None, None)) if args.pod_uid else (None, None)
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
