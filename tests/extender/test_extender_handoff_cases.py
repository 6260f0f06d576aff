"""Issue 10, the extender's side of the bind -> Allocate handoff, against the real kube-apiserver and
(where the case is about the scheduler) the real kube-scheduler with gpupack's shipped profile:

- case 3: a pod left with an assignment and handoff=pending but no nodeName (failed Binding and failed
  rollback; extender killed between the PATCH and the Binding) locks no node, does not count against
  itself on its next filter, and is cleaned; a bound handoff older than the limit is resolved;
- case 4: the extender binds only while the scheduler beside it holds the leader Lease, and an
  in-flight bind that loses it writes no Binding;
- case 5: no node gets more GPU pods than its `gpupack.io/gpu` slots; zero allocatable, none;
- case 6: a node with a pending handoff is steered around, not waited for;
- case 7: a hung API call ends the bind within the bounded timeout;
- case 9: after an extender restart, pods parked by kube-scheduler are scheduled within seconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import realk8s
from ext_helpers import (
    DevicePluginEmulator,
    annotations,
    bind_body,
    container,
    create_pod,
    extender_with_scheduler,
    get_pod,
    gpu_node,
    inventory,
    kill_tree,
    list_pods,
    pod_obj,
)
from faultproxy import FaultProxy
from processes import ExtenderProcess
from test_extender_scheduler import events

from gpupack import handoff
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    HANDOFF_FAILED,
    HANDOFF_PENDING,
    LABEL_MANAGED,
    RES_GPU,
    Assignment,
    GPUShare,
    NodeInventory,
    decode_assignment,
)

until = realk8s.until


def filter_body(pod: dict, nodes: list[str]) -> dict:
    return {"Pod": pod, "NodeNames": nodes}


def small(name: str, mem: int = 10000, sm: int = 10) -> dict:
    return pod_obj(name, [container("c", 1, mem, sm)])


def metric(ext: ExtenderProcess, line_start: str) -> float:
    for line in ext.http.get(ext.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def write_stale_assignment(core, ns: str, pod: dict, node: str, age_s: float) -> dict:
    """What an extender before the one-write bind, killed between its PATCH and its Binding, left."""
    bound_at = datetime.now(UTC) - timedelta(seconds=age_s)
    a = Assignment(
        pod_uid=pod["metadata"]["uid"], node=node, pod_class="online",
        containers={"c": (GPUShare(uuid=f"GPU-{node}-0", index=0, mem_mib=60000, sm_pct=60),)},
        bound_at=handoff.rfc3339(bound_at),
    )  # fmt: skip
    body = {
        "metadata": {
            "annotations": handoff.handoff_annotations_for_bind(a),
            "labels": {LABEL_MANAGED: "true"},
        }
    }
    core.patch_namespaced_pod(pod["metadata"]["name"], ns, body)
    return get_pod(core, ns, pod["metadata"]["name"])


# --- case 3 -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _one_gpu_behind_proxy(cluster, ns, sfx, tmp_path, start_extender, *flags) -> Iterator[SimpleNamespace]:
    """A one-GPU node, an extender whose API calls go through a FaultProxy, and a pod p of 60000 MiB."""
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 1)
    with FaultProxy(cluster.url) as proxy:
        kc = cluster.write_kubeconfig(tmp_path / "kc-proxy", server=proxy.url)
        ext = start_extender(*flags, kubeconfig_path=kc)
        p = create_pod(cluster.core, small("p", 60000, 60), ns)
        yield SimpleNamespace(node=node, proxy=proxy, ext=ext, p=p)


def test_a_failed_binding_leaves_nothing_on_the_pod_and_locks_nothing(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    with _one_gpu_behind_proxy(cluster, ns, sfx, tmp_path, start_extender) as env:
        node, proxy, ext, p = env.node, env.proxy, env.ext, env.p
        proxy.fail_next("POST", r"/pods/p/binding$", 500)  # never reaches the API server
        r = ext.post("bind", bind_body(p, node))
        assert "Binding pod" in r.json()["Error"], r.text
        # one write binds and assigns: the Binding that failed wrote nothing, and no PATCH came first
        assert proxy.count("PATCH", r"/pods/p$") == 1  # only the fence that rules out a late Binding
        left = get_pod(cluster.core, ns, "p")
        assert not left["spec"].get("nodeName") and ANN_ASSIGNMENT not in annotations(left)
        assert ANN_HANDOFF not in annotations(left) and "gpupack.io/bind-fenced" in annotations(left)

        # its share was given back at once, and it locks no handoff: q (10000 MiB) binds without a wait,
        # and p (60000 MiB) still fits beside it on the one 80 GiB GPU
        q = create_pod(cluster.core, small("q", 10000, 10), ns)
        assert ext.post("bind", bind_body(q, node)).json() == {"Error": ""}, ext.tail()
        out = ext.post("filter", filter_body(left, [node])).json()
        assert out["NodeNames"] == [node], out


def test_a_binding_whose_answer_is_lost_is_known_done_and_its_gpu_stays_charged(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    with _one_gpu_behind_proxy(cluster, ns, sfx, tmp_path, start_extender) as env:
        node, proxy, ext, p = env.node, env.proxy, env.ext, env.p
        proxy.lose_answer_next("POST", r"/pods/p/binding$", 504)  # the API server binds; the answer is lost
        assert ext.post("bind", bind_body(p, node)).json() == {"Error": ""}, ext.tail()
        bound = get_pod(cluster.core, ns, "p")
        assert bound["spec"]["nodeName"] == node
        a = decode_assignment(annotations(bound)[ANN_ASSIGNMENT])
        assert a.pod_uid == p["metadata"]["uid"] and annotations(bound)[ANN_HANDOFF] == HANDOFF_PENDING
        # the fence's precondition failed (the Binding had changed the pod): nothing else was written
        assert "gpupack.io/bind-fenced" not in annotations(bound)
        # p's 60000 MiB stay charged: another pod of 60000 MiB does not fit on the one GPU
        r = create_pod(cluster.core, small("r", 60000, 60), ns)
        out = ext.post("filter", filter_body(r, [node])).json()
        assert out["NodeNames"] == [], out


def test_a_binding_of_unknown_outcome_keeps_its_gpu_until_the_janitor_settles_it(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    with _one_gpu_behind_proxy(
        cluster, ns, sfx, tmp_path, start_extender, "--sweep-interval-s", "0.3"
    ) as env:
        node, proxy, ext, p = env.node, env.proxy, env.ext, env.p
        # neither the Binding nor the fence that would settle it get an answer (the API server is away)
        proxy.fail_next("POST", r"/pods/p/binding$", 503)
        proxy.fail_next("PATCH", r"/pods/p$", 503, times=4)
        r = ext.post("bind", bind_body(p, node))
        assert "not known yet" in r.json()["Error"], r.text
        # meanwhile the Binding may still land: p's share stays held, and so does the node's handoff
        big = create_pod(cluster.core, small("big", 60000, 60), ns)
        assert ext.post("filter", filter_body(big, [node])).json()["NodeNames"] == []
        # the API server answers again: the janitor fences the Binding out and gives the share back
        until(lambda: ext.post("filter", filter_body(big, [node])).json()["NodeNames"] == [node], 20,
              "p's held share released by the janitor")  # fmt: skip
        left = get_pod(cluster.core, ns, "p")
        assert not left["spec"].get("nodeName") and "gpupack.io/bind-fenced" in annotations(left)
        assert ANN_ASSIGNMENT not in annotations(left)


def test_a_pod_whose_binding_has_an_unknown_outcome_is_settled_before_it_is_bound_again(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    with _one_gpu_behind_proxy(
        cluster, ns, sfx, tmp_path, start_extender, "--sweep-interval-s", "600"
    ) as env:
        node, proxy, ext, p = env.node, env.proxy, env.ext, env.p
        proxy.fail_next("POST", r"/pods/p/binding$", 503)
        proxy.fail_next("PATCH", r"/pods/p$", 503)
        assert "not known yet" in ext.post("bind", bind_body(p, node)).json()["Error"]
        # kube-scheduler retries the pod before any janitor pass: the earlier Binding is fenced out
        # first (it could otherwise land after this bind, with its GPUs charged nowhere), then p binds
        assert ext.post("bind", bind_body(p, node)).json() == {"Error": ""}, ext.tail()
        bound = get_pod(cluster.core, ns, "p")
        assert bound["spec"]["nodeName"] == node and "gpupack.io/bind-fenced" in annotations(bound)
        assert decode_assignment(annotations(bound)[ANN_ASSIGNMENT]).pod_uid == p["metadata"]["uid"]
        assert proxy.count("POST", r"/pods/p/binding$") >= 2
        # charged once: 60000 MiB more do not fit on the one GPU, 10000 do
        big = create_pod(cluster.core, small("big", 60000, 60), ns)
        assert ext.post("filter", filter_body(big, [node])).json()["NodeNames"] == []


def test_extender_killed_while_its_binding_is_in_flight_leaves_no_locked_node(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    with _one_gpu_behind_proxy(cluster, ns, sfx, tmp_path, start_extender, "--api-timeout-s", "8") as env:
        node, proxy, first, p = env.node, env.proxy, env.ext, env.p
        proxy.delay(r"/pods/p/binding$", 6, method="POST")
        proxy.fail_next("POST", r"/pods/p/binding$", 500)  # never reaches the API server
        threading.Thread(target=lambda: _quiet(first.post, "bind", bind_body(p, node)), daemon=True).start()
        until(lambda: proxy.count("POST", r"/pods/p/binding$") == 1, 10, "Binding posted", interval=0.02)
        kill_tree(first.proc)  # SIGKILL while the Binding is in flight
    left = get_pod(cluster.core, ns, "p")
    assert not left["spec"].get("nodeName") and ANN_ASSIGNMENT not in annotations(left)

    second = start_extender()
    q = create_pod(cluster.core, small("q", 10000, 10), ns)
    r = second.post("bind", bind_body(q, node))
    assert r.json() == {"Error": ""}, (r.text, second.tail())  # nothing of p's holds the node
    # and p (60000 MiB) fits beside q (10000 MiB)
    out = second.post("filter", filter_body(get_pod(cluster.core, ns, "p"), [node])).json()
    assert out["NodeNames"] == [node], out


def test_an_old_unbound_assignment_is_removed_before_the_pod_is_bound(
    cluster, ns, sfx, kubeconfig, tmp_path, start_extender
):
    """An extender before the one-write bind could leave an assignment on a pod that never got its
    Binding; a Binding cannot remove annotations, so the bind removes it first."""
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 1)
    ext = start_extender()
    p = create_pod(cluster.core, small("p", 60000, 60), ns)
    stale = write_stale_assignment(cluster.core, ns, p, node, age_s=60)
    assert ext.post("bind", bind_body(stale, node)).json() == {"Error": ""}, ext.tail()
    bound = get_pod(cluster.core, ns, "p")
    a = decode_assignment(annotations(bound)[ANN_ASSIGNMENT])
    assert (
        bound["spec"]["nodeName"] == node
        and a.bound_at != decode_assignment(annotations(stale)[ANN_ASSIGNMENT]).bound_at
    )


def _quiet(fn, *a) -> None:
    with contextlib.suppress(Exception):  # the extender was killed under this request
        fn(*a, timeout=30)


def test_a_bound_handoff_older_than_the_limit_is_reported_and_resolved(cluster, ns, sfx, start_extender):
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 1)
    ext = start_extender("--stale-handoff-s", "2", "--sweep-interval-s", "0.3", "--bind-wait-s", "1")
    p = create_pod(cluster.core, small("p"), ns)
    assert ext.post("bind", bind_body(p, node)).json() == {"Error": ""}
    # no kubelet ever admits p (no KubeletEmulator here): the node is locked while p is pending
    q = create_pod(cluster.core, small("q"), ns)
    assert "waiting for the kubelet to admit pod" in ext.post("bind", bind_body(q, node)).json()["Error"]
    until(lambda: annotations(get_pod(cluster.core, ns, "p")).get(ANN_HANDOFF) == HANDOFF_FAILED, 15,
          "stale handoff marked failed")  # fmt: skip
    # the extender counts the resolution after its patch returns: the annotation can be seen first
    until(lambda: metric(ext, 'gpupack_extender_annotation_problems_total{kind="stale-handoff-resolved"}') >= 1,
          5, "stale-handoff-resolved counted")  # fmt: skip
    assert "pending for" in ext.log.read_text()

    def handoff_events() -> list:
        evs = cluster.core.list_namespaced_event(ns, field_selector="involvedObject.name=p").items
        return [e for e in evs if e.reason == "GPUHandoffFailed"]

    # the pod's owner learns it from the pod itself (kubectl describe), not only from the extender's log
    until(handoff_events, 10, "a GPUHandoffFailed event on p")
    (ev,) = handoff_events()
    assert ev.type == "Warning" and ev.source.component == "gpupack-extender"
    assert ev.involved_object.uid == p["metadata"]["uid"] and f"node {node}" in ev.message
    until(
        lambda: ext.post("bind", bind_body(q, node)).json() == {"Error": ""}, 10, "q bound after p resolved"
    )


# --- case 4 -------------------------------------------------------------------------------------
def _lease(cluster, ns: str, name: str, holder: str, renewed_ago_s: float = 0.0, duration: int = 15) -> None:
    now = datetime.now(UTC) - timedelta(seconds=renewed_ago_s)
    t = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "acquireTime": t, "renewTime": t}}  # fmt: skip
    from kubernetes import client

    api = client.CoordinationV1Api(cluster.api_client())
    for _ in range(10):  # a running kube-scheduler renews it concurrently: 409, read again
        try:
            cur = api.read_namespaced_lease(name, ns)
            body["metadata"]["resourceVersion"] = cur.metadata.resource_version
            api.replace_namespaced_lease(name, ns, body)
            return
        except client.ApiException as e:
            if e.status == 404:
                api.create_namespaced_lease(ns, body)
                return
            if e.status != 409:
                raise
    raise AssertionError(f"could not write Lease {ns}/{name}")


def test_only_the_lease_holders_extender_binds_and_an_inflight_bind_that_loses_it_writes_nothing(
    cluster, ns, sfx, tmp_path, start_extender
):
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 2)
    with FaultProxy(cluster.url) as proxy:
        kc = cluster.write_kubeconfig(tmp_path / "kc-proxy", server=proxy.url)
        ext = start_extender(
            "--lease-namespace", ns, "--lease-name", "sched", "--identity", "me", kubeconfig_path=kc
        )
        p = create_pod(cluster.core, small("p"), ns)

        def refused(holder_text: str) -> None:
            r = ext.post("bind", bind_body(p, node)).json()
            assert holder_text in r["Error"], r
            assert ANN_ASSIGNMENT not in annotations(get_pod(cluster.core, ns, "p"))

        refused("cannot read Lease")  # no Lease at all
        _lease(cluster, ns, "sched", "standby-pod_1234")
        refused("is held by standby-pod_1234")
        _lease(cluster, ns, "sched", "me_5678", renewed_ago_s=14)  # ours, but about to expire
        refused("expires in")
        assert proxy.count("PATCH", r"/pods/p$") == 0 and proxy.count("POST", r"/binding$") == 0

        _lease(cluster, ns, "sched", "me_5678")
        assert ext.post("bind", bind_body(p, node)).json() == {"Error": ""}
        # one write: the Binding carries the assignment (no PATCH of the pod before or after it)
        assert proxy.count("PATCH", r"/pods/p$") == 0 and proxy.count("POST", r"/pods/p/binding$") == 1
        pp = get_pod(cluster.core, ns, "p")
        assert pp["spec"].get("nodeName") == node and ANN_ASSIGNMENT in annotations(pp), pp["metadata"]

        # An in-flight bind whose scheduler loses the Lease before the bind reaches its write: q's
        # bind passes its first Lease check and reads q, then waits for p's handoff (pending on
        # `node`: no kubelet here). The Lease moves during that wait and p's handoff completes right
        # after, well within a second of the bind's last good read of the Lease: only a read made
        # after the move, right before the Binding, can stop this write.
        q = create_pod(cluster.core, small("q"), ns)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(ext.post("bind", bind_body(q, node)).json()))
        t.start()
        until(
            lambda: proxy.count("GET", r"/pods/q$") == 1, 10, "q's bind past its first check", interval=0.01
        )
        _lease(cluster, ns, "sched", "new-leader_9")
        done = {ANN_ALLOCATED: json.dumps(["c"]), ANN_HANDOFF: HANDOFF_DONE}  # what the device plugin writes
        cluster.core.patch_namespaced_pod("p", ns, {"metadata": {"annotations": done}})
        t.join(30)
        assert "is held by new-leader_9" in out.get("Error", ""), out
        assert proxy.count("POST", r"/pods/q/binding$") == 0 and proxy.count("PATCH", r"/pods/q$") == 0
        qq = get_pod(cluster.core, ns, "q")
        assert not qq["spec"].get("nodeName") and ANN_ASSIGNMENT not in annotations(qq), qq["metadata"]
        assert metric(ext, 'gpupack_extender_bind_failures_total{reason="not-leader"}') >= 4


def test_real_scheduler_with_leader_election_binds_through_its_fenced_extender(
    cluster, ns, sfx, tmp_path, start_extender
):
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 2)
    # --identity defaults to the host name, which kube-scheduler writes as `<hostname>_<uuid>`
    ext = start_extender("--lease-namespace", ns, "--lease-name", "gpupack-scheduler")
    le = {"leaderElect": True, "resourceNamespace": ns, "resourceName": "gpupack-scheduler",
          "resourceLock": "leases", "leaseDuration": "15s", "renewDeadline": "10s", "retryPeriod": "2s"}  # fmt: skip
    sched = cluster.start_scheduler(
        realk8s.gpupack_scheduler_config(ext.url), name="gpupack-scheduler-le", leader_election=le
    )
    try:
        with realk8s.KubeletEmulator(cluster, ns, on_admit=DevicePluginEmulator(cluster)):
            create_pod(cluster.core, small("p"), ns)
            until(lambda: get_pod(cluster.core, ns, "p")["spec"].get("nodeName"), 30,
                  f"p bound by the leader\n{sched.tail()}\n{ext.tail()}")  # fmt: skip
            # another replica takes over (as after this one's lease expired): this extender stops
            _lease(cluster, ns, "gpupack-scheduler", "other-replica_1")
            create_pod(cluster.core, small("q"), ns)
            until(lambda: metric(ext, 'gpupack_extender_bind_failures_total{reason="not-leader"}') >= 1, 30,
                  f"bind of q refused\n{sched.tail()}")  # fmt: skip
            assert not get_pod(cluster.core, ns, "q")["spec"].get("nodeName")
            assert ANN_ASSIGNMENT not in annotations(get_pod(cluster.core, ns, "q"))
    finally:
        sched.stop()


# --- case 7 -------------------------------------------------------------------------------------
def test_a_hung_api_call_ends_the_bind_within_its_timeout_and_holds_no_lock(
    cluster, ns, sfx, tmp_path, start_extender
):
    node = f"gpu-{sfx}"
    gpu_node(cluster, node, 1)
    with FaultProxy(cluster.url) as proxy:
        kc = cluster.write_kubeconfig(tmp_path / "kc-proxy", server=proxy.url)
        ext = start_extender("--api-timeout-s", "1.5", kubeconfig_path=kc)
        p = create_pod(cluster.core, small("p"), ns)
        proxy.delay(r"/pods/p/binding$", 30, method="POST")
        proxy.fail_next("POST", r"/pods/p/binding$", 500)  # if it ever got there
        t0 = time.monotonic()
        r = ext.post("bind", bind_body(p, node)).json()
        took = time.monotonic() - t0
        # far below kube-scheduler's 15 s httpTimeout; the API call's timeout ends it
        assert took < 6 and "timed out" in r["Error"], (took, r)
        q = create_pod(cluster.core, small("q"), ns)
        assert ext.post("bind", bind_body(q, node)).json() == {"Error": ""}


# --- cases 5, 6, 9: the real kube-scheduler ---------------------------------------------------------
@pytest.fixture(scope="module")
def sched(k8s: realk8s.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    yield from extender_with_scheduler(
        k8s, tmp_path_factory.mktemp("sched-handoff"), "gpupack-scheduler-handoff", "--bind-wait-s", "3"
    )


def _bound(cluster, ns: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in list_pods(cluster.core, ns)
        if p["spec"].get("nodeName")
    }


def test_no_node_gets_more_gpu_pods_than_its_slots_and_a_node_without_slots_gets_none(
    cluster, ns, sfx, sched
):
    full, gone = f"gpu-few-slots-{sfx}", f"gpu-plugin-gone-{sfx}"
    # a GPU of 3 slots, as its inventory and its kubelet both say (an inventory with more slots
    # than the kubelet offers is refused outright: test_inventory_vs_kubelet.py)
    gpu_node(
        cluster, full, 1, raw_inventory=NodeInventory(gpus=inventory(full, 1).gpus, slots_per_gpu=3).to_json()
    )
    realk8s.set_node_status(cluster.core, full, {"cpu": "64", "memory": "512Gi", "pods": "250", RES_GPU: "3"})
    gpu_node(cluster, gone, 1)  # the device plugin died: the kubelet reports 0 allocatable
    realk8s.set_node_status(cluster.core, gone, {"cpu": "64", "memory": "512Gi", "pods": "250", RES_GPU: "0"})
    with realk8s.KubeletEmulator(cluster, ns, on_admit=DevicePluginEmulator(cluster)):
        for i in range(5):
            create_pod(cluster.core, small(f"p{i}", 1000, 1), ns)
        until(lambda: len(_bound(cluster, ns)) == 3, 30, "three pods bound")
        # binds raced past the filter are refused by the bind itself (it fits again under the
        # view's lock); the pods stay Pending with the reason
        for name in [f"p{i}" for i in range(5) if f"p{i}" not in _bound(cluster, ns)]:
            until(lambda n=name: [m for m in events(cluster, ns, n) if "0 of 3 free" in m], 30,
                  f"{name}: FailedScheduling naming the slots")  # fmt: skip
        create_pod(cluster.core, small("late", 1000, 1), ns)
        msgs = until(lambda: [m for m in events(cluster, ns, "late") if "0 of 3 free" in m], 30,
                     "late: FailedScheduling naming the slots")  # fmt: skip
        assert "no gpupack.io/gpu slots allocatable" in msgs[0], msgs
        assert set(_bound(cluster, ns).values()) == {full}
        time.sleep(1)
        assert len(_bound(cluster, ns)) == 3


def test_a_node_with_a_pending_handoff_is_steered_around_not_waited_for(cluster, ns, sfx, sched):
    a, b = f"gpu-a-{sfx}", f"gpu-b-{sfx}"
    gpu_node(cluster, a, 2)
    # no kubelet admits anything here: a bound pod's handoff stays pending, its node locked
    create_pod(cluster.core, small("first", 10000, 10), ns)
    assert until(lambda: _bound(cluster, ns).get("first"), 30, "first bound") == a
    gpu_node(cluster, b, 1)
    # the policy prefers `a` for this one (scores a 10, b 0 when nothing is pending): without
    # steering its bind waits for `first` there, fails after --bind-wait-s, and goes round again
    t0 = time.monotonic()
    create_pod(cluster.core, small("second", 60000, 60), ns)
    second = until(lambda: _bound(cluster, ns).get("second"), 30, "second bound", interval=0.05)
    took = time.monotonic() - t0
    assert second == b and took < 10, (second, took)


def test_pods_parked_while_the_extender_was_down_are_scheduled_seconds_after_it_is_back(
    cluster, ns, sfx, sched
):
    gpu_node(cluster, f"gpu-{sfx}", 4)
    kill_tree(sched.ext.proc)  # SIGKILL, as a crashed sidecar
    names = [f"w{i}" for i in range(3)]
    for n in names:
        create_pod(cluster.core, small(n, 1000, 1), ns)

    def failed(name: str) -> bool:
        """kube-scheduler records the event before it patches PodScheduled=False, and the restarted
        extender's one requeue pass touches only pods with that condition: wait for both."""
        conds = get_pod(cluster.core, ns, name)["status"].get("conditions") or []
        return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conds)

    for n in names:  # each attempt ended in an extender error: kube-scheduler parks the pod
        until(lambda n=n: [m for m in events(cluster, ns, n) if "/filter" in m] and failed(n), 30,
              f"{n} failed scheduling with the extender down")  # fmt: skip
    sched.ext = ExtenderProcess(sched.kc, sched.tmp / "extender-1.log", *sched.flags, port=sched.port)
    t0 = time.monotonic()
    sched.ext.wait_ready()
    with realk8s.KubeletEmulator(cluster, ns, on_admit=DevicePluginEmulator(cluster)):
        until(lambda: len(_bound(cluster, ns)) == 3, 30,
              f"the parked pods bound\n{sched.proc.tail(3000)}\n{sched.ext.tail()}")  # fmt: skip
    took = time.monotonic() - t0
    assert took < 15, took  # kube-scheduler's own flush of parked pods comes after 5 minutes


def test_device_plugin_probes_do_not_touch_the_api_server():
    """Case 7's other half: /healthz and /readyz answer at once while /metrics waits on a hung
    API server, and the shipped DaemonSet probes those, not /metrics."""
    import urllib.request

    import yaml

    from deviceplugin.health import DeviceState
    from deviceplugin.metrics import Metrics

    hung = threading.Event()
    m = Metrics("n", DeviceState([], []), list_pods=lambda: hung.wait(20) and [], ttl_s=0)
    server = m.serve(0, "127.0.0.1", ready=lambda: "")
    try:
        url = f"http://127.0.0.1:{server.port}"
        for path in ("/healthz", "/readyz"):
            t0 = time.monotonic()
            assert urllib.request.urlopen(url + path, timeout=5).read() == b"ok\n"
            assert time.monotonic() - t0 < 1
    finally:
        hung.set()
        server.stop()
    repo = Path(__file__).resolve().parents[2]
    ds = yaml.safe_load((repo / "deploy" / "deviceplugin" / "daemonset.yaml").read_text())
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c.get("livenessProbe")]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_shipped_extender_is_fenced_by_the_schedulers_lease():
    repo = Path(__file__).resolve().parents[2]
    import yaml

    dep = yaml.safe_load((repo / "deploy" / "scheduler" / "deployment.yaml").read_text())
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
    cm = yaml.safe_load((repo / "deploy" / "scheduler" / "config.yaml").read_text())
    le = yaml.safe_load(cm["data"]["config.yaml"])["leaderElection"]
    assert f"--lease-namespace={le['resourceNamespace']}" in c["args"]
    assert f"--lease-name={le['resourceName']}" in c["args"]
    assert json.dumps(c["args"]).count("--identity") == 0  # the pod's host name, as kube-scheduler's
