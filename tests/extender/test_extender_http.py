"""The extender process against the real Kubernetes API server, over real HTTP. Faults the
real server will not produce on demand (a failed Binding, a 409, a dropped watch, 410 Gone, a slow
list) come from a FaultProxy between the extender and the API server."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import threading
import time

import pytest
import realk8s
import requests
from ext_helpers import (
    H100_MIB,
    annotations,
    bind_body,
    container,
    create_pod,
    get_pod,
    gpu_node,
    list_pods,
    payloads,
    pod_obj,
)
from faultproxy import FaultProxy

from extender.verbs.settling import ANN_BIND_FENCED
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    LABEL_MANAGED,
    SCHEDULER_NAME,
    decode_assignment,
)

until = realk8s.until


def _rename(body: dict, names: dict[str, str], ns: str) -> dict:
    """A recorded body for this test's node names and namespace."""
    body = copy.deepcopy(body)
    if "Pod" in body:
        body["Pod"]["metadata"]["namespace"] = ns
        # recorded from a scheduler profile with the default name; gpupack serves its own only
        body["Pod"]["spec"]["schedulerName"] = SCHEDULER_NAME
        if body.get("NodeNames") is not None:
            body["NodeNames"] = [names[n] for n in body["NodeNames"]]
        if body.get("Nodes") is not None:
            for n in body["Nodes"]["items"]:
                n["metadata"]["name"] = names[n["metadata"]["name"]]
    else:
        body["Node"] = names[body["Node"]]
        body["PodNamespace"] = ns
    return body


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_scheduler_conversation(mode, cluster, ns, sfx, start_extender, kubelet):
    names = {n: f"{n}-{sfx}" for n in ("gpu-node-a", "gpu-node-b")}
    for n in names.values():
        gpu_node(cluster, n, 4)
    ext = start_extender("--bind-wait-s", "5")
    core = cluster.core
    uids = {}
    for verb, recorded in payloads(mode):
        body = _rename(recorded, names, ns)
        if verb in ("filter", "prioritize"):
            name = body["Pod"]["metadata"]["name"]
            if name not in uids:
                uids[name] = create_pod(core, body["Pod"], ns)["metadata"]["uid"]
            body["Pod"]["metadata"]["uid"] = uids[name]
            r = ext.post(verb, body)
            assert r.status_code == 200, r.text
            out = r.json()
            if verb == "filter":
                assert out["NodeNames"] == list(names.values()) and out["Error"] == "", out
                if mode == "nodecache-false":
                    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == out["NodeNames"]
            else:
                assert sorted(s["Host"] for s in out) == sorted(names.values())
        else:
            body["PodUID"] = uids[body["PodName"]]
            r = ext.post("bind", body)
            assert r.status_code == 200 and r.json() == {"Error": ""}, r.text
            pod = get_pod(core, ns, body["PodName"])
            assert pod["spec"]["nodeName"] == body["Node"]
            a = decode_assignment(annotations(pod)[ANN_ASSIGNMENT])
            assert a.node == body["Node"] and a.pod_uid == body["PodUID"]
            # one write: the Binding carries the assignment; the old managed label is no longer set
            assert LABEL_MANAGED not in (pod["metadata"].get("labels") or {})
            # The kubelet admits the pod before the next one is scheduled (as when the
            # conversation was recorded): a node with a pending handoff is now filtered out.
            until(lambda n=body["PodName"]: annotations(get_pod(core, ns, n)).get(ANN_HANDOFF) == HANDOFF_DONE,
                  30, f"handoff of {body['PodName']} done")  # fmt: skip
            ext.wait_no_pending_handoffs()
    trainer = decode_assignment(annotations(get_pod(core, ns, "trainer-2gpu"))[ANN_ASSIGNMENT])
    shares = trainer.containers["train"]
    assert len(shares) == 2 and all(s.exclusive and s.mem_mib == H100_MIB for s in shares)
    batch = decode_assignment(annotations(get_pod(core, ns, "batch-eval-offline"))[ANN_ASSIGNMENT])
    assert list(batch.containers) == ["warmup", "worker-a", "worker-b"]
    assert batch.containers["worker-a"][0].mem_mib == 20000 and batch.containers["worker-a"][0].sm_pct == 50
    # whole GPUs of the trainer never overlap the batch pod's GPUs on the same node
    if trainer.node == batch.node:
        assert not trainer.gpu_uuids() & batch.gpu_uuids()
    # the device plugin (emulated) accepted every assignment and finished every handoff
    until(lambda: len(kubelet.served) == 3, 30, "three handoffs done")
    assert all(annotations(p)[ANN_HANDOFF] == HANDOFF_DONE for p in list_pods(core, ns))
    if mode == "nodecache-true":  # (once is enough: the concurrency test checks it too)
        # the extender's view equals what a fresh process rebuilds from the API
        second = start_extender()
        until(lambda: ext.reserved() == second.reserved() and ext.reserved(), 30, "same reservations")


def _gpu_use(core, ns: str) -> dict[str, list[int]]:
    use: dict[str, list[int]] = {}
    for p in list_pods(core, ns):
        raw = annotations(p).get(ANN_ASSIGNMENT)
        if raw and p["spec"].get("nodeName"):
            for shares in decode_assignment(raw).containers.values():
                for s in shares:
                    u = use.setdefault(s.uuid, [0, 0, 0])
                    u[0] += s.mem_mib
                    u[1] += s.sm_pct
                    u[2] += 1 if s.exclusive else 0
    return use


def test_concurrent_binds_to_one_node_never_overcommit(cluster, ns, sfx, start_extender, kubelet):
    n1, n2 = f"n1-{sfx}", f"n2-{sfx}"
    gpu_node(cluster, n1, 2)
    gpu_node(cluster, n2, 1)
    ext = start_extender("--bind-wait-s", "20")
    pods = [create_pod(cluster.core, pod_obj(f"p{i}", [container("c", 1, 20000, 20)]), ns) for i in range(24)]
    results: dict[str, str] = {}

    def bind(p, node):
        r = ext.post("bind", bind_body(p, node), timeout=60)
        assert r.status_code == 200, r.text
        results[p["metadata"]["name"]] = r.json()["Error"]

    threads = [threading.Thread(target=bind, args=(p, n1 if i % 3 else n2)) for i, p in enumerate(pods)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    ok = [n for n, e in results.items() if not e]
    # 4 pods of 20000 MiB per 81559 MiB GPU: 8 on n1, 4 on n2
    assert len(ok) == 12, results
    failed = [e for e in results.values() if e]
    assert all("no GPU with 20000 MiB free" in e for e in failed), failed
    for uuid, (mem, sm, _) in _gpu_use(cluster.core, ns).items():
        assert mem <= H100_MIB and sm <= 100, uuid
    unbound = [p for p in list_pods(cluster.core, ns) if not p["spec"].get("nodeName")]
    assert len(unbound) == 12
    assert all(ANN_ASSIGNMENT not in annotations(p) for p in unbound)
    until(lambda: len(kubelet.served) == 12, 30, "twelve handoffs done")
    second = start_extender()
    until(lambda: ext.reserved() == second.reserved(), 30, "same reservations after restart")


def test_pending_handoff_blocks_the_node_until_the_pod_is_gone(cluster, ns, sfx, start_extender):
    n1 = f"n1-{sfx}"
    gpu_node(cluster, n1, 2)
    ext = start_extender("--bind-wait-s", "0.5")
    a = create_pod(cluster.core, pod_obj("a", [container("c", 1, 1000, 10)]), ns)
    b = create_pod(cluster.core, pod_obj("b", [container("c", 1, 1000, 10)]), ns)
    bind = lambda p: ext.post("bind", bind_body(p, n1)).json()["Error"]  # noqa: E731
    assert bind(a) == ""
    assert annotations(get_pod(cluster.core, ns, "a"))[ANN_HANDOFF] == HANDOFF_PENDING
    err = bind(b)
    assert f"node {n1}: waiting for the kubelet to admit pod {ns}/a (GPU handoff pending since" in err
    assert ANN_ASSIGNMENT not in annotations(get_pod(cluster.core, ns, "b"))
    # A graceful delete of a bound pod leaves it Terminating until its kubelet confirms, and that
    # kubelet may still be admitting it (the real device manager goes on calling Allocate for a pod
    # deleted mid-admission): it keeps blocking until it is gone, so b can never be served in its place.
    cluster.core.delete_namespaced_pod("a", ns)
    assert get_pod(cluster.core, ns, "a")["metadata"].get("deletionTimestamp")
    for _ in range(4):  # long enough for the extender's watch to have seen the deletion
        assert "waiting for the kubelet to admit pod" in bind(b)
        time.sleep(0.5)
    cluster.core.delete_namespaced_pod("a", ns, grace_period_seconds=0)  # what its kubelet confirms
    until(lambda: bind(b) == "", 30, "bind after the blocker is gone")


@pytest.fixture
def proxy(cluster):
    with FaultProxy(cluster.url) as fp:
        yield fp


def test_a_failed_binding_leaves_nothing_held_and_conflicts_are_retried(
    cluster, ns, sfx, start_extender, proxy, tmp_path
):
    n1 = f"n1-{sfx}"
    gpu_node(cluster, n1, 1)
    ext = start_extender(kubeconfig_path=cluster.write_kubeconfig(tmp_path / "kc-proxy", server=proxy.url))
    p = create_pod(cluster.core, pod_obj("p", [container("c", 1, 60000, 10)]), ns)
    args = bind_body(p, n1)
    # a 500 the API server never saw: the Binding's fate looks unknown, so the extender fences it
    # (a PATCH with the Binding's resourceVersion as precondition) and, the pod being unbound, gives up
    proxy.fail_next("POST", r"/pods/p/binding$", 500, message="etcd is unhappy")
    err = ext.post("bind", args).json()["Error"]
    assert f"Binding pod {ns}/p to node {n1} failed: 500" in err and "etcd is unhappy" in err
    pod = get_pod(cluster.core, ns, "p")
    ann = annotations(pod)
    assert not pod["spec"].get("nodeName")
    assert ANN_ASSIGNMENT not in ann and ANN_HANDOFF not in ann and ANN_ALLOCATED not in ann
    assert ANN_BIND_FENCED in ann
    assert proxy.count("PATCH", r"/pods/p$") == 1  # the fence; there is nothing to roll back
    # the view gives the GPU back: another pod of 60000 MiB fits where p's would have been
    other = create_pod(cluster.core, pod_obj("other", [container("c", 1, 60000, 10)]), ns)
    until(lambda: ext.reserved().get((n1, "0"), (1, 1))[0] == 0, 30, "reservation released")
    assert ext.post("filter", {"Pod": other, "NodeNames": [n1]}).json()["NodeNames"] == [n1]
    # a conflicting update of the pod between its read and its Binding: read again and retry
    proxy.fail_next("POST", r"/pods/p/binding$", 409, message="the object has been modified")
    gets = proxy.count("GET", r"/pods/p$")
    assert ext.post("bind", args).json() == {"Error": ""}
    assert proxy.count("POST", r"/pods/p/binding$") == 3  # the 500, the 409, the retry
    assert proxy.count("GET", r"/pods/p$") == gets + 2  # the bind's read of p, and its read after the 409
    assert proxy.count("PATCH", r"/pods/p$") == 1  # a refusal needs no fence
    pod = get_pod(cluster.core, ns, "p")
    assert pod["spec"]["nodeName"] == n1 and ANN_ALLOCATED not in annotations(pod)
    assert decode_assignment(annotations(pod)[ANN_ASSIGNMENT]).pod_uid == p["metadata"]["uid"]
    assert ext.reserved()[(n1, "0")] == (60000, 10)
    # a retried bind of a pod already bound here is a success; elsewhere it is an error
    assert ext.post("bind", args).json() == {"Error": ""}
    gpu_node(cluster, f"n2-{sfx}", 1)
    until(lambda: ext.post("bind", {**args, "Node": f"n2-{sfx}"}).status_code == 200, 30, "n2 known")
    assert "already bound to node" in ext.post("bind", {**args, "Node": f"n2-{sfx}"}).json()["Error"]


def hostile(ns: str, node: str) -> list[tuple[str, object, int, str]]:
    """Bodies no scheduler sends: each gets a 4xx with a reason."""
    good = pod_obj("x", [container("c", 1, 10)], namespace=ns)
    return [
        ("filter", b"{not json", 400, "not valid JSON"),
        ("filter", b"", 400, "empty request body"),
        ("filter", b"[" * 100000 + b"]" * 100000, 400, "JSON"),
        ("filter", {"Pod": 5, "NodeNames": [node]}, 400, "Pod object"),
        ("filter", {"Pod": good, "NodeNames": node}, 400, "list of strings"),
        ("prioritize", {"Pod": good, "NodeNames": [1]}, 400, "NodeNames[0] must be a string"),
        ("filter", {"Pod": good, "NodeNames": ["ghost"]}, 400, "none of the 1"),
        ("bind", {"PodName": "p", "PodNamespace": ns, "Node": "ghost"}, 404, "node ghost"),
        ("bind", {"PodName": "nope", "PodNamespace": ns, "Node": node}, 404, f"pod {ns}/nope not found"),
        ("bind", {"PodName": ["p"], "PodNamespace": ns, "Node": node}, 400, "PodName must be a string"),
        ("bind", b"x" * (10 * 1024 * 1024), 413, "larger than"),
    ]


def bad_pods(ns: str) -> list[tuple[dict, str]]:
    """Well-formed requests about pods gpupack cannot serve: answered 200, every node unresolvable."""
    return [
        (
            pod_obj("sm", [container("c", 1, 100, 150)], namespace=ns),
            "gpu-sm must be a percent in 1..100, got 150",
        ),
        (pod_obj("q", [container("c", 1, "lots")], namespace=ns), "quantity"),
        (
            pod_obj("many", [container("c", 100)], namespace=ns),
            "gpupack.io/gpu=100 is more GPUs than any node has",
        ),
        (pod_obj("nogpu", [container("c", None, 100, 10)], namespace=ns), "no container sets gpupack.io/gpu"),
    ]


def test_malformed_and_hostile_bodies_get_4xx_and_lose_nothing(cluster, ns, sfx, start_extender):
    n1 = f"n1-{sfx}"
    gpu_node(cluster, n1, 1)
    ext = start_extender()
    p = create_pod(cluster.core, pod_obj("p", [container("c", 1, 30000, 30)]), ns)
    assert ext.post("bind", bind_body(p, n1)).json() == {"Error": ""}
    before = ext.reserved()
    for verb, body, status, needle in hostile(ns, n1):
        r = ext.post(verb, body)
        assert r.status_code == status, (verb, r.status_code, r.text[:200])
        assert needle in r.json()["Error"], (verb, r.text[:300])
    for pod, needle in bad_pods(ns):
        r = ext.post("filter", {"Pod": pod, "NodeNames": [n1, "ghost"]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["NodeNames"] == [] and out["FailedNodes"] == {} and out["Error"] == "", out
        assert set(out["FailedAndUnresolvableNodes"]) == {n1, "ghost"}, out
        assert all(needle in why for why in out["FailedAndUnresolvableNodes"].values()), (needle, out)
        r = ext.post("prioritize", {"Pod": pod, "NodeNames": [n1]})
        assert r.status_code == 200 and r.json() == [{"Host": n1, "Score": 0}], r.text
    # a CPU-only pod is the extender's too (placed by CPU/memory and the policy), not a bad request
    r = ext.post(
        "filter",
        {"Pod": pod_obj("none", [{"name": "c", "image": "i"}], namespace=ns), "NodeNames": [n1, "ghost"]},
    )
    assert r.status_code == 200 and r.json()["NodeNames"] == [n1], r.text
    assert "not in gpupack's view" in r.json()["FailedNodes"]["ghost"], r.text
    assert ext.http.get(ext.url + "/healthz").status_code == 200
    assert ext.reserved() == before == {(n1, "0"): (30000, 30)}
    metrics = ext.http.get(ext.url + "/metrics").text
    assert 'gpupack_extender_bad_requests_total{verb="filter"}' in metrics
    assert 'gpupack_extender_node_rejections_total{reason="invalid-request"} 8.0' in metrics
    assert 'gpupack_extender_request_seconds_bucket{le="0.001",verb="bind"}' in metrics
    assert "gpupack_cluster_fragmentation_ratio 1.0" in metrics


def test_watch_resumes_and_relists_after_410(cluster, ns, sfx, start_extender, proxy, tmp_path):
    n1 = f"n1-{sfx}"
    gpu_node(cluster, n1, 1)
    # the watch of pending pods (shape warming) would take the 410 meant for the pod watch here
    ext = start_extender(
        "--no-warm-shapes", kubeconfig_path=cluster.write_kubeconfig(tmp_path / "kc-proxy", server=proxy.url)
    )
    p = create_pod(cluster.core, pod_obj("p", [container("c", 1, 30000, 30)]), ns)
    assert ext.post("bind", bind_body(p, n1)).json() == {"Error": ""}
    probe = create_pod(cluster.core, pod_obj("probe", [container("c", 1, 10)]), ns)
    filt = lambda node=n1: ext.post("filter", {"Pod": probe, "NodeNames": [node]}).json()  # noqa: E731

    from extender.api.kube import ASSIGNED_PODS

    def lists(path):
        """The view's lists of `path`: not watches, and not the requeue pass's list of unbound pods,
        which runs on its own thread once the view has synced."""
        return len(
            [
                r
                for r in proxy.requests
                if r.path == path
                and not {"true", "1"} & set(r.query.get("watch", []))
                and r.query.get("fieldSelector", [ASSIGNED_PODS]) == [ASSIGNED_PODS]
            ]
        )

    def watching() -> bool:
        """The pod and the node watch are open (since the last cut: a cut one is forgotten)."""
        return {"/api/v1/pods", "/api/v1/nodes"} <= set(proxy.open_watches())

    base = (lists("/api/v1/pods"), lists("/api/v1/nodes"))
    assert base[0] >= 1 and base[1] >= 1
    # dropped connections: the watches reconnect from their resourceVersion without relisting
    until(watching, 30, "pod and node watches open")
    assert proxy.cut_watches() >= 2
    cluster.core.patch_node(n1, {"spec": {"unschedulable": True}})
    until(lambda: "cordoned" in filt()["FailedAndUnresolvableNodes"].get(n1, ""), 30, "cordon seen")
    assert (lists("/api/v1/pods"), lists("/api/v1/nodes")) == base
    # history compacted while the watches are down: reconnecting gets 410 Gone and must relist.
    # The reconnect is held back until the changes are made, so only a relist can show them. The
    # cordon came through the node watch; the pod watch may still be reconnecting (issue 27).
    until(watching, 30, "pod and node watches open again")
    for path in (r"^/api/v1/pods$", r"^/api/v1/nodes$"):
        proxy.delay(path, 2.0, method="GET")
        proxy.fail_next("GET", path, 410, message="too old resource version")
    assert proxy.cut_watches() >= 2
    cluster.core.delete_namespaced_pod("p", ns, grace_period_seconds=0)
    cluster.core.patch_node(n1, {"spec": {"unschedulable": False}})
    until(lambda: ext.reserved().get((n1, "0")) == (0, 0), 30, "deletion seen after relist")
    until(lambda: filt()["NodeNames"] == [n1], 30, "uncordon seen after relist")
    assert lists("/api/v1/pods") > base[0] and lists("/api/v1/nodes") > base[1]
    # a new node appears through the node watch
    gpu_node(cluster, f"n2-{sfx}", 1)
    until(lambda: filt(f"n2-{sfx}").get("NodeNames") == [f"n2-{sfx}"], 30, "n2 known")


def test_readyz_waits_for_first_sync(cluster, ns, sfx, start_extender, proxy, tmp_path):
    n1 = f"n1-{sfx}"
    gpu_node(cluster, n1, 1)
    # the shape warmer lists pending pods on the same path, and may be first: delay every early
    # GET there (the two lists and the watches that follow them), so the full pod list is among them
    proxy.delay(r"^/api/v1/pods$", 1.5, method="GET", times=4)
    ext = start_extender(
        ready=False, kubeconfig_path=cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url)
    )
    deadline = time.monotonic() + 30
    codes = []
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):  # not listening yet
            codes.append(ext.http.get(ext.url + "/readyz", timeout=1).status_code)
        if codes and codes[-1] == 200:
            break
        time.sleep(0.05)
    assert 503 in codes and codes[-1] == 200
    pod = pod_obj("x", [container("c", 1, 10)], namespace=ns)
    assert ext.post("filter", {"Pod": pod, "NodeNames": [n1]}).json()["NodeNames"] == [n1]


def test_status_cli_json_and_table(cluster, ns, sfx, kubeconfig, start_extender):
    n1, broken = f"n1-{sfx}", f"broken-{sfx}"
    gpu_node(cluster, n1, 2)
    gpu_node(cluster, broken, raw_inventory="{oops")
    ext = start_extender()
    p = create_pod(cluster.core, pod_obj("p", [container("c", 1, 30000, 30)], cls="offline"), ns)
    assert ext.post("bind", bind_body(p, n1)).json() == {"Error": ""}
    run = lambda *a: subprocess.run([sys.executable, "-m", "gpupack", "status", "--kubeconfig", str(kubeconfig), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
    out = run("--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    node = next(n for n in data["nodes"] if n["node"] == n1)
    g = next(g for g in node["gpus"] if g["pods"])
    assert g["class"] == "offline" and g["mem_reserved_mib"] == 30000 and g["sm_reserved_pct"] == 30
    assert g["pods"] == [{"pod": f"{ns}/p", "mem_mib": 30000, "sm_pct": 30}]
    assert node["pending_handoffs"] == [f"{ns}/p"]
    bad = next(n for n in data["nodes"] if n["node"] == broken)
    assert "not valid JSON" in bad["inventory_error"]
    table = run().stdout
    assert f"{ns}/p (30000 MiB, 30%)" in table and "30000/81559" in table and "inventory unreadable" in table
    bad = subprocess.run([sys.executable, "-m", "gpupack", "status", "--kubeconfig", "/nonexistent"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_lists_are_paged_and_complete(cluster, ns, sfx, proxy, tmp_path):
    from extender.api.kube import ASSIGNED_PODS, Kube, api_client

    for i in range(5):
        gpu_node(cluster, f"n{i}-{sfx}", 1)
    for i in range(3):
        # created bound (create_pod drops spec.nodeName, as a recorded pod's must go)
        p = pod_obj(f"p{i}", [container("c", 1, 10)], namespace=ns)
        p["spec"]["nodeName"] = f"n{i}-{sfx}"
        made = json.loads(cluster.core.create_namespaced_pod(ns, p, _preload_content=False).data)
        assert made["spec"]["nodeName"] == f"n{i}-{sfx}"
    create_pod(cluster.core, pod_obj("unbound", [container("c", 1, 10)]), ns)
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url))), page=2)
    nodes = kube.list_nodes()
    assert [n["metadata"]["name"] for n in nodes["items"]] == [f"n{i}-{sfx}" for i in range(5)]
    assert nodes["metadata"]["resourceVersion"]
    pods = [p["metadata"]["name"] for p in kube.list_pods()["items"] if p["metadata"]["namespace"] == ns]
    assert pods == ["p0", "p1", "p2"]  # the assigned pods only: "unbound" holds nothing
    assert proxy.count("GET", r"^/api/v1/nodes$") == 3
    pod_lists = [r for r in proxy.requests if r.method == "GET" and r.path == "/api/v1/pods"]
    assert len(pod_lists) >= 2  # pages of 2
    assert all(r.query.get("fieldSelector") == [ASSIGNED_PODS] for r in pod_lists), pod_lists
