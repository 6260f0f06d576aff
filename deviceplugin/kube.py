"""The device plugin's few Kubernetes API calls, through the official client.

Pods are read as API JSON dicts (camelCase, what gpupack.handoff expects) without building
client models, and patched as JSON merge patches with a resourceVersion precondition.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from gpupack import handoff, kubeclient

# Allocate makes a LIST and a PATCH: both bounded, so a slow API server fails the kubelet's Allocate
# (it retries admission) instead of holding the node's handoff for minutes.
TIMEOUT_S = 4
# A read that timed out is tried again (urllib3 retries idempotent methods only, never the PATCH):
# the kubelet calls Allocate once per container, so one slow answer to the pod list would
# otherwise fail the pod's admission outright.
READ_RETRIES = 3
KubeError = kubeclient.KubeConfigError


_FAILED_WEBHOOK = re.compile(r'failed calling webhook "([^"]+)"')


def webhook_refusal(e: BaseException) -> str:
    """The admission webhook named in an API server's refusal because it could not call it
    (down, or stalled past its timeout, with failurePolicy Fail), else "". On Kubernetes 1.28-1.29
    every write of the plugin goes through gpupack's plugin-node webhook, which fails closed."""
    if not isinstance(e, kubeclient.ApiException) or e.status not in (500, 503, 504):
        return ""
    try:
        message = str(json.loads(e.body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        message = str(e.body or "")
    found = _FAILED_WEBHOOK.search(message)
    return found.group(1) if found else ""


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """The shared loader (gpupack.kubeclient): --kubeconfig, else in-cluster, else the default kubeconfig."""
    return kubeclient.api_client(kubeconfig, retries=READ_RETRIES)


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.kc = kubeclient.KubeClient(api_client, timeout_s=TIMEOUT_S)
        self.core = self.kc.core

    def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        raw = self.kc.json(self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        return list(raw.get("items") or [])

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.kc.json(self.core.read_namespaced_pod, name, namespace)
        except kubeclient.ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str = ""
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"annotations": annotations}
        if resource_version:
            meta["resourceVersion"] = resource_version  # 409 Conflict if the pod changed meanwhile
        return self.kc.merge_patch(self.core.patch_namespaced_pod, name, namespace, {"metadata": meta})

    def fail_handoff(self, pod: handoff.PodView) -> None:
        """Set the pod's handoff failed, unless it changed since `pod` was read (409 Conflict)."""
        self.patch_pod_annotations(
            pod.namespace, pod.name, handoff.failed_annotations(), resource_version=pod.resource_version
        )

    def patch_node(self, node: str, labels: dict[str, str], annotations: dict[str, str]) -> None:
        self.kc.merge_patch(
            self.core.patch_node, node, {"metadata": {"labels": labels, "annotations": annotations}}
        )
