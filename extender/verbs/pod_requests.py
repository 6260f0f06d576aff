"""What a pod sent by kube-scheduler asks for: its PodRequest with host resources, or a
PodRequestError the verbs answer with."""

from __future__ import annotations

from typing import Any

from gpupack import handoff
from gpupack.contract import RES_GPU, RES_GPU_MEM, RES_GPU_SM, ContractError
from gpupack.core.request import RequestError, parse_pod

from ..api.kube import Kube
from ..api.wire import PodRequestError
from ..state.hostuse import pod_host_request
from ..state.node_resources import HostedPodRequest, hosted

GPUPACK_RESOURCES = (RES_GPU, RES_GPU_MEM, RES_GPU_SM)


def pod_request(pod: dict[str, Any], kube: Kube | None) -> HostedPodRequest:
    """The pod's request (its class defaulted from its namespace's labels, read through `kube`).
    NamespaceUnreadable propagates: filter answers an Error (retried), never a guessed class."""
    meta = pod.get("metadata") or {}
    ns = meta.get("namespace") or "default"
    ns_labels = kube.namespace_labels(ns) if kube is not None else {}
    try:
        req = parse_pod(pod, ns_labels)
    except (RequestError, ContractError) as e:
        raise PodRequestError(str(e)) from e
    req = hosted(req, pod_host_request(pod))
    if not req.needs_gpu:
        # CPU-only: the policy places it too (on a GPU node it may strand GPUs), by CPU/memory
        return req
    try:
        served_by_kubelet = handoff.gpu_containers(pod)
    except ContractError as e:
        raise PodRequestError(str(e)) from e
    if not served_by_kubelet:
        # The kubelet calls the device plugin only for the resource it registered
        # (gpupack.io/gpu): without it no Allocate ever comes, the handoff would stay pending
        # and block every later GPU pod on the node.
        raise PodRequestError(
            f"pod {req.key}: no container sets {RES_GPU} in its limits, so the kubelet would never "
            f"hand it a GPU; add {RES_GPU}: 1 next to gpu-mem/gpu-sm, or install gpupack's admission "
            "webhook, which adds it"
        )
    return req


def requests_gpupack(pod: dict[str, Any]) -> bool:
    """Whether any container names a gpupack resource (the bind's cheap test for its GPU path; a
    CPU-only pod's bind waits for no handoff and writes no assignment)."""
    spec = pod.get("spec") or {}
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            res = (c.get("resources") or {}) if isinstance(c, dict) else {}
            for part in ("limits", "requests"):
                d = res.get(part) if isinstance(res, dict) else None
                if isinstance(d, dict) and any(r in d for r in GPUPACK_RESOURCES):
                    return True
    return False
