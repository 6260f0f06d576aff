"""The device plugin's few Kubernetes API calls, through the official client.

Pods are read as API JSON dicts (camelCase, what gpupack.handoff expects) without building
client models, and patched as JSON merge patches with a resourceVersion precondition.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

MERGE_PATCH = "application/merge-patch+json"
# Allocate makes a LIST and a PATCH: both bounded, so a slow API server fails the kubelet's Allocate
# (it retries admission) instead of holding the node's handoff for minutes.
TIMEOUT_S = 4


class KubeError(RuntimeError):
    pass


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (flag, $KUBECONFIG, ~/.kube/config)."""
    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            return config.new_client_from_config()
    except (config.ConfigException, OSError) as e:
        raise KubeError(f"cannot configure the Kubernetes client: {e}") from e


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)

    def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False, _request_timeout=TIMEOUT_S
        )
        return list(json.loads(resp.data).get("items", []))

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = self.core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=TIMEOUT_S)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str = ""
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"annotations": annotations}
        if resource_version:
            meta["resourceVersion"] = resource_version  # 409 Conflict if the pod changed meanwhile
        resp = self.core.patch_namespaced_pod(
            name, namespace, {"metadata": meta}, _content_type=MERGE_PATCH,
            _preload_content=False, _request_timeout=TIMEOUT_S,
        )
        return json.loads(resp.data)

    def patch_node(self, node: str, labels: dict[str, str], annotations: dict[str, str]) -> None:
        self.core.patch_node(
            node, {"metadata": {"labels": labels, "annotations": annotations}},
            _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=TIMEOUT_S,
        )
