"""The extender process (gunicorn) against an in-test Kubernetes API server, over real HTTP."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time

import pytest
import requests
from ext_helpers import H100_MIB, FakeKubelet, container, node_obj, payloads, pod_obj

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_PENDING,
    LABEL_MANAGED,
    decode_assignment,
)


def create_pod(kubeapi, pod):
    body = copy.deepcopy(pod)
    meta = body["metadata"]
    for k in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
        meta.pop(k, None)
    body.pop("status", None)
    body["spec"].pop("nodeName", None)
    return kubeapi.create("pods", body)


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_scheduler_conversation(mode, kubeapi, start_extender):
    for n in ("gpu-node-a", "gpu-node-b"):
        kubeapi.create("nodes", node_obj(n, 4))
    ext = start_extender("--bind-wait-s", "5")
    uids = {}
    with FakeKubelet(kubeapi):
        for verb, body in payloads(mode):
            if verb in ("filter", "prioritize"):
                name = body["Pod"]["metadata"]["name"]
                if name not in uids:
                    uids[name] = create_pod(kubeapi, body["Pod"])["metadata"]["uid"]
                body["Pod"]["metadata"]["uid"] = uids[name]
                r = ext.post(verb, body)
                assert r.status_code == 200, r.text
                out = r.json()
                if verb == "filter":
                    assert out["NodeNames"] == ["gpu-node-a", "gpu-node-b"] and out["Error"] == ""
                    if mode == "nodecache-false":
                        assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == out["NodeNames"]
                else:
                    assert sorted(s["Host"] for s in out) == ["gpu-node-a", "gpu-node-b"]
            else:
                body["PodUID"] = uids[body["PodName"]]
                r = ext.post("bind", body)
                assert r.status_code == 200 and r.json() == {"Error": ""}, r.text
                pod = kubeapi.get("pods", body["PodName"], "default")
                assert pod["spec"]["nodeName"] == body["Node"]
                a = decode_assignment(pod["metadata"]["annotations"][ANN_ASSIGNMENT])
                assert a.node == body["Node"] and a.pod_uid == body["PodUID"]
                assert pod["metadata"]["labels"][LABEL_MANAGED] == "true"
    trainer = decode_assignment(kubeapi.get("pods", "trainer-2gpu", "default")["metadata"]["annotations"][ANN_ASSIGNMENT])
    shares = trainer.containers["train"]
    assert len(shares) == 2 and all(s.exclusive and s.mem_mib == H100_MIB for s in shares)
    batch = decode_assignment(kubeapi.get("pods", "batch-eval-offline", "default")["metadata"]["annotations"][ANN_ASSIGNMENT])
    assert list(batch.containers) == ["warmup", "worker-a", "worker-b"]
    assert batch.containers["worker-a"][0].mem_mib == 20000 and batch.containers["worker-a"][0].sm_pct == 50
    # whole GPUs of the trainer never overlap the batch pod's GPUs on the same node
    if trainer.node == batch.node:
        assert not trainer.gpu_uuids() & batch.gpu_uuids()
    if mode == "nodecache-true":  # (once is enough: the concurrency test checks it too)
        # the extender's view equals what a fresh process rebuilds from the API
        second = start_extender()
        assert wait_for(lambda: ext.reserved() == second.reserved() and ext.reserved(), what="same reservations")


def _gpu_use(kubeapi):
    use: dict[str, list[int]] = {}
    for p in kubeapi.list("pods"):
        raw = p["metadata"].get("annotations", {}).get(ANN_ASSIGNMENT)
        if raw and p["spec"].get("nodeName"):
            for shares in decode_assignment(raw).containers.values():
                for s in shares:
                    u = use.setdefault(s.uuid, [0, 0, 0])
                    u[0] += s.mem_mib
                    u[1] += s.sm_pct
                    u[2] += 1 if s.exclusive else 0
    return use


def test_concurrent_binds_to_one_node_never_overcommit(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 2))
    kubeapi.create("nodes", node_obj("n2", 1))
    ext = start_extender("--bind-wait-s", "20")
    pods = [create_pod(kubeapi, pod_obj(f"p{i}", [container("c", 1, 20000, 20)])) for i in range(24)]
    results: dict[str, str] = {}

    def bind(p, node):
        r = ext.post("bind", {"PodName": p["metadata"]["name"], "PodNamespace": "default",
                              "PodUID": p["metadata"]["uid"], "Node": node}, timeout=60)
        assert r.status_code == 200, r.text
        results[p["metadata"]["name"]] = r.json()["Error"]

    with FakeKubelet(kubeapi):
        threads = [threading.Thread(target=bind, args=(p, "n1" if i % 3 else "n2")) for i, p in enumerate(pods)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    ok = [n for n, e in results.items() if not e]
    # 4 pods of 20000 MiB per 81559 MiB GPU: 8 on n1, 4 on n2
    assert len(ok) == 12, results
    failed = [e for e in results.values() if e]
    assert all("no GPU with 20000 MiB free" in e for e in failed), failed
    for uuid, (mem, sm, _) in _gpu_use(kubeapi).items():
        assert mem <= H100_MIB and sm <= 100, uuid
    unbound = [p for p in kubeapi.list("pods") if not p["spec"].get("nodeName")]
    assert all(ANN_ASSIGNMENT not in p["metadata"].get("annotations", {}) for p in unbound)
    second = start_extender()
    assert wait_for(lambda: ext.reserved() == second.reserved(), what="same reservations after restart")


def test_pending_handoff_blocks_the_node_until_the_pod_is_gone(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 2))
    ext = start_extender("--bind-wait-s", "0.5")
    a = create_pod(kubeapi, pod_obj("a", [container("c", 1, 1000, 10)]))
    b = create_pod(kubeapi, pod_obj("b", [container("c", 1, 1000, 10)]))
    bind = lambda p: ext.post("bind", {"PodName": p["metadata"]["name"], "PodNamespace": "default",  # noqa: E731
                                       "PodUID": p["metadata"]["uid"], "Node": "n1"}).json()["Error"]
    assert bind(a) == ""
    assert kubeapi.get("pods", "a", "default")["metadata"]["annotations"][ANN_HANDOFF] == HANDOFF_PENDING
    err = bind(b)
    assert "node n1: waiting for the kubelet to admit pod default/a (GPU handoff pending since" in err
    assert ANN_ASSIGNMENT not in kubeapi.get("pods", "b", "default")["metadata"].get("annotations", {})
    kubeapi.delete("pods", "a", "default")
    assert wait_for(lambda: bind(b) == "", what="bind after the blocker is gone")


def test_failed_binding_rolls_back_and_conflicts_are_retried(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 1))
    ext = start_extender()
    p = create_pod(kubeapi, pod_obj("p", [container("c", 1, 60000, 10)]))
    args = {"PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"], "Node": "n1"}
    kubeapi.fail_next("POST", r"/pods/p/binding$", 500, message="etcd is unhappy")
    err = ext.post("bind", args).json()["Error"]
    assert "Binding pod default/p to node n1 failed: 500" in err and "etcd is unhappy" in err
    ann = kubeapi.get("pods", "p", "default")["metadata"].get("annotations", {})
    assert ANN_ASSIGNMENT not in ann and ANN_HANDOFF not in ann
    assert wait_for(lambda: ext.reserved().get(("n1", "0"), (1, 1))[0] == 0, what="reservation released")
    # a conflicting update of the pod between read and PATCH: re-read and retry
    kubeapi.fail_next("PATCH", r"/pods/p$", 409, reason="Conflict", message="the object has been modified")
    assert ext.post("bind", args).json() == {"Error": ""}
    pod = kubeapi.get("pods", "p", "default")
    assert pod["spec"]["nodeName"] == "n1" and ANN_ALLOCATED not in pod["metadata"]["annotations"]
    assert ext.reserved()[("n1", "0")] == (60000, 10)
    # a retried bind of a pod already bound here is a success; elsewhere it is an error
    assert ext.post("bind", args).json() == {"Error": ""}


HOSTILE = [
    ("filter", b"{not json", 400, "not valid JSON"),
    ("filter", b"", 400, "empty request body"),
    ("filter", b"[" * 100000 + b"]" * 100000, 400, "JSON"),
    ("filter", {"Pod": 5, "NodeNames": ["n1"]}, 400, "Pod object"),
    ("filter", {"Pod": pod_obj("x", [container("c", 1, 10)]), "NodeNames": "n1"}, 400, "list of strings"),
    ("filter", {"Pod": pod_obj("x", [container("c", 1, 10)]), "NodeNames": ["ghost"]}, 400, "none of the 1"),
    ("filter", {"Pod": pod_obj("x", [{"name": "c", "image": "i"}]), "NodeNames": ["n1"]}, 400, "no gpupack GPU"),
    ("prioritize", {"Pod": pod_obj("x", [container("c", 1, "lots")]), "NodeNames": ["n1"]}, 400, "quantity"),
    ("bind", {"PodName": "p", "PodNamespace": "default", "Node": "ghost"}, 404, "node ghost"),
    ("bind", {"PodName": "nope", "PodNamespace": "default", "Node": "n1"}, 404, "pod default/nope not found"),
    ("bind", {"PodName": ["p"], "PodNamespace": "default", "Node": "n1"}, 400, "PodName must be a string"),
    ("bind", b"x" * (10 * 1024 * 1024), 413, "larger than"),
]


def test_malformed_and_hostile_bodies_get_4xx_and_lose_nothing(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 1))
    ext = start_extender()
    p = create_pod(kubeapi, pod_obj("p", [container("c", 1, 30000, 30)]))
    assert ext.post("bind", {"PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                             "Node": "n1"}).json() == {"Error": ""}
    before = ext.reserved()
    for verb, body, status, needle in HOSTILE:
        r = ext.post(verb, body)
        assert r.status_code == status, (verb, r.status_code, r.text[:200])
        assert needle in r.json()["Error"], (verb, r.text[:300])
    assert ext.http.get(ext.url + "/healthz").status_code == 200
    assert ext.reserved() == before == {("n1", "0"): (30000, 30)}
    metrics = ext.http.get(ext.url + "/metrics").text
    assert 'gpupack_extender_bad_requests_total{verb="filter"}' in metrics
    assert 'gpupack_extender_request_seconds_bucket{le="0.001",verb="bind"}' in metrics
    assert "gpupack_cluster_fragmentation_ratio 1.0" in metrics


def test_watch_resumes_and_relists_after_410(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 1))
    ext = start_extender()
    p = create_pod(kubeapi, pod_obj("p", [container("c", 1, 30000, 30)]))
    args = {"PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"], "Node": "n1"}
    assert ext.post("bind", args).json() == {"Error": ""}
    probe = create_pod(kubeapi, pod_obj("probe", [container("c", 1, 10)]))
    filt = lambda: ext.post("filter", {"Pod": probe, "NodeNames": ["n1"]}).json()  # noqa: E731

    def lists(path):
        return len([r for r in kubeapi.requests if r.path == path and r.query.get("watch") not in ("true", "1")])

    base = (lists("/api/v1/pods"), lists("/api/v1/nodes"))
    # API server restart: the watches reconnect from their resourceVersion without relisting
    kubeapi.stop()
    kubeapi.start()
    kubeapi.patch("nodes", "n1", {"spec": {"unschedulable": True}})
    wait_for(lambda: "cordoned" in filt()["FailedAndUnresolvableNodes"].get("n1", ""), what="cordon seen")
    assert (lists("/api/v1/pods"), lists("/api/v1/nodes")) == base
    # history compacted while the watch is down: reconnecting gets 410 Gone and must relist
    kubeapi.stop()
    kubeapi.delete("pods", "p", "default")
    kubeapi.patch("nodes", "n1", {"spec": {"unschedulable": False}})
    kubeapi.compact()
    kubeapi.start()
    assert wait_for(lambda: ext.reserved().get(("n1", "0")) == (0, 0), what="deletion seen after relist")
    assert wait_for(lambda: filt()["NodeNames"] == ["n1"], what="uncordon seen after relist")
    assert lists("/api/v1/pods") > base[0] and lists("/api/v1/nodes") > base[1]
    # a new node appears through the node watch
    kubeapi.create("nodes", node_obj("n2", 1))
    wait_for(lambda: ext.post("filter", {"Pod": probe, "NodeNames": ["n2"]}).json().get("NodeNames") == ["n2"],
             what="n2 known")


def test_readyz_waits_for_first_sync(kubeapi, start_extender):
    kubeapi.create("nodes", node_obj("n1", 1))
    kubeapi.delay(r"^/api/v1/pods$", 1.5, method="GET", times=1)
    ext = start_extender(ready=False)
    deadline = time.monotonic() + 20
    codes = []
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):  # not listening yet
            codes.append(ext.http.get(ext.url + "/readyz", timeout=1).status_code)
        if codes and codes[-1] == 200:
            break
        time.sleep(0.05)
    assert 503 in codes and codes[-1] == 200
    pod = pod_obj("x", [container("c", 1, 10)])
    assert ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]}).json()["NodeNames"] == ["n1"]


def test_status_cli_json_and_table(kubeapi, kubeconfig, start_extender):
    import subprocess
    import sys

    kubeapi.create("nodes", node_obj("n1", 2))
    kubeapi.create("nodes", node_obj("broken", raw_inventory="{oops"))
    ext = start_extender()
    p = create_pod(kubeapi, pod_obj("p", [container("c", 1, 30000, 30)], cls="offline"))
    assert ext.post("bind", {"PodName": "p", "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                             "Node": "n1"}).json() == {"Error": ""}
    run = lambda *a: subprocess.run([sys.executable, "-m", "gpupack", "status", "--kubeconfig", str(kubeconfig), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    out = run("--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    n1 = next(n for n in data["nodes"] if n["node"] == "n1")
    g = next(g for g in n1["gpus"] if g["pods"])
    assert g["class"] == "offline" and g["mem_reserved_mib"] == 30000 and g["sm_reserved_pct"] == 30
    assert g["pods"] == [{"pod": "default/p", "mem_mib": 30000, "sm_pct": 30}]
    assert n1["pending_handoffs"] == ["default/p"]
    broken = next(n for n in data["nodes"] if n["node"] == "broken")
    assert "not valid JSON" in broken["inventory_error"]
    table = run().stdout
    assert "default/p (30000 MiB, 30%)" in table and "30000/81559" in table and "inventory unreadable" in table
    bad = subprocess.run([sys.executable, "-m", "gpupack", "status", "--kubeconfig", "/nonexistent"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_lists_are_paged_and_complete(kubeapi):
    from extender.kube import Kube

    for i in range(5):
        kubeapi.create("nodes", node_obj(f"n{i}", 1))
    for i in range(3):
        p = pod_obj(f"p{i}", [container("c", 1, 10)])
        p["metadata"]["labels"][LABEL_MANAGED] = "true"
        create_pod(kubeapi, p)
    create_pod(kubeapi, pod_obj("unmanaged", [container("c", 1, 10)]))
    kube = Kube(kubeapi.api_client(), page=2)
    nodes = kube.list_nodes()
    assert [n["metadata"]["name"] for n in nodes["items"]] == [f"n{i}" for i in range(5)]
    assert nodes["metadata"]["resourceVersion"]
    assert [p["metadata"]["name"] for p in kube.list_pods()["items"]] == ["p0", "p1", "p2"]
    assert kubeapi.count_requests("GET", r"^/api/v1/nodes$") == 3
