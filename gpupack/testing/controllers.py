"""Tiny controllers for tests against the in-test API server, talking the official client.

- `ReplicaSetController`: creates an apps/v1 ReplicaSet object and keeps `replicas` pods owned by
  it (ownerReferences with controller: true), recreating one whenever a pod is deleted or evicted.
- `PodRunner`: plays the kubelets: marks pods Running and Ready once they are bound to a node.
- `mark_pod_running_ready()`: the same for one pod.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from gpupack.testing.kubeapi import KubeAPIServer


def _api_client(target: Any) -> client.ApiClient:
    return target.api_client() if isinstance(target, KubeAPIServer) else target


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def running_ready_status(pod: dict[str, Any] | None = None, pod_ip: str = "10.0.0.1") -> dict[str, Any]:
    """The .status a kubelet reports for a started pod whose containers are all ready."""
    ts = _now()
    containers = [
        c.get("name", "c") for c in ((pod or {}).get("spec") or {}).get("containers") or [{"name": "c"}]
    ]
    return {
        "phase": "Running",
        "podIP": pod_ip,
        "startTime": ts,
        "conditions": [
            {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": ts}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "containerStatuses": [
            {
                "name": name,
                "ready": True,
                "started": True,
                "restartCount": 0,
                "image": "image",
                "imageID": "",
                "state": {"running": {"startedAt": ts}},
            }
            for name in containers
        ],
    }


def mark_pod_running_ready(target: Any, namespace: str, name: str) -> Any:
    """Patch pods/status (strategic merge, as the kubelet does) to Running + Ready; returns the V1Pod."""
    core = client.CoreV1Api(_api_client(target))
    pod = core.read_namespaced_pod(name, namespace)
    raw = core.api_client.sanitize_for_serialization(pod)
    return core.patch_namespaced_pod_status(name, namespace, {"status": running_ready_status(raw)})


class _Loop:
    """A background thread that reconciles, then waits for a pod event (or a timeout) and repeats."""

    def __init__(self, target: Any, namespace: str | None, label_selector: str | None) -> None:
        self.api = _api_client(target)
        self.core = client.CoreV1Api(self.api)
        self.namespace = namespace
        self.label_selector = label_selector
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: watch.Watch | None = None
        self._kick = threading.Event()

    def reconcile(self) -> str:  # returns the list resourceVersion to watch from
        raise NotImplementedError

    def _list(self, **kwargs: Any) -> Any:
        if self.namespace is None:
            return self.core.list_pod_for_all_namespaces(label_selector=self.label_selector, **kwargs)
        return self.core.list_namespaced_pod(self.namespace, label_selector=self.label_selector, **kwargs)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self.reconcile()
                if self._stop.is_set():
                    return
                self._watch = watch.Watch()
                kwargs: dict[str, Any] = {
                    "resource_version": rv,
                    "timeout_seconds": 1,
                    "label_selector": self.label_selector,
                }
                func: Callable[..., Any] = self.core.list_pod_for_all_namespaces
                args: tuple[Any, ...] = ()
                if self.namespace is not None:
                    func, args = self.core.list_namespaced_pod, (self.namespace,)
                for _event in self._watch.stream(func, *args, **kwargs):
                    break  # something changed: reconcile from a fresh list
            except ApiException as exc:
                if exc.status != 410 and not self._stop.is_set():
                    self.errors.append(exc)
                    self._stop.wait(0.1)
            except Exception as exc:  # keep the loop alive; the test can inspect .errors
                if self._stop.is_set():
                    return
                self.errors.append(exc)
                self._stop.wait(0.1)

    def start(self) -> _Loop:
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> _Loop:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ReplicaSetController(_Loop):
    def __init__(
        self, target: Any, namespace: str, name: str, template: dict[str, Any], replicas: int = 1
    ) -> None:
        template = copy.deepcopy(template)
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        if not labels:
            labels["app"] = name
        super().__init__(target, namespace, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
        self.name = name
        self.replicas = replicas
        self.template = template
        self.created: list[str] = []  # names of every pod this controller created, in order
        self._status: dict[str, int] = {}
        apps = client.AppsV1Api(self.api)
        body = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)}, "template": template},
        }
        rs = apps.create_namespaced_replica_set(namespace, body)
        self.uid = rs.metadata.uid

    def owned(self, pods: Iterable[Any]) -> list[Any]:
        return [
            p
            for p in pods
            if any(r.uid == self.uid and r.controller for r in p.metadata.owner_references or [])
            and not p.metadata.deletion_timestamp
            and p.status.phase not in ("Succeeded", "Failed")
        ]

    def reconcile(self) -> str:
        listing = self._list()
        alive = self.owned(listing.items)
        for _ in range(self.replicas - len(alive)):
            pod = copy.deepcopy(self.template)
            meta = pod.setdefault("metadata", {})
            meta.pop("name", None)
            meta["generateName"] = f"{self.name}-"
            meta["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": self.name,
                    "uid": self.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            created = self.core.create_namespaced_pod(self.namespace, pod)
            self.created.append(created.metadata.name)
        for extra in alive[self.replicas :]:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(extra.metadata.name, self.namespace)
        self._publish_status(alive)
        return listing.metadata.resource_version

    def _publish_status(self, alive: list[Any]) -> None:
        ready = sum(
            1
            for p in alive
            if p.status.phase == "Running"
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        )
        status = {
            "replicas": min(len(alive), self.replicas),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if status != self._status:
            with contextlib.suppress(ApiException):
                client.AppsV1Api(self.api).patch_namespaced_replica_set_status(
                    self.name, self.namespace, {"status": status}
                )
                self._status = status

    def pod_names(self) -> list[str]:
        return sorted(p.metadata.name for p in self.owned(self._list().items))


class PodRunner(_Loop):
    """Marks bound pods Running + Ready, as their kubelets would (optionally only some nodes)."""

    def __init__(self, target: Any, namespace: str | None = None, nodes: Iterable[str] | None = None) -> None:
        super().__init__(target, namespace, None)
        self.nodes = set(nodes) if nodes is not None else None

    def reconcile(self) -> str:
        listing = self._list()
        for pod in listing.items:
            node = pod.spec.node_name
            if (
                not node
                or (self.nodes is not None and node not in self.nodes)
                or pod.status.phase != "Pending"
            ):
                continue
            if pod.metadata.deletion_timestamp:
                continue
            with contextlib.suppress(ApiException):
                mark_pod_running_ready(self.api, pod.metadata.namespace, pod.metadata.name)
        return listing.metadata.resource_version
