"""The kubelet stand-in (realk8s.KubeletEmulator) and gpupack's device plugin's side of the handoff
(ext_helpers.DevicePluginEmulator) that the tests and the throughput benchmark rely on: admissions
of a burst run side by side, emulators can split the nodes between them, and the plugin's PATCH
from the bound pod it is handed is right when that pod has changed since."""

from __future__ import annotations

import threading
import time

import realk8s
from ext_helpers import DevicePluginEmulator, annotations, container, get_pod, gpu_node, pod_obj
from kubernetes import client

from gpupack.contract import ANN_HANDOFF, HANDOFF_DONE, Assignment, GPUShare
from gpupack.handoff import binding_annotations


def _bind(core: client.CoreV1Api, ns: str, name: str, node: str, ann: dict[str, str] | None = None) -> None:
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "annotations": ann or {}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
    core.create_namespaced_pod_binding(name, ns, body, _preload_content=False).release_conn()


def _pods(core: client.CoreV1Api, ns: str, n: int, gpu: bool = False) -> list[str]:
    names = [f"p{i}" for i in range(n)]
    for name in names:
        pod = pod_obj(name, [container("c", 1, 1024, 10) if gpu else container("c")], namespace=ns)
        pod["spec"]["schedulerName"] = "nobody"  # only this test binds them
        core.create_namespaced_pod(ns, pod, _preload_content=False).release_conn()
    return names


def _running(core: client.CoreV1Api, ns: str) -> set[str]:
    return {p.metadata.name for p in core.list_namespaced_pod(ns).items if p.status.phase == "Running"}


def test_a_burst_is_admitted_side_by_side(cluster: realk8s.ControlPlane, ns: str, sfx: str) -> None:
    """40 pods bound at once are admitted together, not a few at a time: with 8 admissions at once
    a burst's pods waited seconds for each other whatever the admission delay asked."""
    core = cluster.core
    cluster.make_node(f"k-{sfx}")
    names = _pods(core, ns, 40)
    for name in names:
        _bind(core, ns, name, f"k-{sfx}")
    lock = threading.Lock()
    inside, most = [0], [0]

    def hook(pod: client.V1Pod) -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(2.0)  # a slow device plugin: admissions overlap unless they are serialised
        with lock:
            inside[0] -= 1

    with realk8s.KubeletEmulator(cluster, ns, admit_delay=0.5, on_admit=hook) as k:
        realk8s.until(lambda: _running(core, ns) == set(names), 120, "all 40 pods Running")
    assert not k.errors, k.errors
    assert most[0] >= 20, most[0]  # half the burst at once (8 before)


def test_emulators_split_the_nodes(cluster: realk8s.ControlPlane, ns: str, sfx: str) -> None:
    """Two emulators, each serving the nodes `nodes` gives it: every pod is admitted once, by its
    node's emulator."""
    core = cluster.core
    nodes = [f"s{i}-{sfx}" for i in range(4)]
    for n in nodes:
        cluster.make_node(n)
    names = _pods(core, ns, 12)
    seen: list[tuple[int, str]] = []
    ems = [
        realk8s.KubeletEmulator(
            cluster,
            ns,
            on_admit=lambda p, i=i: seen.append((i, p.spec.node_name)),
            nodes=lambda n, i=i: nodes.index(n) % 2 == i,
        )  # fmt: skip
        for i in range(2)
    ]
    for e in ems:
        e.start()
    try:
        for e in ems:
            assert e.watching.wait(30)
        for i, name in enumerate(names):
            _bind(core, ns, name, nodes[i % 4])
        realk8s.until(lambda: _running(core, ns) == set(names), 60, "all 12 pods Running")
    finally:
        for e in ems:
            e.stop()
    assert len(seen) == 12
    assert all(nodes.index(node) % 2 == i for i, node in seen), seen


def test_plugin_patches_from_a_changed_pod(cluster: realk8s.ControlPlane, ns: str, sfx: str) -> None:
    """The plugin writes `done` with the resourceVersion of the pod it is handed; when the pod has
    changed since (409), it reads it again, and a pod whose handoff ended meanwhile is left alone."""
    core = cluster.core
    node = f"g-{sfx}"
    gpu_node(cluster, node)
    names = _pods(core, ns, 2, gpu=True)
    plugin = DevicePluginEmulator(cluster)
    for name in names:
        uid = get_pod(core, ns, name)["metadata"]["uid"]
        share = GPUShare(uuid=f"GPU-{node}-0", index=0, mem_mib=1024, sm_pct=10)
        a = Assignment(pod_uid=uid, node=node, pod_class="online", containers={"c": (share,)})
        _bind(core, ns, name, node, binding_annotations(a))
    stale = [core.read_namespaced_pod(n, ns) for n in names]
    # the first pod changes after the kubelet's copy was taken: the PATCH from that copy is refused
    core.patch_namespaced_pod(names[0], ns, {"metadata": {"labels": {"touched": "yes"}}})
    plugin(stale[0])
    assert annotations(get_pod(core, ns, names[0]))[ANN_HANDOFF] == HANDOFF_DONE
    assert plugin.served == [f"{ns}/{names[0]}"]
    # the second pod's handoff ended meanwhile (another plugin, say): nothing is written again
    core.patch_namespaced_pod(names[1], ns, {"metadata": {"annotations": {ANN_HANDOFF: "failed"}}})
    plugin(stale[1])
    assert annotations(get_pod(core, ns, names[1]))[ANN_HANDOFF] == "failed"
    assert plugin.served == [f"{ns}/{names[0]}"]
    assert not plugin.errors, plugin.errors
