"""gpupack.handoff: the pure rules both sides of the bind -> Allocate handoff follow."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from kubernetes import client

from gpupack import contract, handoff
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    RES_GPU,
    RES_GPU_MEM,
    SCHEDULER_NAME,
    Assignment,
    GPUShare,
)
from gpupack.handoff import HandoffError

A, B = "GPU-aaaa", "GPU-bbbb"
GPUS = {A: True, B: True}


def pod(
    name="p",
    node="n1",
    uid=None,
    phase="Pending",
    deleting=False,
    handoff_state="pending",
    containers=None,
    init=None,
    shares=None,
    allocated=None,
    bound_at="2026-01-01T00:00:00Z",
):
    uid = uid or f"uid-{name}"
    containers = containers if containers is not None else [("main", 1)]
    init = init or []
    if shares is None:
        shares = {
            c: tuple(GPUShare(A if i == 0 else B, i, 1000, 25) for i in range(n))
            for c, n in init + containers
            if n
        }
    ann = {}
    if handoff_state:
        ann[ANN_ASSIGNMENT] = Assignment(uid, node, "online", shares, bound_at=bound_at).to_json()
        ann[ANN_HANDOFF] = handoff_state
    if allocated is not None:
        ann[ANN_ALLOCATED] = json.dumps(allocated)
    meta = {"name": name, "namespace": "ns", "uid": uid, "annotations": ann, "resourceVersion": "7"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:05Z"

    def cs(lst):
        return [{"name": c, "resources": {"limits": {RES_GPU: str(n), RES_GPU_MEM: "1000"}}} for c, n in lst]

    return {
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "schedulerName": SCHEDULER_NAME,
            "initContainers": cs(init),
            "containers": cs(containers),
        },
        "status": {"phase": phase},
    }


def slots(uuid, n=1, first=0):
    return [f"{uuid}::{k}" for k in range(first, first + n)]


def test_blocking_predicate_only_counts_live_pending_pods_on_that_node():
    assert handoff.blocking_handoff([pod()], "n1").key == "ns/p"
    assert handoff.blocking_handoff([pod()], "n2") is None
    assert handoff.blocking_handoff([pod(phase="Failed")], "n1") is None
    assert handoff.blocking_handoff([pod(phase="Succeeded")], "n1") is None
    # a bound pod being deleted may be mid-admission (the kubelet goes on calling Allocate for its
    # containers): it keeps the node until it is gone or terminal; unbound, it never will be admitted
    assert handoff.blocking_handoff([pod(deleting=True)], "n1").key == "ns/p"
    assert handoff.blocking_handoff([pod(deleting=True, phase="Failed")], "n1") is None
    unbound = pod(deleting=True)
    unbound["spec"]["nodeName"] = ""
    assert not handoff.is_pending_handoff(unbound)
    assert handoff.blocking_handoff([pod(handoff_state="done")], "n1") is None
    assert handoff.blocking_handoff([pod(handoff_state="")], "n1") is None
    # a retried bind of the pod itself does not block itself
    assert handoff.blocking_handoff([pod(uid="me")], "n1", exclude_uid="me") is None
    msg = handoff.blocking_message("n1", handoff.pod_view(pod()))
    assert "waiting for the kubelet to admit pod ns/p" in msg and "2026-01-01T00:00:00Z" in msg


def test_pending_pods_sorted_oldest_first_and_age():
    pods = [pod("b", bound_at="2026-01-01T00:00:10Z"), pod("a", bound_at="2026-01-01T00:00:00Z")]
    assert [p.name for p in handoff.pending_pods_on_node(pods, "n1")] == ["a", "b"]
    now = datetime(2026, 1, 1, 0, 2, 0, tzinfo=UTC)
    assert handoff.handoff_age_s(pods[1], now) == 120.0


def test_kubernetes_client_objects_are_understood():
    p = client.V1Pod(
        metadata=client.V1ObjectMeta(name="x", namespace="ns", uid="u", annotations={ANN_HANDOFF: "pending"}),
        spec=client.V1PodSpec(
            node_name="n1",
            containers=[
                client.V1Container(name="c", resources=client.V1ResourceRequirements(limits={RES_GPU: "2"}))
            ],
        ),
        status=client.V1PodStatus(phase="Pending"),
    )
    v = handoff.pod_view(p)
    assert (v.key, v.node_name, v.live, v.handoff) == ("ns/x", "n1", True, "pending")
    assert [c.gpu_count() for c in handoff.gpu_containers(p)] == [2]


def test_multi_container_pod_is_served_init_first_then_in_spec_order():
    p = pod(init=[("warm", 1)], containers=[("a", 1), ("cpu-only", 0), ("b", 2)])
    order = []
    for ids in (slots(A), slots(A, first=1), slots(A, first=2) + slots(B)):
        plan = handoff.plan_allocate(p, "n1", ids, GPUS)
        order.append(plan.container)
        p["metadata"]["annotations"].update(plan.patch)
    assert order == ["warm", "a", "b"]
    assert p["metadata"]["annotations"][ANN_HANDOFF] == "done"
    record = p["metadata"]["annotations"][ANN_ALLOCATED]
    assert contract.decode_allocated(record) == ["warm", "a", "b"]
    # the record holds the shares each container was handed: what a restarted extender charges
    # when the assignment is gone
    held = contract.decode_allocation(record)
    assert held is not None and held == contract.decode_assignment(
        p["metadata"]["annotations"][ANN_ASSIGNMENT]
    )
    assert not handoff.is_pending_handoff(p)
    with pytest.raises(HandoffError, match="already allocated"):
        p["metadata"]["annotations"][ANN_HANDOFF] = "pending"
        handoff.plan_allocate(p, "n1", slots(A), GPUS)


@pytest.mark.parametrize(
    ("kwargs", "count", "gpus", "match"),
    [
        ({}, 2, GPUS, "asked for 2 .* requests 1"),
        ({}, 1, {A: False}, "unhealthy"),
        ({}, 1, {B: True}, "not on node n1"),
        ({"node": "n2"}, 1, GPUS, "assignment is for node 'n2'"),
        ({"shares": {"other": (GPUShare(A, 0, 1, 1),)}}, 1, GPUS, "no GPUs for container main"),
        ({"shares": {"main": (GPUShare(A, 0, 1, 1), GPUShare(B, 1, 1, 1))}}, 1, GPUS, "lists 2 GPU"),
    ],
)
def test_allocate_refuses_what_it_cannot_hand_out_exactly(kwargs, count, gpus, match):
    p = pod(**kwargs)
    with pytest.raises(HandoffError, match=match):
        handoff.plan_allocate(p, "n1", slots(A, count), gpus)


def test_corrupt_or_foreign_assignment_is_a_handoff_error():
    p = pod()
    p["metadata"]["annotations"][ANN_ASSIGNMENT] = "{not json"
    with pytest.raises(HandoffError, match="ns/p.*not valid JSON"):
        handoff.plan_allocate(p, "n1", slots(A), GPUS)
    p = pod(uid="new-uid")
    p["metadata"]["annotations"][ANN_ASSIGNMENT] = Assignment(
        "old-uid", "n1", "online", {"main": (GPUShare(A, 0, 1, 1),)}
    ).to_json()
    with pytest.raises(HandoffError, match="old-uid"):
        handoff.plan_allocate(p, "n1", slots(A), GPUS)
    p = pod()
    p["spec"]["schedulerName"] = "default-scheduler"
    with pytest.raises(HandoffError, match="schedulerName is 'default-scheduler'"):
        handoff.plan_allocate(p, "n1", slots(A), GPUS)


def test_app_container_given_the_init_containers_ids_again_is_served_as_itself():
    """The kubelet reuses an init container's device IDs for the next container and still calls
    Allocate (issue 10): that is the next container, with its own shares, not a retry."""
    shares = {"download": (GPUShare(A, 0, 8000, 10),), "main": (GPUShare(A, 0, 40000, 40),)}
    p = pod(init=[("download", 1)], containers=[("main", 1)], shares=shares)
    first = handoff.plan_allocate(p, "n1", slots(A), GPUS)
    assert first.container == "download" and first.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "8000m"
    p["metadata"]["annotations"].update(first.patch)
    second = handoff.plan_allocate(p, "n1", slots(A), GPUS, init_device_ids={"download": slots(A)})
    assert second.container == "main" and second.completes
    assert second.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40000m" and second.env["CUDA_DEVICE_SM_LIMIT"] == "40"


def test_device_ids_must_be_fresh_slots_of_the_assigned_gpus_or_the_init_containers():
    shares = {"prep": (GPUShare(A, 0, 1000, 5),), "main": (GPUShare(B, 1, 1000, 5),)}
    p = pod(init=[("prep", 1)], containers=[("main", 1)], shares=shares)
    with pytest.raises(handoff.NotThisPod, match=r"device GPU-bbbb::0, which is neither a slot .* GPU-aaaa"):
        handoff.plan_allocate(p, "n1", slots(B), GPUS)  # prep is assigned A
    p["metadata"]["annotations"].update(handoff.plan_allocate(p, "n1", slots(A, first=3), GPUS).patch)
    # main (assigned B) may be given prep's ID again, or a fresh slot of B; not another slot of A
    assert (
        handoff.plan_allocate(
            p, "n1", ["GPU-aaaa::3"], GPUS, init_device_ids={"prep": ["GPU-aaaa::3"]}
        ).container
        == "main"
    )
    assert (
        handoff.plan_allocate(
            p, "n1", slots(B, first=7), GPUS, init_device_ids={"prep": ["GPU-aaaa::3"]}
        ).container
        == "main"
    )
    with pytest.raises(handoff.NotThisPod, match="GPU-aaaa::4"):
        handoff.plan_allocate(p, "n1", ["GPU-aaaa::4"], GPUS, init_device_ids={"prep": ["GPU-aaaa::3"]})
    with pytest.raises(handoff.NotThisPod, match="junk"):
        handoff.plan_allocate(p, "n1", ["junk"], GPUS, init_device_ids={"prep": ["GPU-aaaa::3"]})
    # the plugin restarted since prep was served: any slot of prep's GPU counts as reused
    assert handoff.plan_allocate(p, "n1", ["GPU-aaaa::4"], GPUS).container == "main"


def test_select_pending_pod_never_guesses():
    with pytest.raises(
        HandoffError, match="no pending gpupack assignment for a pod on node n1.*schedulerName"
    ):
        handoff.select_pending_pod([pod(handoff_state="done")], "n1")
    with pytest.raises(HandoffError, match="2 pods have a pending GPU handoff .*ns/a.*ns/b"):
        handoff.select_pending_pod([pod("a"), pod("b")], "n1")
    # a bound pod being deleted may still be mid-admission: it counts, so the plugin refuses to guess
    with pytest.raises(HandoffError, match="refusing to guess"):
        handoff.select_pending_pod([pod("a"), pod("b", deleting=True)], "n1")
    assert handoff.select_pending_pod([pod("a"), pod("b", phase="Failed")], "n1").name == "a"


def test_env_for_shared_and_exclusive_containers():
    shared = (GPUShare(A, 0, 20000, 30), GPUShare(B, 1, 20000, 30))
    env = handoff.container_env(shared, "both")
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{A},{B}"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20000m" and env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "20000m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20000M,1=20000M"
    assert json.loads(env["GPUPACK_ASSIGNMENT"])[1]["uuid"] == B
    hami = handoff.container_env(shared, "hami-core")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in hami and "CUDA_DEVICE_SM_LIMIT" in hami
    mps = handoff.container_env(shared, "mps")
    assert "CUDA_DEVICE_SM_LIMIT" not in mps and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in mps
    whole = handoff.container_env((GPUShare(A, 0, 143771, 100, exclusive=True),), "both")
    assert set(whole) == {"NVIDIA_VISIBLE_DEVICES", "GPUPACK_ASSIGNMENT"}
    with pytest.raises(ValueError, match="enforcement"):
        handoff.container_env(shared, "cgroups")


def test_bind_and_rollback_patches():
    a = Assignment("u", "n1", "online", {"main": (GPUShare(A, 0, 1, 1),)})
    patch = handoff.handoff_annotations_for_bind(a)
    assert patch[ANN_HANDOFF] == "pending" and patch[ANN_ALLOCATED] is None
    assert set(handoff.rollback_annotations()) == {ANN_ASSIGNMENT, ANN_HANDOFF, ANN_ALLOCATED}
