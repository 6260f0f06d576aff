"""A small GPU cluster in the in-test API server, in the state a past scheduler left it.

ReplicaSets are real apps/v1 objects kept by `ReplicaSetController` (a deleted or evicted pod
comes back under a new name); their pods are placed on chosen GPUs the way the extender's bind
does it (assignment annotation + managed label, then pods/binding) and marked Running as a
kubelet would. `SchedulerLoop` plays kube-scheduler against the real extender over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

import requests
from kubernetes import client
from processes import ExtenderProcess

from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    LABEL_CLASS,
    LABEL_MANAGED,
    SCHEDULER_NAME,
    Assignment,
    GPUInfo,
    GPUShare,
    NodeInventory,
)
from gpupack.testing.controllers import ReplicaSetController, mark_pod_running_ready
from gpupack.testing.kubeapi import KubeAPIServer

__all__ = ["ExtenderProcess"]  # re-exported for the defrag tests

MIB = 81559


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def gpu_container(mem: int, sm: int, name: str = "main") -> dict[str, Any]:
    limits = {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": str(mem), "gpupack.io/gpu-sm": str(sm)}
    return {"name": name, "image": "registry.invalid/x:1", "resources": {"limits": limits, "requests": dict(limits)}}


class Cluster:
    def __init__(self, server: KubeAPIServer) -> None:
        self.server = server
        self.api = server.api_client()
        self.core = client.CoreV1Api(self.api)
        self.controllers: dict[str, ReplicaSetController] = {}

    def namespace(self, name: str) -> None:
        if self.server.get("namespaces", name) is None:
            self.server.create("namespaces", {"metadata": {"name": name}})

    def node(self, name: str, gpus: int = 4, mem: int = MIB) -> None:
        inv = NodeInventory(
            gpus=tuple(GPUInfo(f"GPU-{name}-{i}", i, "NVIDIA-H100-80GB-HBM3", mem, 132) for i in range(gpus))
        )
        self.server.create(
            "nodes",
            {"metadata": {"name": name, "annotations": {ANN_INVENTORY: inv.to_json()}}, "spec": {}},
        )

    def template(self, app: str, mem: int, sm: int, cls: str) -> dict[str, Any]:
        return {
            "metadata": {"labels": {"app": app, LABEL_CLASS: cls}},
            "spec": {"schedulerName": SCHEDULER_NAME, "containers": [gpu_container(mem, sm)]},
        }

    def replicaset(self, ns: str, name: str, mem: int, sm: int, cls: str = "offline", replicas: int = 1) -> list[str]:
        self.namespace(ns)
        rs = ReplicaSetController(self.server, ns, name, self.template(name, mem, sm, cls), replicas).start()
        self.controllers[f"{ns}/{name}"] = rs
        return wait_for(lambda: len(rs.pod_names()) == replicas and rs.pod_names(), what=f"{name} pods")

    def bare_pod(self, ns: str, name: str, mem: int, sm: int, cls: str = "offline", owner: tuple[str, str] | None = None) -> str:
        self.namespace(ns)
        pod = {"metadata": {"name": name, "namespace": ns, **self.template(name, mem, sm, cls)["metadata"]},
               "spec": self.template(name, mem, sm, cls)["spec"]}
        if owner is not None:
            pod["metadata"]["ownerReferences"] = [
                {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "uid": f"uid-{owner[1]}", "controller": True}
            ]
        self.server.create("pods", pod, ns)
        return name

    def place(self, ns: str, name: str, node: str, gpu: int, mem: int, sm: int) -> None:
        """What the extender's bind leaves: the assignment, then the Binding; then Running."""
        pod = self.server.get("pods", name, ns)
        assert pod is not None
        a = Assignment(
            pod_uid=pod["metadata"]["uid"],
            node=node,
            pod_class=pod["metadata"]["labels"][LABEL_CLASS],
            containers={"main": (GPUShare(f"GPU-{node}-{gpu}", gpu, mem, sm),)},
            bound_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.server.patch(
            "pods", name,
            {"metadata": {"labels": {LABEL_MANAGED: "true"},
                          "annotations": {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}}},
            ns,
        )
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, namespace=ns),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        self.core.create_namespaced_pod_binding(name, ns, body, _preload_content=False)
        mark_pod_running_ready(self.api, ns, name)

    def pdb(self, ns: str, app: str, min_available: int = 1) -> None:
        self.server.create(
            "poddisruptionbudgets",
            {"metadata": {"name": f"{app}-pdb", "namespace": ns},
             "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app}}}},
            ns,
        )

    def pods(self, ns: str | None = None) -> dict[str, dict[str, Any]]:
        return {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in self.server.list("pods", ns)}

    def events(self) -> list[dict[str, Any]]:
        return self.server.list("events")

    def stop(self) -> None:
        for c in self.controllers.values():
            c.stop()


class SchedulerLoop:
    """kube-scheduler for gpupack pods: filter at the extender, then bind through it; plays the
    kubelet too (handoff done, then Running), so a replacement pod ends up running."""

    def __init__(self, server: KubeAPIServer, extender_url: str) -> None:
        self.server, self.url = server, extender_url
        self.api = server.api_client()
        self.http = requests.Session()
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.log: list[str] = []

    def _post(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"{self.url}/{verb}", data=json.dumps(body), headers={"Content-Type": "application/json"},
                           timeout=30)
        r.raise_for_status()
        return r.json()

    def run(self) -> None:
        while not self.stop_ev.wait(0.05):
            nodes = sorted(n["metadata"]["name"] for n in self.server.list("nodes"))
            for p in self.server.list("pods"):
                meta, spec = p["metadata"], p["spec"]
                if spec.get("schedulerName") != SCHEDULER_NAME or meta.get("deletionTimestamp"):
                    continue
                if spec.get("nodeName"):
                    ann = meta.get("annotations") or {}
                    if ann.get(ANN_HANDOFF) == "pending":  # the device plugin's Allocate
                        with contextlib.suppress(Exception):
                            self.server.patch("pods", meta["name"], {"metadata": {"annotations": {ANN_HANDOFF: HANDOFF_DONE}}},
                                              meta["namespace"])
                    elif (p.get("status") or {}).get("phase") == "Pending" and ann.get(ANN_HANDOFF) == HANDOFF_DONE:
                        with contextlib.suppress(Exception):
                            mark_pod_running_ready(self.api, meta["namespace"], meta["name"])
                    continue
                try:
                    out = self._post("filter", {"Pod": p, "NodeNames": nodes})
                    ok = out.get("NodeNames") or []
                    if not ok:
                        self.log.append(f"{meta['name']}: unschedulable {out.get('FailedNodes')}")
                        continue
                    res = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                              "PodUID": meta["uid"], "Node": ok[0]})
                    self.log.append(f"{meta['name']} -> {ok[0]} {res.get('Error', '')}")
                except Exception as e:  # noqa: BLE001 - keep scheduling; the test reads .log
                    self.log.append(f"{meta['name']}: {e}")

    def __enter__(self) -> SchedulerLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_ev.set()
        self.thread.join(5)
        self.http.close()


