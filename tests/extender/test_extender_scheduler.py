"""The real kube-scheduler (v1.28.7) with gpupack's shipped profile (deploy/scheduler/config.yaml, only
the extender's urlPrefix changed) calling the real `gpupack extender` process: pods end bound with
a valid assignment, or Pending with the extender's reason in their FailedScheduling event.

The kubelets of the fake GPU nodes are a KubeletEmulator; gpupack's device plugin finishing each
handoff (which frees the node for the next bind) is emulated in its admit hook."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import realk8s
from ext_helpers import (
    H100_MIB,
    annotations,
    container,
    create_pod,
    extender_with_scheduler,
    gpu_node,
    list_pods,
    pod_obj,
)

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    LABEL_CLASS,
    decode_allocated,
    decode_assignment,
    parse_int_quantity,
)

until = realk8s.until


@pytest.fixture(scope="module")
def sched(k8s: realk8s.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One extender and one kube-scheduler for the module (each test brings its own nodes and
    namespace; the `cluster` fixture clears them, and both processes follow through their watches)."""
    yield from extender_with_scheduler(k8s, tmp_path_factory.mktemp("sched"), "gpupack-scheduler")


def diag(sched: SimpleNamespace) -> str:
    return f"\n--- kube-scheduler ---\n{sched.proc.tail(4000)}\n--- extender ---\n{sched.ext.tail()}"


def wait_bound_and_handed_off(
    cluster: realk8s.ControlPlane, ns: str, n: int, sched: SimpleNamespace
) -> list[dict]:
    def done() -> list[dict] | None:
        pods = list_pods(cluster.core, ns)
        ok = [
            p for p in pods if p["spec"].get("nodeName") and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE
        ]
        return pods if len(ok) == n == len(pods) else None

    try:
        return until(done, 60, f"{n} pods bound with their GPU handoff done", interval=0.2)
    except AssertionError as e:
        state = {p["metadata"]["name"]: (p["spec"].get("nodeName"), annotations(p).get(ANN_HANDOFF))
                 for p in list_pods(cluster.core, ns)}  # fmt: skip
        raise AssertionError(f"{e}: {state}{diag(sched)}") from None


def check_assignment(pod: dict) -> Any:
    """The pod's assignment matches its spec: node, UID, class, and per GPU container exactly the
    GPUs, MiB and SM share it asked for (whole GPUs when it asked for neither)."""
    a = decode_assignment(annotations(pod)[ANN_ASSIGNMENT])
    node = pod["spec"]["nodeName"]
    assert a.node == node and a.pod_uid == pod["metadata"]["uid"], a
    assert a.pod_class == (pod["metadata"].get("labels") or {}).get(LABEL_CLASS, "online")
    gpu_containers = []
    for c in pod["spec"]["containers"]:
        limits = c["resources"]["limits"]
        if "gpupack.io/gpu" not in limits:
            continue
        gpu_containers.append(c["name"])
        shares = a.containers[c["name"]]
        assert len(shares) == int(limits["gpupack.io/gpu"]), (c["name"], shares)
        assert len({s.uuid for s in shares}) == len(shares) and all(
            s.uuid.startswith(f"GPU-{node}-") for s in shares
        )
        for s in shares:
            if "gpupack.io/gpu-mem" in limits or "gpupack.io/gpu-sm" in limits:
                assert not s.exclusive
                assert s.mem_mib == parse_int_quantity(limits.get("gpupack.io/gpu-mem", 0), "mem"), s
                assert s.sm_pct == parse_int_quantity(limits.get("gpupack.io/gpu-sm", 0), "sm"), s
            else:
                assert s.exclusive and s.mem_mib == H100_MIB and s.sm_pct == 100, s
    assert decode_allocated(annotations(pod)[ANN_ALLOCATED]) == list(gpu_containers)
    return a


def gpu_use(pods: list[dict]) -> dict[str, dict[str, Any]]:
    """Per GPU: MiB and SM % reserved, classes, whether held whole, and how many pods. A pod in a
    terminal phase holds nothing (its containers are gone), even while a finalizer keeps it."""
    use: dict[str, dict[str, Any]] = {}
    for p in pods:
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        a = decode_assignment(annotations(p)[ANN_ASSIGNMENT])
        on_gpu: dict[str, list] = {}
        for shares in a.containers.values():
            for s in shares:
                on_gpu.setdefault(s.uuid, []).append(s)
        for uuid, shares in on_gpu.items():
            u = use.setdefault(
                uuid, {"mem": 0, "sm": 0, "classes": set(), "whole": 0, "pods": 0, "node": a.node}
            )
            u["mem"] += sum(s.mem_mib for s in shares)
            u["sm"] += sum(s.sm_pct for s in shares)
            u["classes"].add(a.pod_class)
            u["whole"] += any(s.exclusive for s in shares)
            u["pods"] += 1
    return use


def check_no_overcommit(use: dict[str, dict[str, Any]]) -> None:
    for uuid, u in use.items():
        assert u["mem"] <= H100_MIB and u["sm"] <= 100, (uuid, u)
        assert len(u["classes"]) == 1, (uuid, u)
        assert not u["whole"] or u["pods"] == 1, (uuid, u)


def events(cluster: realk8s.ControlPlane, ns: str, pod: str) -> list[str]:
    evs = cluster.core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={pod},reason=FailedScheduling"
    )
    return [e.message or "" for e in evs.items]


def test_real_scheduler_binds_pods_with_valid_assignments_and_no_overcommit(cluster, ns, sfx, sched, kubelet):
    nodes = [f"gpu-a-{sfx}", f"gpu-b-{sfx}"]
    for n in nodes:
        gpu_node(cluster, n, 4)
    shapes = [("online", [container("c", 1, 25000, 25)])] * 3 + [
        ("offline", [container("c", 1, 20000, 30)]),
        ("offline", [container("c", 1, 20000, 30)]),
        ("offline", [container("w", 1, 10000, 20), container("v", 1, 8000, 10)]),
        ("offline", [container("train", 1)]),  # a whole GPU
    ]
    for i, (cls, cs) in enumerate(shapes):
        create_pod(cluster.core, pod_obj(f"p{i}-{cls}", cs, cls=cls), ns)
    pods = wait_bound_and_handed_off(cluster, ns, len(shapes), sched)
    for p in pods:
        check_assignment(p)
    use = gpu_use(pods)
    check_no_overcommit(use)
    # seven pods on two nodes: several pods on one node, each bind after the previous handoff
    assert max(sum(u["pods"] for u in use.values() if u["node"] == n) for n in nodes) >= 2
    assert max(u["pods"] for u in use.values()) >= 2, f"nothing shares a GPU: {use}"
    # the extender's own accounting (its /metrics) agrees with the annotations
    want = {(u["node"], uuid): (float(u["mem"]), float(u["sm"])) for uuid, u in use.items()}
    until(lambda: {k: v for k, v in sched.ext.reserved("uuid").items() if v != (0.0, 0.0)} == want, 30,
          "extender reservations equal to the assignments")  # fmt: skip


def test_online_and_offline_pods_never_share_a_gpu(cluster, ns, sfx, sched, kubelet):
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 2)
    # small pods a packing policy would put on one GPU, were it not for the classes
    for i, cls in enumerate(["online", "offline", "online", "offline", "offline"]):
        create_pod(cluster.core, pod_obj(f"p{i}-{cls}", [container("c", 1, 10000, 10)], cls=cls), ns)
    pods = wait_bound_and_handed_off(cluster, ns, 5, sched)
    for p in pods:
        check_assignment(p)
    use = gpu_use(pods)
    check_no_overcommit(use)
    assert len(use) == 2 and {frozenset(u["classes"]) for u in use.values()} == {
        frozenset({"online"}),
        frozenset({"offline"}),
    }, use
    # an online pod too big for what the online GPU has left may not spill onto the offline one
    create_pod(cluster.core, pod_obj("big-online", [container("c", 1, 75000, 10)], cls="online"), ns)
    reason = "no GPU with 75000 MiB free for class online"
    until(lambda: any(reason in m for m in events(cluster, ns, "big-online")), 30,
          f"FailedScheduling event with {reason!r}")  # fmt: skip
    assert not [p for p in list_pods(cluster.core, ns) if p["metadata"]["name"] == "big-online"][0][
        "spec"
    ].get("nodeName")


def test_pods_that_cannot_be_placed_stay_pending_with_the_extenders_reason(cluster, ns, sfx, sched, kubelet):
    """Issue 10 case 8: a bad GPU request used to get filter HTTP 400, which the scheduler shows
    only as "failed filter with extender ... code 400" and retries forever."""
    for n in (f"gpu-a-{sfx}", f"gpu-b-{sfx}"):
        gpu_node(cluster, n, 2)
    cases = {
        "too-big": (
            [container("c", 1, 90000, 10)],
            "needs 90000 MiB on one GPU; the largest GPU here has 81559 MiB",
        ),
        "sm-150": ([container("c", 1, 1000, 150)], "gpupack.io/gpu-sm must be a percent in 1..100, got 150"),
        "gpus-100": ([container("c", 100)], "gpupack.io/gpu=100 is more GPUs than any node has"),
        "too-many": ([container("c", 3, 1000, 10)], "container c needs 3 GPUs; node has 2"),
    }
    for name, (cs, _) in cases.items():
        create_pod(cluster.core, pod_obj(name, cs), ns)
    for name, (_, reason) in cases.items():
        try:
            msgs = until(lambda n=name, r=reason: [m for m in events(cluster, ns, n) if r in m], 30,
                         f"FailedScheduling event of {name} with {reason!r}")  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}; events: {events(cluster, ns, name)}{diag(sched)}") from None
        # every node gave the reason and none is worth preempting for
        assert msgs[0].startswith("0/2 nodes are available: 2 "), msgs
        assert "code 400" not in msgs[0] and "SchedulerError" not in msgs[0], msgs
    assert all(not p["spec"].get("nodeName") for p in list_pods(cluster.core, ns))
    assert all(p["status"]["phase"] == "Pending" for p in list_pods(cluster.core, ns))
    metrics = sched.ext.http.get(sched.ext.url + "/metrics", timeout=5).text
    assert 'gpupack_extender_bad_requests_total{verb="filter"}' not in metrics


def test_node_resources_are_checked_by_the_extender_in_kube_schedulers_words(
    cluster, ns, sfx, sched, kubelet
):
    """The shipped profile turns NodeResourcesFit's Filter off (it is a third of a GPU pod's
    scheduling time at 1,000 nodes): the extender refuses nodes for CPU and other resources itself,
    counting the pods it has bound, and the FailedScheduling event reads as kube-scheduler's would."""
    nodes = [f"gpu-a-{sfx}", f"gpu-b-{sfx}"]
    for n in nodes:
        gpu_node(cluster, n, 2)  # 64 CPUs each, no example.com/nic
    for i in range(2):
        hog = container("c", 1, 1000, 10)
        hog["resources"]["requests"]["cpu"] = "40"
        create_pod(cluster.core, pod_obj(f"hog{i}", [hog]), ns)
    pods = wait_bound_and_handed_off(cluster, ns, 2, sched)
    assert {p["spec"]["nodeName"] for p in pods} == set(nodes)  # 80 CPUs do not fit on one node
    cpu = container("c", 1, 1000, 10)
    cpu["resources"]["requests"]["cpu"] = "30"
    nic = {"name": "c", "image": "registry.invalid/x:1", "resources": {"limits": {"example.com/nic": "1"}}}
    cases = {"cpu": ([cpu], "2 Insufficient cpu"), "nic": ([nic], "2 Insufficient example.com/nic")}
    for name, (cs, _) in cases.items():
        create_pod(cluster.core, pod_obj(name, cs), ns)
    for name, (_, reason) in cases.items():
        try:
            until(lambda n=name, r=reason: [m for m in events(cluster, ns, n) if r in m], 30,
                  f"FailedScheduling event of {name} with {reason!r}")  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}; events: {events(cluster, ns, name)}{diag(sched)}") from None
    assert sorted(p["metadata"]["name"] for p in list_pods(cluster.core, ns) if not p["spec"].get("nodeName")) == [
        "cpu", "nic",
    ]  # fmt: skip
    # a hog leaving frees its CPU: the waiting GPU pod is placed where it went
    cluster.core.delete_namespaced_pod("hog0", ns, grace_period_seconds=0)
    freed = next(p["spec"]["nodeName"] for p in pods if p["metadata"]["name"] == "hog0")
    until(lambda: [p for p in list_pods(cluster.core, ns) if p["metadata"]["name"] == "cpu"
                   and p["spec"].get("nodeName") == freed], 60, "the cpu pod bound where hog0 was")  # fmt: skip


def test_a_burst_never_overcommits_a_nodes_cpu_or_pod_slots(cluster, ns, sfx, sched, kubelet):
    """With kube-scheduler's own resource filter off, the extender's CPU and pod accounting must
    hold while binds are in flight: 20 pods of 1 CPU at once, GPU and CPU-only ones, onto two GPU
    nodes of 4 CPUs and a CPU-only node of 8 CPUs but 5 pods. Exactly 4 + 4 + 5 bind; the others
    wait, saying why."""
    gpu_nodes = [f"gpu-a-{sfx}", f"gpu-b-{sfx}"]
    for n in gpu_nodes:
        gpu_node(cluster, n, 2, cpu="4")
    plain = f"plain-{sfx}"
    cluster.make_node(plain, cpu="8", pods="5")
    for i in range(20):
        c = container("c", 1, 1000, 5) if i % 2 else {"name": "c", "image": "registry.invalid/x:1",
                                                      "resources": {"requests": {}}}  # fmt: skip
        c["resources"]["requests"]["cpu"] = "1"
        create_pod(cluster.core, pod_obj(f"p{i:02d}", [c]), ns)

    def told(name: str) -> bool:
        # a pod may also lose a race at bind ("node X: Insufficient cpu", then retried); wanted is
        # the answer of a whole cycle: every node refused, for CPU or pod slots
        return any("0/3 nodes are available" in m and "2 Insufficient cpu" in m and "1 Too many pods" in m
                   for m in events(cluster, ns, name))  # fmt: skip

    def settled() -> list[dict] | None:
        pods = list_pods(cluster.core, ns)
        bound = [p for p in pods if p["spec"].get("nodeName")]
        waiting = [p["metadata"]["name"] for p in pods if not p["spec"].get("nodeName")]
        return pods if len(bound) >= 13 and all(told(w) for w in waiting) else None

    try:
        pods = until(settled, 60, "13 pods bound and the others told why they wait")
    except AssertionError as e:
        raise AssertionError(
            f"{e}; {[(p['metadata']['name'], p['spec'].get('nodeName'), events(cluster, ns, p['metadata']['name'])) for p in list_pods(cluster.core, ns)]}"
        ) from None
    per_node: dict[str, int] = {}
    for p in pods:
        if p["spec"].get("nodeName"):
            per_node[p["spec"]["nodeName"]] = per_node.get(p["spec"]["nodeName"], 0) + 1
    # all 10 GPU pods fit the GPUs (4 slots x 2 GPUs a node): only CPU and pod slots limit them
    assert per_node == {gpu_nodes[0]: 4, gpu_nodes[1]: 4, plain: 5}, per_node
