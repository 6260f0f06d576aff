"""Defrag does not trust the managed label either: a pod that still carries its assignment but
lost gpupack.io/managed keeps its GPU in defrag's snapshot (real kube-apiserver), so no move is
planned onto an occupied GPU (issue 11: "the extender and defrag free the share")."""

from __future__ import annotations

import deploy_objects
from realk8s import ControlPlane

from extender.controllers.defrag.cli import _snapshot
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_INVENTORY,
    LABEL_MANAGED,
    Assignment,
    GPUInfo,
    GPUShare,
    NodeInventory,
)
from gpupack.kubeclient import KubeClient


def test_a_pod_without_the_label_but_with_its_assignment_holds_its_gpu(cluster: ControlPlane):
    sfx = deploy_objects.suffix()
    ns, node = f"dfg-{sfx}", f"dfg-{sfx}"
    cluster.ensure_namespace(ns)
    gpu = GPUInfo(uuid=f"GPU-{sfx}", index=0, model="NVIDIA-H100", mem_mib=81559, sm_count=132)
    cluster.make_node(node, extended={"gpupack.io/gpu": "16"},
                      annotations={ANN_INVENTORY: NodeInventory(gpus=(gpu,)).to_json()})  # fmt: skip
    limits = {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "60000"}
    for name, labelled in (("kept", True), ("stripped", False)):
        pod = cluster.core.create_namespaced_pod(ns, {"metadata": {"name": name}, "spec": {
            "nodeName": node, "schedulerName": "gpupack-scheduler",
            "containers": [{"name": "a", "image": "registry.invalid/x:1", "resources": {"limits": limits}}]}})  # fmt: skip
        a = Assignment(pod_uid=pod.metadata.uid, node=node, pod_class="online",
                       containers={"a": (GPUShare(uuid=gpu.uuid, index=0, mem_mib=30000, sm_pct=0),)})  # fmt: skip
        labels = {LABEL_MANAGED: "true"} if labelled else {}
        cluster.core.patch_namespaced_pod(name, ns, {"metadata": {"labels": labels,
                                                                  "annotations": {ANN_ASSIGNMENT: a.to_json()}}})  # fmt: skip
    snap = _snapshot(KubeClient(cluster.new_api_client()))
    assert {f"{ns}/kept", f"{ns}/stripped"} <= set(snap.state.pods)
    assert snap.state.nodes[node].gpus[0].mem_used == 60000, snap.state.nodes[node].gpus[0]
