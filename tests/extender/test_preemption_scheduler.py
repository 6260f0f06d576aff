"""GPU-aware preemption against the real kube-scheduler (shipped profile) and the real extender
with its preemption controller: online pods of a higher PriorityClass take GPUs back from offline
pods (issue 26's scenarios), and the rules that keep it from doing harm.

Kubelets are a KubeletEmulator (a pod being deleted is confirmed gone at once, so a victim with a
test finalizer stands for one still terminating)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import realk8s
import requests
from ext_helpers import (
    annotations,
    container,
    create_pod,
    extender_with_scheduler,
    get_pod,
    gpu_node,
    list_pods,
    pod_obj,
)
from kubernetes import client
from processes import ExtenderProcess
from test_extender_scheduler import check_no_overcommit, diag, gpu_use

from extender.state.preempt_inputs import ANN_PREEMPTION, record_of
from gpupack.contract import ANN_HANDOFF, HANDOFF_DONE, decode_reservations

until = realk8s.until
ONLINE, OFFLINE, OFFLINE_LOW, ONLINE_NEVER, LOW = (
    "gpupack-test-online",
    "gpupack-test-offline",
    "gpupack-test-offline-low",
    "gpupack-test-online-never",
    "gpupack-test-low",
)
FINALIZER = realk8s.STILL_STOPPING  # the emulated kubelet leaves such a pod Running


@pytest.fixture(scope="module")
def sched(k8s: realk8s.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    sch = client.SchedulingV1Api(k8s.api_client())
    for name, value, policy in (
        (ONLINE, 100000, None),
        (OFFLINE, 100, None),
        (OFFLINE_LOW, 10, None),
        (ONLINE_NEVER, 100000, "Never"),
        (LOW, 50, None),
    ):
        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                "value": value, **({"preemptionPolicy": policy} if policy else {})}  # fmt: skip
        with contextlib.suppress(client.ApiException):
            sch.create_priority_class(body)
    yield from extender_with_scheduler(
        k8s,
        tmp_path_factory.mktemp("preempt"),
        "gpupack-scheduler",
        "--preemption-interval-s",
        "0.5",
        "--log-level",
        "info",
    )


def pod(name: str, cls: str, prio: str, c: dict, finalizer: bool = False, labels: dict | None = None) -> dict:
    p = pod_obj(name, [c], cls=cls)
    p["spec"]["priorityClassName"] = prio
    p["spec"]["terminationGracePeriodSeconds"] = 5
    if finalizer:
        p["metadata"]["finalizers"] = [FINALIZER]
    p["metadata"]["labels"].update(labels or {})
    return p


def running(cluster: realk8s.ControlPlane, ns: str, names: list[str], sched: SimpleNamespace) -> None:
    def ok() -> bool:
        pods = {p["metadata"]["name"]: p for p in list_pods(cluster.core, ns)}
        return all(
            n in pods
            and pods[n]["spec"].get("nodeName")
            and annotations(pods[n]).get(ANN_HANDOFF) == HANDOFF_DONE
            for n in names
        )

    try:
        until(ok, 60, f"{names} bound and handed off", interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}{diag(sched)}") from None


def present(cluster: realk8s.ControlPlane, ns: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in list_pods(cluster.core, ns)}


def stopping(p: dict | None) -> bool:
    """Still there and not terminal: the kubelet stops a pod (terminal phase) before it is
    deleted, and a terminal pod holds nothing, so the preemptor may be bound from then on."""
    return p is not None and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def gone_and_bound(cluster: realk8s.ControlPlane, ns: str, pre: str, sched: SimpleNamespace) -> dict:
    """Wait for `pre` to be bound; check it was bound within 15 s of its last victim being gone
    (or stopped)."""
    t_gone = None

    def bound() -> dict | None:
        nonlocal t_gone
        pods = present(cluster, ns)
        p = pods[pre]
        rec = record_of(p)
        if (
            rec is not None
            and t_gone is None
            and not any(stopping(pods.get(v.rsplit(":", 1)[0].split("/")[1])) for v in rec.victims)
        ):
            t_gone = time.monotonic()
        return p if p["spec"].get("nodeName") else None

    try:
        p = until(bound, 60, f"{pre} bound", interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}: {get_pod(cluster.core, ns, pre).get('status')}{diag(sched)}") from None
    assert t_gone is not None, (
        f"bound before its victims were gone: {record_of(p)} {reasons(cluster, ns, pre)} {sorted(present(cluster, ns))}"
    )
    assert time.monotonic() - t_gone <= 15.0
    return p


def metric(sched: SimpleNamespace, name: str, **labels: str) -> float:
    text = requests.get(sched.ext.url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def reasons(cluster: realk8s.ControlPlane, ns: str, name: str) -> list[str]:
    evs = cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
    return [f"{e.reason}: {e.message}" for e in evs.items]


def check_all_bound_no_overcommit(cluster: realk8s.ControlPlane, ns: str) -> None:
    bound = [p for p in list_pods(cluster.core, ns) if p["spec"].get("nodeName")]
    check_no_overcommit(gpu_use(bound))


def test_online_pod_takes_a_whole_gpu_from_one_offline_pod(cluster, ns, sfx, sched, kubelet):
    for n in ("a", "b"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=1)
    for i in range(2):
        create_pod(cluster.core, pod(f"off-{i}", "offline", OFFLINE, container("main", gpu=1)), ns)
    running(cluster, ns, ["off-0", "off-1"], sched)
    create_pod(cluster.core, pod("web", "online", ONLINE, container("main", gpu=1)), ns)
    p = gone_and_bound(cluster, ns, "web", sched)
    rec = record_of(p)
    assert rec is not None and len(rec.victims) == 1 and rec.node == p["spec"]["nodeName"]
    left = present(cluster, ns)
    assert len([n for n, p in left.items() if n.startswith("off-") and stopping(p)]) == 1, sorted(left)
    victim = rec.victims[0].rsplit(":", 1)[0].split("/")[1]
    assert any(r.startswith("Preempting:") and victim in r for r in reasons(cluster, ns, "web"))
    until(
        lambda: any(r.startswith("Preempted:") and "/web" in r for r in reasons(cluster, ns, victim)),
        10,
        "victim event",
    )
    check_all_bound_no_overcommit(cluster, ns)


def test_online_share_evicts_the_offline_shares_of_one_gpu(cluster, ns, sfx, sched, kubelet):
    for n in ("a", "b"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=1)
    names = [f"off-{i}" for i in range(4)]
    for n in names:
        create_pod(cluster.core, pod(n, "offline", OFFLINE, container("main", gpu=1, mem=30000, sm=20)), ns)
    running(cluster, ns, names, sched)
    create_pod(cluster.core, pod("web", "online", ONLINE, container("main", gpu=1, mem=40000, sm=40)), ns)
    p = gone_and_bound(cluster, ns, "web", sched)
    rec = record_of(p)
    assert rec is not None and len(rec.victims) == 2, rec  # both on one GPU: the class rule
    left = present(cluster, ns)
    survivors = [left[n] for n in names if n in left]
    assert len(survivors) == 2 and all(s["spec"]["nodeName"] != p["spec"]["nodeName"] for s in survivors)
    check_all_bound_no_overcommit(cluster, ns)
    # the hold is released once the preemptor is bound
    until(lambda: not (get_node_annotations(cluster, p["spec"]["nodeName"]).get("gpupack.io/reservations") or "").count(
        "preempt-"), 20, "preemption hold released")  # fmt: skip


def get_node_annotations(cluster: realk8s.ControlPlane, name: str) -> dict[str, str]:
    return cluster.core.read_node(name).metadata.annotations or {}


@pytest.mark.parametrize("case", ["equal-priority", "never"])
def test_equal_priority_and_never_do_not_evict(cluster, ns, sfx, sched, kubelet, case):
    gpu_node(cluster, f"gpu-a-{sfx}", n=1)
    victim_prio = ONLINE if case == "equal-priority" else OFFLINE
    create_pod(cluster.core, pod("off-0", "offline", victim_prio, container("main", gpu=1)), ns)
    running(cluster, ns, ["off-0"], sched)
    before = {o: metric(sched, "gpupack_extender_preemptions_total", outcome=o) for o in ("no-room", "never")}
    pre_prio = ONLINE if case == "equal-priority" else ONLINE_NEVER
    create_pod(cluster.core, pod("web", "online", pre_prio, container("main", gpu=1)), ns)
    outcome = "no-room" if case == "equal-priority" else "never"
    # a condition, not a moment: the controller has looked at the pod (at least) three times
    until(lambda: metric(sched, "gpupack_extender_preemptions_total", outcome=outcome) >= before[outcome] + 3, 30,
          f"three {outcome} decisions")  # fmt: skip
    pods = present(cluster, ns)
    assert "off-0" in pods and not pods["off-0"]["metadata"].get("deletionTimestamp")
    assert not pods["web"]["spec"].get("nodeName") and ANN_PREEMPTION not in annotations(pods["web"])


def test_a_budget_allowing_no_disruption_is_not_violated_when_another_choice_exists(
    cluster, ns, sfx, sched, kubelet
):
    for n in ("a", "b"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=1)
    # the protected pod has the lower priority: without its budget it would be the victim
    create_pod(
        cluster.core,
        pod("protected", "offline", OFFLINE_LOW, container("main", gpu=1), labels={"app": "p"}),
        ns,
    )
    create_pod(cluster.core, pod("plain", "offline", OFFLINE, container("main", gpu=1)), ns)
    running(cluster, ns, ["protected", "plain"], sched)
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep"},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "p"}}}}  # fmt: skip
    pol = client.PolicyV1Api(cluster.api_client())
    pol.create_namespaced_pod_disruption_budget(ns, pdb)

    def computed() -> bool:
        st = pol.read_namespaced_pod_disruption_budget("keep", ns).status
        return bool(st and st.observed_generation and st.current_healthy == 1 and st.disruptions_allowed == 0)

    until(computed, 30, "the budget computed by the disruption controller")
    create_pod(cluster.core, pod("web", "online", ONLINE, container("main", gpu=1)), ns)
    gone_and_bound(cluster, ns, "web", sched)
    left = present(cluster, ns)
    assert "protected" in left and "plain" not in left, sorted(left)
    check_all_bound_no_overcommit(cluster, ns)


def test_a_lower_priority_pod_never_takes_the_held_room(cluster, ns, sfx, sched, kubelet):
    for n in ("a", "b"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=1)
    # off-0 stays terminating (its finalizer) until the test lets it go
    create_pod(
        cluster.core, pod("off-0", "offline", OFFLINE_LOW, container("main", gpu=1), finalizer=True), ns
    )
    create_pod(cluster.core, pod("off-1", "offline", ONLINE, container("main", gpu=1)), ns)
    running(cluster, ns, ["off-0", "off-1"], sched)
    create_pod(cluster.core, pod("web", "online", ONLINE, container("main", gpu=1)), ns)
    until(
        lambda: get_pod(cluster.core, ns, "off-0")["metadata"].get("deletionTimestamp"), 30, "off-0 evicted"
    )

    def nominated() -> bool:
        web = get_pod(cluster.core, ns, "web")
        rec = record_of(web)
        return rec is not None and (web.get("status") or {}).get("nominatedNodeName") == rec.node

    until(nominated, 15, "web nominated to the node its victim is leaving")
    # a new leader: everything it needs is in the Node's and the pods' annotations
    sched.ext.stop()
    sched.ext = ExtenderProcess(sched.kc, sched.tmp / f"extender-{sfx}.log", *sched.flags, port=sched.port)
    sched.ext.wait_ready()
    # a pod of lower priority than web that would fit the room web waits for (and can evict no one)
    create_pod(cluster.core, pod("low", "online", LOW, container("main", gpu=1)), ns)
    until(lambda: any(c.get("reason") == "Unschedulable" for c in
                      (get_pod(cluster.core, ns, "low").get("status") or {}).get("conditions") or []), 30,
          "low tried and parked")  # fmt: skip
    cluster.core.patch_namespaced_pod("off-0", ns, {"metadata": {"finalizers": None}})
    # web lands where off-0 was; had low taken that room in between, web would find none
    web = gone_and_bound(cluster, ns, "web", sched)
    assert web["spec"]["nodeName"] == record_of(web).node  # type: ignore[union-attr]
    assert not get_pod(cluster.core, ns, "low")["spec"].get("nodeName")
    assert "off-1" in present(cluster, ns)
    # the new leader evicted no one: web's victim was already on its way out
    assert metric(sched, "gpupack_extender_preemptions_total", outcome="evicted") == 0
    check_all_bound_no_overcommit(cluster, ns)


def test_a_second_preemptor_gets_a_hold_on_the_room_the_first_ones_victims_leave(
    cluster, ns, sfx, sched, kubelet
):
    """Two offline 40 GB shares on one GPU: the first online 40 GB pod evicts both (the class
    rule), and half of that GPU is left over. The second online pod needs no victim of its own,
    but the room is there only once they are gone: it gets a hold too, and a lower-priority pod
    that would fit there does not take it."""
    node = f"gpu-a-{sfx}"
    gpu_node(cluster, node, n=1)
    share = container("main", gpu=1, mem=40000, sm=40)
    create_pod(cluster.core, pod("off-0", "offline", OFFLINE, share, finalizer=True), ns)
    create_pod(cluster.core, pod("off-1", "offline", OFFLINE, share), ns)
    running(cluster, ns, ["off-0", "off-1"], sched)
    create_pod(cluster.core, pod("web-0", "online", ONLINE, share), ns)
    until(lambda: record_of(get_pod(cluster.core, ns, "web-0")) is not None, 30, "web-0's preemption decided")
    create_pod(cluster.core, pod("web-1", "online", ONLINE, share), ns)
    until(lambda: record_of(get_pod(cluster.core, ns, "web-1")) is not None, 30, "web-1's hold decided")
    assert record_of(get_pod(cluster.core, ns, "web-1")).victims == ()  # type: ignore[union-attr]
    held = decode_reservations(get_node_annotations(cluster, node)["gpupack.io/reservations"], node)
    assert sorted(r.owner_name for r in held) == ["web-0", "web-1"]
    create_pod(cluster.core, pod("low", "online", LOW, share), ns)
    until(lambda: any(c.get("reason") == "Unschedulable" for c in
                      (get_pod(cluster.core, ns, "low").get("status") or {}).get("conditions") or []), 30,
          "low tried and parked")  # fmt: skip
    cluster.core.patch_namespaced_pod("off-0", ns, {"metadata": {"finalizers": None}})
    gone_and_bound(cluster, ns, "web-0", sched)
    until(lambda: get_pod(cluster.core, ns, "web-1")["spec"].get("nodeName") == node, 30, "web-1 bound there")
    assert not get_pod(cluster.core, ns, "low")["spec"].get("nodeName")
    check_all_bound_no_overcommit(cluster, ns)


def template(cls: str, prio: str, mem: int, sm: int, app: str) -> dict:
    return {
        "metadata": {"labels": {"app": app, "gpupack.io/class": cls}},
        "spec": {
            "schedulerName": "gpupack-scheduler",
            "priorityClassName": prio,
            "terminationGracePeriodSeconds": 5,
            "containers": [container("main", gpu=1, mem=mem, sm=sm)],
        },
    }


def test_online_deployment_scaling_2_to_8_takes_the_fewest_gpus_from_offline_jobs(
    cluster, ns, sfx, sched, kubelet
):
    """8 GPUs full of offline Job pods (four 20,000 MiB shares each); an online Deployment of
    40,000 MiB replicas scales from 2 to 8. Two replicas fit on one GPU, so the minimum is 4 GPUs'
    offline pods: 16 evictions (one GPU's worth per replica would be 32)."""
    for n in ("a", "b"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=4)
    batch = client.BatchV1Api(cluster.api_client())
    apps = client.AppsV1Api(cluster.api_client())
    job_spec = {"parallelism": 32, "completions": 32, "backoffLimit": 1000,
                "template": {**template("offline", OFFLINE, 20000, 20, "batch"),}}  # fmt: skip
    job_spec["template"]["spec"]["restartPolicy"] = "Never"
    batch.create_namespaced_job(ns, {"metadata": {"name": "batch"}, "spec": job_spec})

    def offline_running() -> int:
        return sum(
            1
            for p in list_pods(cluster.core, ns)
            if p["metadata"]["labels"].get("app") == "batch"
            and p["spec"].get("nodeName")
            and not p["metadata"].get("deletionTimestamp")
        )

    until(lambda: offline_running() == 32, 120, "32 offline Job pods on the 8 GPUs")
    victims = "gpupack_extender_preemption_victims_total"
    before = metric(sched, victims, pod_class="offline", priority="100")
    dep = {"metadata": {"name": "web"}, "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
           "template": template("online", ONLINE, 40000, 40, "web")}}  # fmt: skip
    apps.create_namespaced_deployment(ns, dep)

    def online_bound() -> int:
        return sum(
            1
            for p in list_pods(cluster.core, ns)
            if p["metadata"]["labels"].get("app") == "web"
            and p["spec"].get("nodeName")
            and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE
        )

    try:
        until(lambda: online_bound() == 2, 90, "2 online replicas placed")
        apps.patch_namespaced_deployment_scale("web", ns, {"spec": {"replicas": 8}})
        until(lambda: online_bound() == 8, 180, "8 online replicas placed")
    except AssertionError as e:
        raise AssertionError(f"{e}{diag(sched)}") from None
    assert metric(sched, victims, pod_class="offline", priority="100") - before == 16
    bound = [p for p in list_pods(cluster.core, ns) if p["spec"].get("nodeName")]
    check_no_overcommit(gpu_use(bound))
    assert offline_running() == 16  # the Job's replacements wait for idle GPUs


# --- CPU, memory and pod slots (issue 26 item 6) ---------------------------------------------


def cpu_pod(name: str, node: str, prio: str, cpu: str, cls: str = "offline", finalizer: bool = False) -> dict:
    """A pod of gpupack's scheduler that asks for CPU only, kept to `node` by its selector."""
    c = {"name": "main", "image": "registry.invalid/x:1", "resources": {"requests": {"cpu": cpu}}}
    p = pod(name, cls, prio, c, finalizer=finalizer)
    p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return p


def bound_names(cluster: realk8s.ControlPlane, ns: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in list_pods(cluster.core, ns)
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }


def test_cpu_only_pod_evicts_the_fewest_lowest_priority_pods_for_cpu(cluster, ns, sfx, sched, kubelet):
    node = f"cpu-{sfx}"
    cluster.make_node(node, cpu="8")
    fill = {
        "low-0": (LOW, "2500m"),
        "low-1": (LOW, "2500m"),
        "low-2": (LOW, "2500m"),
        "mid": (OFFLINE, "500m"),
    }
    for name, (prio, cpu) in fill.items():
        create_pod(cluster.core, cpu_pod(name, node, prio, cpu), ns)
    until(lambda: len(bound_names(cluster, ns)) == 4, 60, "8 CPUs filled")
    create_pod(cluster.core, cpu_pod("web", node, ONLINE, "2", cls="online"), ns)
    p = gone_and_bound(cluster, ns, "web", sched)
    rec = record_of(p)
    assert rec is not None and rec.node == node and len(rec.victims) == 1, rec
    victim = rec.victims[0].rsplit(":", 1)[0].split("/")[1]
    assert victim.startswith("low-"), victim  # the lowest priority, and one is enough
    left = bound_names(cluster, ns)
    assert "mid" in left and sum(n.startswith("low-") for n in left) == 2, left
    assert any(r.startswith("Preempting:") and victim in r for r in reasons(cluster, ns, "web"))


def test_a_full_node_gives_a_pod_slot_to_a_higher_priority_pod(cluster, ns, sfx, sched, kubelet):
    node = f"slots-{sfx}"
    cluster.make_node(node, pods="3")
    for name, prio in (("a", OFFLINE), ("b", LOW), ("c", OFFLINE)):
        create_pod(cluster.core, cpu_pod(name, node, prio, "100m"), ns)
    until(lambda: len(bound_names(cluster, ns)) == 3, 60, "3 pod slots filled")
    create_pod(cluster.core, cpu_pod("web", node, ONLINE, "100m", cls="online"), ns)
    p = gone_and_bound(cluster, ns, "web", sched)
    rec = record_of(p)
    assert rec is not None and [v.rsplit(":", 1)[0] for v in rec.victims] == [f"{ns}/b"], rec
    assert set(bound_names(cluster, ns)) == {"a", "c", "web"}


def test_a_lower_priority_pod_never_takes_held_cpu(cluster, ns, sfx, sched, kubelet):
    node = f"cpuhold-{sfx}"
    cluster.make_node(node, cpu="8")
    create_pod(cluster.core, cpu_pod("old", node, LOW, "4", finalizer=True), ns)
    create_pod(cluster.core, cpu_pod("keep", node, OFFLINE, "4"), ns)
    until(lambda: len(bound_names(cluster, ns)) == 2, 60, "8 CPUs filled")
    create_pod(cluster.core, cpu_pod("web", node, ONLINE, "4", cls="online"), ns)
    # the victim stays terminating (finalizer) while a lower-priority pod that fits in its room waits
    until(lambda: record_of(get_pod(cluster.core, ns, "web")) is not None, 30, "preemption decided")
    held = decode_reservations(get_node_annotations(cluster, node)["gpupack.io/reservations"], node)
    assert [(r.owner_name, r.host_cpu_milli, r.host_pods, r.containers) for r in held] == [
        ("web", 4000, 1, {})
    ]
    create_pod(cluster.core, cpu_pod("late", node, LOW, "2"), ns)
    until(lambda: get_pod(cluster.core, ns, "old")["metadata"].get("deletionTimestamp"), 30, "victim evicted")
    cluster.core.patch_namespaced_pod("old", ns, {"metadata": {"finalizers": None}})
    p = gone_and_bound(cluster, ns, "web", sched)
    assert p["spec"]["nodeName"] == node
    assert "late" not in bound_names(cluster, ns)  # and with web there, no room is left for it


# --- hostile pods ------------------------------------------------------------------------------


def test_a_victim_with_an_endless_grace_period_stops_no_preemption(cluster, ns, sfx, sched, kubelet):
    """The lowest-priority victim asks for 10^12 s of grace (the API takes any int64 >= 0): the
    hold's expiry is clamped, and both preemptors, each with a legal victim, are bound (the
    expiry raised OverflowError and aborted every pass: none was)."""
    for n in ("a", "b", "c"):
        gpu_node(cluster, f"gpu-{n}-{sfx}", n=1)
    hostile = pod("hostile", "offline", OFFLINE_LOW, container("main", gpu=1))
    hostile["spec"]["terminationGracePeriodSeconds"] = 10**12
    create_pod(cluster.core, hostile, ns)
    for i in range(2):
        create_pod(cluster.core, pod(f"off-{i}", "offline", OFFLINE, container("main", gpu=1)), ns)
    running(cluster, ns, ["hostile", "off-0", "off-1"], sched)
    errors = metric(sched, "gpupack_extender_preemptions_total", outcome="error")
    for i in range(2):
        create_pod(cluster.core, pod(f"web-{i}", "online", ONLINE, container("main", gpu=1)), ns)
    for i in range(2):
        gone_and_bound(cluster, ns, f"web-{i}", sched)
    assert "hostile" not in present(cluster, ns)  # it was the first choice, and it went
    assert metric(sched, "gpupack_extender_preemptions_total", outcome="error") == errors
    check_all_bound_no_overcommit(cluster, ns)


@pytest.mark.parametrize("case", ["pod-affinity", "missing-claim"])
def test_a_preemptor_that_cannot_run_anywhere_evicts_no_one(cluster, ns, sfx, sched, kubelet, case):
    """A higher-priority GPU pod with a required pod affinity to a label no pod carries, or a
    claim that does not exist: kube-scheduler says so ("didn't match pod affinity rules",
    'persistentvolumeclaim "..." not found') and no eviction can change it, so gpupack evicts no
    one over several passes, and says why in one Event."""
    gpu_node(cluster, f"gpu-a-{sfx}", n=1)
    create_pod(cluster.core, pod("off-0", "offline", OFFLINE, container("main", gpu=1)), ns)
    running(cluster, ns, ["off-0"], sched)
    before = {
        o: metric(sched, "gpupack_extender_preemptions_total", outcome=o) for o in ("infeasible", "evicted")
    }
    web = pod("web", "online", ONLINE, container("main", gpu=1))
    if case == "pod-affinity":
        web["spec"]["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": f"nobody-{sfx}"}}}]}}  # fmt: skip
    else:
        web["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "nowhere"}}]
    create_pod(cluster.core, web, ns)
    until(lambda: metric(sched, "gpupack_extender_preemptions_total", outcome="infeasible") >= before["infeasible"] + 5,
          30, "five passes refusing to preempt")  # fmt: skip
    pods = present(cluster, ns)
    assert "off-0" in pods and not pods["off-0"]["metadata"].get("deletionTimestamp")
    assert not pods["web"]["spec"].get("nodeName") and ANN_PREEMPTION not in annotations(pods["web"])
    assert metric(sched, "gpupack_extender_preemptions_total", outcome="evicted") == before["evicted"]
    said = [r for r in reasons(cluster, ns, "web") if r.startswith("NotPreempting:")]
    assert len(said) == 1 and ("pod affinity" if case == "pod-affinity" else "nowhere") in said[0], said
