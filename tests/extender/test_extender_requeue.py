"""A GPU pod kube-scheduler parked as unschedulable is retried within seconds when the cluster gains
room for it, with the real kube-scheduler v1.28.7 and gpupack's shipped profile.

kube-scheduler v1.28 moves parked pods back to its active queue on a Node add/update only when a
pre-check passes, and that pre-check counts gpupack.io/gpu-mem and gpu-sm as missing on every node
(kubernetes/kubernetes#122019): without the extender's Requeuer such a pod waits for an unrelated
pod event or the scheduler's 5-minute flush. Each test's pod asks for gpu-mem, so the scheduler's
own retry never applies."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import realk8s
from ext_helpers import container, create_pod, extender_with_scheduler, get_pod, gpu_node, pod_obj
from test_extender_scheduler import diag, events

until = realk8s.until
BIG_MIB = 60000  # more than the 40 GiB GPU of the small node, less than an H100
A100_40_MIB = 40960
REQUEUE_LIMIT_S = 15.0  # the scheduler alone takes ~5 minutes (its flush of unschedulable pods)


@pytest.fixture(scope="module")
def sched(k8s: realk8s.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    yield from extender_with_scheduler(k8s, tmp_path_factory.mktemp("requeue"), "gpupack-scheduler-requeue")


def parked(cluster: realk8s.ControlPlane, ns: str, name: str, reason: str, sched: SimpleNamespace) -> None:
    """The pod is Pending, unbound, marked Unschedulable, with the extender's reason in its event.

    kube-scheduler records the FailedScheduling event before it patches the PodScheduled condition
    (handleSchedulingFailure), so the event can be readable first: wait for both."""

    def unschedulable() -> list[dict]:
        pod = get_pod(cluster.core, ns, name)
        return [c for c in pod["status"].get("conditions") or []
                if c["type"] == "PodScheduled" and c["status"] == "False" and c["reason"] == "Unschedulable"]  # fmt: skip

    try:
        until(lambda: [m for m in events(cluster, ns, name) if reason in m], 30,
              f"FailedScheduling event of {name} with {reason!r}")  # fmt: skip
        until(unschedulable, 10, f"PodScheduled=False/Unschedulable on {name}")
    except AssertionError as e:
        raise AssertionError(f"{e}; events: {events(cluster, ns, name)}{diag(sched)}") from None
    pod = get_pod(cluster.core, ns, name)
    assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending", pod["status"]


def bound_within(
    cluster: realk8s.ControlPlane, ns: str, name: str, sched: SimpleNamespace
) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        node = until(lambda: get_pod(cluster.core, ns, name)["spec"].get("nodeName"), REQUEUE_LIMIT_S,
                     f"pod {name} bound after the cluster gained room", interval=0.1)  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e}{diag(sched)}") from None
    return node, time.monotonic() - t0


def small_node(cluster: realk8s.ControlPlane, name: str) -> None:
    gpu_node(cluster, name, 1, mem=A100_40_MIB, model="NVIDIA-A100-SXM4-40GB")


def test_parked_gpu_pod_is_bound_soon_after_a_gpu_node_joins(cluster, ns, sfx, sched, kubelet):
    small_node(cluster, f"small-{sfx}")
    create_pod(cluster.core, pod_obj("big", [container("c", 1, BIG_MIB, 50)]), ns)
    parked(cluster, ns, "big", f"needs {BIG_MIB} MiB on one GPU", sched)
    time.sleep(1)  # past the scheduler's handling of that failure: the pod sits among its unschedulable
    gpu_node(cluster, f"new-{sfx}", 2)  # e.g. a cluster-autoscaler scale-up
    node, took = bound_within(cluster, ns, "big", sched)
    assert node == f"new-{sfx}"
    print(f"requeue after a node joined: bound {took:.2f} s after the node was created")


def test_parked_gpu_pod_is_bound_soon_after_a_taint_is_removed(cluster, ns, sfx, sched, kubelet):
    small_node(cluster, f"small-{sfx}")
    big = f"tainted-{sfx}"
    gpu_node(cluster, big, 2)
    taint = {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"}
    cluster.core.patch_node(big, {"spec": {"taints": [taint]}})
    create_pod(cluster.core, pod_obj("big", [container("c", 1, BIG_MIB, 50)]), ns)
    parked(cluster, ns, "big", f"needs {BIG_MIB} MiB on one GPU", sched)
    assert any("untolerated taint" in m for m in events(cluster, ns, "big")), events(cluster, ns, "big")
    time.sleep(1)
    cluster.core.patch_node(big, {"spec": {"taints": None}})
    node, took = bound_within(cluster, ns, "big", sched)
    assert node == big
    print(f"requeue after a taint was removed: bound {took:.2f} s after the removal")


def room_requeues(sched: SimpleNamespace) -> float:
    for line in sched.ext.http.get(sched.ext.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('gpupack_extender_requeued_pods_total{why="room"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("leaves", ["deleted", "succeeded"])
def test_parked_gpu_pod_is_bound_soon_after_a_gpu_pod_leaves(cluster, ns, sfx, sched, kubelet, leaves):
    """kube-scheduler v1.28 itself retries every parked pod, without a pre-check, when an assigned
    pod is deleted (or turns Succeeded/Failed: it leaves the scheduler's informer of non-terminal
    pods). But a pod parked longer than its backoff (10 s at most) is retried at once, and that
    attempt can reach the extender before the extender's watch has freed the GPU: "no GPU with
    60000 MiB free", parked again, and nothing retries it for 5 minutes (the deleted case failed
    so in 4 runs out of 5 before the Requeuer followed freed GPUs too; the succeeded one in 1 of 3)."""
    gpu_node(cluster, f"one-{sfx}", 1)
    create_pod(cluster.core, pod_obj("first", [container("c", 1, BIG_MIB, 50)]), ns)
    until(lambda: get_pod(cluster.core, ns, "first")["spec"].get("nodeName"), 30, "first pod bound")
    create_pod(cluster.core, pod_obj("second", [container("c", 1, BIG_MIB, 50)]), ns)
    parked(cluster, ns, "second", f"no GPU with {BIG_MIB} MiB free", sched)
    time.sleep(11)  # past the pod's backoff (podMaxBackoffSeconds: 10 s)
    before = room_requeues(sched)
    if leaves == "deleted":
        cluster.core.delete_namespaced_pod("first", ns)  # the KubeletEmulator confirms it
    else:
        status = {"status": {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}]}}
        cluster.core.patch_namespaced_pod_status("first", ns, status)
    node, took = bound_within(cluster, ns, "second", sched)
    assert node == f"one-{sfx}"
    print(f"retry after a GPU pod {leaves}: bound {took:.2f} s later "
          f"(the extender asked {room_requeues(sched) - before:g} pod(s) to retry)")  # fmt: skip
