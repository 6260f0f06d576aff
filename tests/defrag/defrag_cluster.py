"""A small GPU cluster on the real control plane, in the state a past scheduler left it.

Workloads are real apps/v1 ReplicaSets or Deployments (and DaemonSets, Jobs, bare pods where a
test is about who may move): the real kube-controller-manager creates their pods and recreates an
evicted one under a new name. `place` puts such a pod on chosen GPUs the way the extender's bind
and the device plugin leave it (assignment annotation + managed label, handoff done, then
pods/binding) and writes the status a kubelet would (Running, Ready). PodDisruptionBudgets are
real; their status comes from the real disruption controller.

`Scheduling` runs what places a replacement in production: the real kube-scheduler with
deploy/scheduler/config.yaml (only the extender's urlPrefix changed), the real extender, and a
KubeletEmulator whose admit step does what the device plugin's Allocate does to the pod.

Every name a test sees is suffixed with the fleet's tag, so tests sharing the control plane
never meet. Scheduling's kube-scheduler sees every namespace, and an earlier test's controllers
keep recreating pods (Pending, for gpupack-scheduler) until its namespace is gone, which
`ControlPlane.reset` does not wait for: the fleet's nodes carry a NoSchedule taint that only the
fleet's own pod templates tolerate, so such a pod is never placed on them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import realk8s
from kubernetes import client
from processes import ExtenderProcess
from realk8s import ControlPlane, KubeletEmulator, running_ready_status, until

from gpupack.contract import (
    ANN_ALLOCATED,
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
    decode_assignment,
)

MIB = 81559
LEASE = "gpupack-defrag"
FLEET_TAINT = "test.gpupack.io/fleet"


def gpu_container(mem: int, sm: int, name: str = "main") -> dict[str, Any]:
    limits = {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": str(mem), "gpupack.io/gpu-sm": str(sm)}
    return {
        "name": name,
        "image": "registry.invalid/x:1",
        "resources": {"limits": limits, "requests": dict(limits)},
    }


def raw(resp: Any) -> Any:
    return json.loads(resp.data)


class Fleet:
    """One test's namespaces, nodes and workloads on the shared control plane."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.tag = secrets.token_hex(3)
        self.api = cp.api_client()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.lease_ns = self.namespace("gpupack-system")  # where the run's Lease lives
        self.taint = {"key": FLEET_TAINT, "value": self.tag, "effect": "NoSchedule"}

    # --- names ---------------------------------------------------------------------------------
    def namespace(self, base: str) -> str:
        name = f"{base}-{self.tag}"
        self.cp.ensure_namespace(name)
        return name

    def node(self, base: str, gpus: int = 4, mem: int = MIB) -> str:
        """A Ready node with `gpus` H100s in its inventory, as the device plugin publishes it."""
        name = f"{base}-{self.tag}"
        inv = NodeInventory(
            gpus=tuple(GPUInfo(f"GPU-{name}-{i}", i, "NVIDIA-H100-80GB-HBM3", mem, 132) for i in range(gpus))
        )
        self.cp.make_node(
            name,
            extended={"gpupack.io/gpu": str(16 * gpus)},
            labels={"gpupack.io/gpu-node": "true"},
            annotations={ANN_INVENTORY: inv.to_json()},
        )
        self.core.patch_node(name, {"spec": {"taints": [self.taint]}})
        return name

    # --- workloads -----------------------------------------------------------------------------
    def template(self, app: str, mem: int, sm: int, cls: str, restart: str = "Always") -> dict[str, Any]:
        return {
            "metadata": {"labels": {"app": app, LABEL_CLASS: cls}},
            "spec": {
                "schedulerName": SCHEDULER_NAME,
                "restartPolicy": restart,
                "terminationGracePeriodSeconds": 30,
                "tolerations": [
                    {"key": FLEET_TAINT, "operator": "Equal", "value": self.tag, "effect": "NoSchedule"}
                ],
                "containers": [gpu_container(mem, sm)],
            },
        }

    def pods_owned(self, ns: str, kind: str, name: str) -> list[dict[str, Any]]:
        out = []
        for p in raw(self.core.list_namespaced_pod(ns, _preload_content=False))["items"]:
            refs = p["metadata"].get("ownerReferences") or []
            if any(r.get("controller") and r["kind"] == kind and r["name"] == name for r in refs):
                out.append(p)
        return out

    def _wait_pods(self, ns: str, kind: str, name: str, n: int) -> list[str]:
        def ready() -> list[str]:
            pods = [p for p in self.pods_owned(ns, kind, name) if not p["metadata"].get("deletionTimestamp")]
            return sorted(p["metadata"]["name"] for p in pods) if len(pods) == n else []

        return until(ready, 30, f"{n} pod(s) of {kind} {ns}/{name}")

    def replicaset(
        self, ns: str, name: str, mem: int, sm: int, cls: str = "offline", replicas: int = 1
    ) -> list[str]:
        """A real ReplicaSet; returns its pods' names (created by the real controller)."""
        self.apps.create_namespaced_replica_set(ns, {
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": self.template(name, mem, sm, cls)},
        })  # fmt: skip
        return self._wait_pods(ns, "ReplicaSet", name, replicas)

    def deployment(
        self, ns: str, name: str, mem: int, sm: int, cls: str = "offline", replicas: int = 1
    ) -> tuple[str, list[str]]:
        """A real Deployment; returns (its ReplicaSet's name, that ReplicaSet's pods)."""
        self.apps.create_namespaced_deployment(ns, {
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": self.template(name, mem, sm, cls)},
        })  # fmt: skip

        def rs() -> str:
            items = self.apps.list_namespaced_replica_set(ns, label_selector=f"app={name}").items
            return items[0].metadata.name if len(items) == 1 else ""

        rs_name = until(rs, 30, f"the ReplicaSet of Deployment {ns}/{name}")
        return rs_name, self._wait_pods(ns, "ReplicaSet", rs_name, replicas)

    def statefulset(self, ns: str, name: str, mem: int, sm: int, cls: str = "offline") -> str:
        """A real StatefulSet of one replica; returns its pod's name (`name`-0; a replacement keeps
        the name and gets a new UID, and only once the old pod is gone)."""
        self.apps.create_namespaced_stateful_set(ns, {
            "metadata": {"name": name},
            "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": {"app": name}},
                     "template": self.template(name, mem, sm, cls)},
        })  # fmt: skip
        return self._wait_pods(ns, "StatefulSet", name, 1)[0]

    def daemonset(self, ns: str, name: str, node: str, mem: int, sm: int, cls: str = "offline") -> str:
        """A real DaemonSet limited to `node`; returns its one pod's name."""
        tpl = self.template(name, mem, sm, cls)
        tpl["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        self.apps.create_namespaced_daemon_set(ns, {
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": name}}, "template": tpl},
        })  # fmt: skip
        return self._wait_pods(ns, "DaemonSet", name, 1)[0]

    def job(self, ns: str, name: str, mem: int, sm: int, cls: str = "offline") -> str:
        """A real Job of one pod; returns the pod's name."""
        self.batch.create_namespaced_job(ns, {
            "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": self.template(name, mem, sm, cls, restart="Never")},
        })  # fmt: skip
        return self._wait_pods(ns, "Job", name, 1)[0]

    def bare_pod(self, ns: str, name: str, mem: int, sm: int, cls: str = "offline") -> str:
        tpl = self.template(name, mem, sm, cls)
        self.core.create_namespaced_pod(
            ns, {"metadata": {"name": name, **tpl["metadata"]}, "spec": tpl["spec"]}
        )
        return name

    def place(self, ns: str, name: str, node: str, gpu: int, mem: int, sm: int) -> None:
        """What the extender's bind, the device plugin and the kubelet leave: the assignment and a
        finished handoff, the Binding, then Running and Ready."""
        pod = self.core.read_namespaced_pod(name, ns)
        a = Assignment(
            pod_uid=pod.metadata.uid,
            node=node,
            pod_class=pod.metadata.labels[LABEL_CLASS],
            containers={"main": (GPUShare(f"GPU-{node}-{gpu}", gpu, mem, sm),)},
            bound_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.core.patch_namespaced_pod(name, ns, {"metadata": {
            "labels": {LABEL_MANAGED: "true"},
            "annotations": {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE, ANN_ALLOCATED: '["main"]'},
        }})  # fmt: skip
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, namespace=ns),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        self.core.create_namespaced_pod_binding(name, ns, body, _preload_content=False)
        self.core.patch_namespaced_pod_status(name, ns, running_ready_status(pod))

    def pdb(self, ns: str, app: str, min_available: int, expect_allowed: int) -> None:
        """A real PodDisruptionBudget, returned once the disruption controller has computed it."""
        name = f"{app}-pdb"
        self.policy.create_namespaced_pod_disruption_budget(ns, {
            "metadata": {"name": name},
            "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app}}},
        })  # fmt: skip

        def computed() -> bool:
            p = self.policy.read_namespaced_pod_disruption_budget(name, ns)
            st = p.status
            return bool(
                st is not None
                and (st.observed_generation or 0) >= (p.metadata.generation or 0)
                and st.expected_pods == st.current_healthy >= 1
                and st.disruptions_allowed == expect_allowed
            )

        until(computed, 30, f"the disruption controller to compute PDB {ns}/{name}")

    # --- reading -------------------------------------------------------------------------------
    def pods(self, ns: str) -> dict[str, dict[str, Any]]:
        items = raw(self.core.list_namespaced_pod(ns, _preload_content=False))["items"]
        return {f"{ns}/{p['metadata']['name']}": p for p in items}

    def node_annotations(self, node: str) -> dict[str, str]:
        return raw(self.core.read_node(node, _preload_content=False))["metadata"].get("annotations") or {}

    def defrag_events(self, *namespaces: str) -> list[dict[str, Any]]:
        """Events gpupack defrag wrote in these namespaces (node events are in `default`)."""
        out = []
        for ns in (*namespaces, "default"):
            for e in raw(self.core.list_namespaced_event(ns, _preload_content=False))["items"]:
                if (e.get("source") or {}).get("component") != "gpupack-defrag":
                    continue
                obj = e.get("involvedObject") or {}
                if ns == "default" and not obj.get("name", "").endswith(self.tag):
                    continue  # another test's node
                out.append(e)
        return out

    def lease(self) -> dict[str, Any] | None:
        try:
            return raw(self.coord.read_namespaced_lease(LEASE, self.lease_ns, _preload_content=False))
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise


def allocate(core: client.CoreV1Api, pod: Any) -> None:
    """The device plugin's side of the handoff, for a KubeletEmulator's on_admit: what
    deviceplugin/allocate.py leaves on the pod once the kubelet has called Allocate for each GPU
    container (the extender holds the node's next bind until the handoff is done). Like the plugin,
    a 409 (the pod changed between the read and the write) means: read it again and retry."""
    meta = pod.metadata
    for _attempt in range(5):
        cur = raw(core.read_namespaced_pod(meta.name, meta.namespace, _preload_content=False))
        ann = cur["metadata"].get("annotations") or {}
        if ann.get(ANN_HANDOFF) != "pending" or cur["metadata"]["uid"] != meta.uid:
            return
        a = decode_assignment(ann[ANN_ASSIGNMENT], meta.name)
        assert a.node == cur["spec"]["nodeName"] and a.pod_uid == meta.uid, f"assignment of {meta.name}: {a}"
        gpu = [
            c["name"]
            for c in cur["spec"]["containers"]
            if "gpupack.io/gpu" in (c.get("resources") or {}).get("limits", {})
        ]
        assert set(gpu) <= set(a.containers), f"{meta.name}: containers {gpu} vs assignment {a.containers}"
        try:
            core.patch_namespaced_pod(meta.name, meta.namespace, {"metadata": {
                "resourceVersion": cur["metadata"]["resourceVersion"],
                "annotations": {ANN_ALLOCATED: json.dumps(gpu, separators=(",", ":")), ANN_HANDOFF: HANDOFF_DONE},
            }})  # fmt: skip
            return
        except client.ApiException as e:
            if e.status != 409:
                raise
    raise AssertionError(f"pod {meta.name} kept changing while its handoff was recorded (409 x5)")


def running_not_ready_status(pod: Any) -> dict[str, Any]:
    """A kubelet's status for a pod whose containers started but do not pass readiness yet."""
    st = running_ready_status(pod)
    for c in st["status"]["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c["status"] = "False"
    for cs in st["status"]["containerStatuses"]:
        cs["ready"] = False
    return st


class Scheduling:
    """The production path for replacements: real kube-scheduler (deploy/scheduler/config.yaml,
    extender URL changed), the real extender, and kubelets (KubeletEmulator + `allocate`)."""

    def __init__(
        self,
        cp: ControlPlane,
        tmp: Path,
        namespace: str,
        admit: Callable[[client.CoreV1Api, Any], None] = allocate,
        ready: bool = True,
    ) -> None:
        """`admit(core, pod)` is the node's side before the kubelet's status write (default: the
        device plugin's handoff); with `ready=False` the emulated kubelet writes no status."""
        self.cp = cp
        kc = cp.write_kubeconfig(tmp / "extender.kubeconfig")
        self.extender = ExtenderProcess(kc, tmp / "extender.log")
        self.scheduler = None
        self.kubelets = None
        try:
            self.extender.wait_ready()
            self.scheduler = cp.start_scheduler(
                realk8s.gpupack_scheduler_config(self.extender.url), name=f"kube-scheduler-{namespace}"
            )
            core = client.CoreV1Api(cp.new_api_client())
            self.kubelets = KubeletEmulator(cp, namespace, on_admit=lambda p: admit(core, p), ready=ready)
            self.kubelets.start()
        except BaseException:
            self.stop()
            raise

    def logs(self) -> str:
        sched = self.scheduler.tail() if self.scheduler else ""
        errs = self.kubelets.errors if self.kubelets else []
        return f"extender:\n{self.extender.tail()}\nscheduler:\n{sched}\nkubelets: {errs}"

    def stop(self) -> None:
        if self.kubelets is not None:
            self.kubelets.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.extender.stop()
