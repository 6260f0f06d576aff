"""The in-test API server, exercised only through the official kubernetes client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from gpupack.testing.controllers import PodRunner, ReplicaSetController, mark_pod_running_ready
from gpupack.testing.kubeapi import KubeAPIServer

# Fixtures live here rather than in a conftest.py: other test folders import helpers from
# their own `conftest`, and a second module of that name would shadow theirs.


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    with KubeAPIServer() as srv:
        yield srv


@pytest.fixture
def api(server: KubeAPIServer) -> Iterator[client.ApiClient]:
    api_client = server.api_client()
    yield api_client
    api_client.close()


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def pod_body(name: str | None = None, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels or {}}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = "gen-"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "image": "img:1"}], **spec},
    }


def status_of(exc: ApiException) -> dict[str, Any]:
    return json.loads(exc.body)


def bind(core: client.CoreV1Api, name: str, node: str, ns: str = "default", uid: str | None = None) -> Any:
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name},
        "target": {"kind": "Node", "name": node},
    }
    if uid:
        body["metadata"]["uid"] = uid
    # The real server answers a Status that the client cannot turn into V1Binding.
    return core.create_namespaced_pod_binding(name, ns, body, _preload_content=False)


# --- bookkeeping and errors ----------------------------------------------------------------------


def test_create_fills_metadata_and_resource_versions_increase(core: client.CoreV1Api) -> None:
    a = core.create_namespaced_pod("default", pod_body("a"))
    b = core.create_namespaced_pod("default", pod_body())
    assert a.metadata.uid and a.metadata.uid != b.metadata.uid
    assert a.metadata.creation_timestamp is not None
    assert a.metadata.namespace == "default"
    assert int(b.metadata.resource_version) > int(a.metadata.resource_version)
    assert b.metadata.name.startswith("gen-") and len(b.metadata.name) == len("gen-") + 5
    # Pod create discards client status and applies defaults.
    assert a.status.phase == "Pending"
    assert a.spec.scheduler_name == "default-scheduler"
    listing = core.list_namespaced_pod("default")
    assert int(listing.metadata.resource_version) >= int(b.metadata.resource_version)
    assert [p.metadata.name for p in listing.items] == sorted([a.metadata.name, b.metadata.name])


def test_errors_are_status_objects(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("missing", "default")
    st = status_of(err.value)
    assert err.value.status == 404
    assert st["kind"] == "Status" and st["apiVersion"] == "v1" and st["status"] == "Failure"
    assert st["reason"] == "NotFound" and st["code"] == 404 and st["message"] == 'pods "missing" not found'
    core.create_namespaced_pod("default", pod_body("dup"))
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", pod_body("dup"))
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("nowhere", pod_body("x"))
    assert err.value.status == 404 and status_of(err.value)["message"] == 'namespaces "nowhere" not found'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", pod_body("Bad_Name"))
    assert err.value.status == 422 and status_of(err.value)["reason"] == "Invalid"
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", pod_body("badlabel", labels={"a": "not valid!"}))
    assert err.value.status == 422
    huge = pod_body("huge")
    huge["metadata"]["annotations"] = {"gpupack.io/inventory": "x" * (300 * 1024)}
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", huge)
    assert (
        err.value.status == 422
        and "Too long: must have at most 262144 bytes" in status_of(err.value)["message"]
    )


def test_extended_resources_follow_apiserver_rules(core: client.CoreV1Api) -> None:
    ok = pod_body("ok")
    ok["spec"]["containers"][0]["resources"] = {
        "limits": {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "4096"}
    }
    created = core.create_namespaced_pod("default", ok)
    assert created.spec.containers[0].resources.requests == {
        "gpupack.io/gpu": "1",
        "gpupack.io/gpu-mem": "4096",
    }
    bad = pod_body("bad")
    bad["spec"]["containers"][0]["resources"] = {
        "limits": {"gpupack.io/gpu": "1"},
        "requests": {"gpupack.io/gpu": "2"},
    }
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", bad)
    assert (
        err.value.status == 422 and "must be equal to gpupack.io/gpu limit" in status_of(err.value)["message"]
    )


def test_cluster_scoped_and_all_namespace_lists(core: client.CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": "team-a"}})
    core.create_namespaced_pod("team-a", pod_body("p"))
    core.create_namespaced_pod("default", pod_body("p"))
    core.create_node(
        {"metadata": {"name": "n1", "labels": {"gpu": "yes"}}, "status": {"capacity": {"cpu": "8"}}}
    )
    assert core.read_node("n1").status.capacity == {"cpu": "8"}
    pods = core.list_pod_for_all_namespaces().items
    assert sorted((p.metadata.namespace, p.metadata.name) for p in pods) == [
        ("default", "p"),
        ("team-a", "p"),
    ]
    assert [n.metadata.name for n in core.list_node(label_selector="gpu=yes").items] == ["n1"]
    assert core.read_namespace("team-a").status.phase == "Active"


# --- optimistic concurrency and patches --------------------------------------------------------------


def test_stale_update_is_conflict(core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("default", pod_body("p"))
    pod.metadata.labels = {"v": "1"}
    updated = core.replace_namespaced_pod("p", "default", pod)
    assert updated.metadata.resource_version != pod.metadata.resource_version
    pod.metadata.labels = {"v": "2"}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_pod("p", "default", pod)  # still carries the old resourceVersion
    st = status_of(err.value)
    assert err.value.status == 409 and st["reason"] == "Conflict"
    assert "the object has been modified" in st["message"]
    # A resourceVersion inside a merge patch is a precondition too.
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "p",
            "default",
            {"metadata": {"resourceVersion": pod.metadata.resource_version, "labels": {"v": "3"}}},
        )
    assert err.value.status == 409
    ok = core.patch_namespaced_pod(
        "p",
        "default",
        {"metadata": {"resourceVersion": updated.metadata.resource_version, "labels": {"v": "3"}}},
    )
    assert ok.metadata.labels == {"v": "3"}


def test_noop_update_keeps_resource_version(core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("default", pod_body("p", labels={"a": "1"}))
    same = core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "1"}}})
    assert same.metadata.resource_version == pod.metadata.resource_version


def test_strategic_merge_patch(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"a": "1", "b": "2"}}})
    pod = core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"a": None}}})
    assert pod.metadata.annotations == {"b": "2"}
    # conditions merge by type through the status subresource
    core.patch_namespaced_pod_status(
        "p", "default", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    pod = core.patch_namespaced_pod_status(
        "p", "default", {"status": {"conditions": [{"type": "Initialized", "status": "True"}]}}
    )
    assert sorted((c.type, c.status) for c in pod.status.conditions) == [
        ("Initialized", "True"),
        ("Ready", "False"),
    ]
    pod = core.patch_namespaced_pod_status(
        "p", "default", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    assert {c.type: c.status for c in pod.status.conditions} == {"Initialized": "True", "Ready": "True"}
    # finalizers merge as a set; $deleteFromPrimitiveList removes
    core.patch_namespaced_pod("p", "default", {"metadata": {"finalizers": ["x/a"]}})
    pod = core.patch_namespaced_pod("p", "default", {"metadata": {"finalizers": ["x/b"]}})
    assert pod.metadata.finalizers == ["x/a", "x/b"]
    pod = core.patch_namespaced_pod(
        "p", "default", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x/a"]}}
    )
    assert pod.metadata.finalizers == ["x/b"]


def test_merge_patch_replaces_lists(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    core.patch_namespaced_pod("p", "default", {"metadata": {"finalizers": ["x/a"]}})
    pod = core.patch_namespaced_pod(
        "p", "default", {"metadata": {"finalizers": ["x/b"]}}, _content_type="application/merge-patch+json"
    )
    assert pod.metadata.finalizers == ["x/b"]


def test_json_patch_and_failed_test_op(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p", labels={"a": "1"}))
    pod = core.patch_namespaced_pod(
        "p",
        "default",
        [
            {"op": "test", "path": "/metadata/labels/a", "value": "1"},
            {"op": "add", "path": "/metadata/annotations", "value": {}},
            {"op": "add", "path": "/metadata/annotations/gpupack.io~1x", "value": "y"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "2"},
        ],
    )
    assert pod.metadata.labels == {"a": "2"} and pod.metadata.annotations == {"gpupack.io/x": "y"}
    before = pod.metadata.resource_version
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "p",
            "default",
            [
                {"op": "test", "path": "/metadata/labels/a", "value": "1"},
                {"op": "remove", "path": "/metadata/labels/a"},
            ],
        )
    assert err.value.status == 422 and status_of(err.value)["reason"] == "Invalid"
    assert core.read_namespaced_pod("p", "default").metadata.resource_version == before
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("p", "default", [{"op": "remove", "path": "/metadata/labels/nope"}])
    assert err.value.status == 422


def test_pod_spec_is_immutable_and_status_is_a_subresource(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("p", "default", {"spec": {"nodeName": "n1"}})
    assert err.value.status == 422
    # status on the main resource is ignored
    pod = core.patch_namespaced_pod(
        "p", "default", {"status": {"phase": "Running"}, "metadata": {"labels": {"x": "1"}}}
    )
    assert pod.status.phase == "Pending" and pod.metadata.labels == {"x": "1"}
    # the status subresource ignores everything but status
    pod = core.patch_namespaced_pod_status(
        "p", "default", {"status": {"phase": "Running"}, "metadata": {"labels": {"x": "2"}}}
    )
    assert pod.status.phase == "Running" and pod.metadata.labels == {"x": "1"}
    assert core.read_namespaced_pod_status("p", "default").status.phase == "Running"


def test_node_status_subresource(core: client.CoreV1Api) -> None:
    core.create_node({"metadata": {"name": "n1"}, "spec": {}})
    node = core.patch_node_status("n1", {"status": {"allocatable": {"gpupack.io/gpu": "16"}}})
    assert node.status.allocatable == {"gpupack.io/gpu": "16"}
    node = core.patch_node(
        "n1", {"status": {"allocatable": {"gpupack.io/gpu": "99"}}, "spec": {"unschedulable": True}}
    )
    assert node.status.allocatable == {"gpupack.io/gpu": "16"} and node.spec.unschedulable
    node.status.capacity = {"cpu": "4"}
    node = core.replace_node_status("n1", node)
    assert node.status.capacity == {"cpu": "4"}
    assert [n.metadata.name for n in core.list_node(field_selector="spec.unschedulable=true").items] == ["n1"]


# --- selectors -----------------------------------------------------------------------------------


def test_label_selectors(core: client.CoreV1Api) -> None:
    for name, labels in {"a": {"app": "x", "tier": "web"}, "b": {"app": "y"}, "c": {"other": "1"}}.items():
        core.create_namespaced_pod("default", pod_body(name, labels=labels))

    def names(selector: str) -> list[str]:
        return sorted(
            p.metadata.name for p in core.list_namespaced_pod("default", label_selector=selector).items
        )

    assert names("app=x") == ["a"]
    assert names("app==y") == ["b"]
    assert names("app!=x") == ["b", "c"]
    assert names("app in (x, y)") == ["a", "b"]
    assert names("app notin (x)") == ["b", "c"]
    assert names("app") == ["a", "b"]
    assert names("!app") == ["c"]
    assert names("app,tier=web") == ["a"]
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod("default", label_selector="app in x")
    assert err.value.status == 400


def test_field_selectors(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("a"))
    core.create_namespaced_pod("default", pod_body("b", schedulerName="gpupack-scheduler"))
    bind(core, "a", "n1")

    def names(selector: str) -> list[str]:
        return sorted(
            p.metadata.name for p in core.list_pod_for_all_namespaces(field_selector=selector).items
        )

    assert names("spec.nodeName=n1") == ["a"]
    assert names("spec.nodeName=") == ["b"]
    assert names("spec.nodeName!=n1") == ["b"]
    assert names("spec.schedulerName=gpupack-scheduler,status.phase=Pending") == ["b"]
    assert names("metadata.name=a,metadata.namespace=default") == ["a"]
    assert names("status.phase!=Pending") == []
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod("default", field_selector="spec.bogus=1")
    assert err.value.status == 400 and "field label not supported" in status_of(err.value)["message"]


def test_limit_and_continue(core: client.CoreV1Api) -> None:
    for i in range(5):
        core.create_namespaced_pod("default", pod_body(f"p{i}"))
    first = core.list_namespaced_pod("default", limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"] and first.metadata._continue
    rest = core.list_namespaced_pod("default", limit=10, _continue=first.metadata._continue)
    assert [p.metadata.name for p in rest.items] == ["p2", "p3", "p4"]


# --- watch ---------------------------------------------------------------------------------------


def collect(stream: Any, out: list[tuple[str, str]], stop_after: int | None = None) -> None:
    for event in stream:
        out.append((event["type"], event["object"].metadata.name))
        if stop_after is not None and len(out) >= stop_after:
            return


def test_watch_resumes_from_resource_version(core: client.CoreV1Api) -> None:
    a = core.create_namespaced_pod("default", pod_body("a"))
    core.create_namespaced_pod("default", pod_body("b"))
    core.delete_namespaced_pod("a", "default")
    events: list[tuple[str, str]] = []
    w = watch.Watch()
    collect(
        w.stream(
            core.list_namespaced_pod,
            "default",
            resource_version=a.metadata.resource_version,
            timeout_seconds=1,
        ),
        events,
        2,
    )
    assert events == [("ADDED", "b"), ("DELETED", "a")]


def test_watch_streams_live_changes_with_selector_transitions(core: client.CoreV1Api) -> None:
    rv = core.list_namespaced_pod("default").metadata.resource_version
    events: list[tuple[str, str]] = []
    w = watch.Watch()
    stream = w.stream(
        core.list_namespaced_pod, "default", label_selector="app=x", resource_version=rv, timeout_seconds=5
    )
    t = threading.Thread(target=collect, args=(stream, events, 4))
    t.start()
    core.create_namespaced_pod("default", pod_body("p", labels={"app": "x"}))
    core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"k": "v"}}})
    core.create_namespaced_pod("default", pod_body("other", labels={"app": "y"}))
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"app": "z"}}})  # leaves the selector
    core.patch_namespaced_pod("other", "default", {"metadata": {"labels": {"app": "x"}}})  # enters it
    t.join(timeout=5)
    w.stop()
    assert events == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p"), ("ADDED", "other")]


def test_watch_all_namespaces_initial_state(core: client.CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": "ns2"}})
    core.create_namespaced_pod("ns2", pod_body("x"))
    core.create_namespaced_pod("default", pod_body("y"))
    events: list[tuple[str, str]] = []
    collect(watch.Watch().stream(core.list_pod_for_all_namespaces, timeout_seconds=1), events, 2)
    assert sorted(events) == [("ADDED", "x"), ("ADDED", "y")]


def test_watch_compacted_resource_version_is_410(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    old = core.create_namespaced_pod("default", pod_body("a")).metadata.resource_version
    core.create_namespaced_pod("default", pod_body("b"))
    server.compact()
    with pytest.raises(ApiException) as err:
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, "default", resource_version=old, timeout_seconds=1
        ):
            pass
    assert err.value.status == 410 and "Expired" in err.value.reason
    # The raw stream: one ERROR event carrying a Status, as the real server sends.
    resp = core.list_namespaced_pod("default", watch=True, resource_version=old, _preload_content=False)
    lines = [json.loads(line) for line in resp.data.decode().splitlines() if line]
    assert len(lines) == 1 and lines[0]["type"] == "ERROR"
    assert lines[0]["object"]["code"] == 410 and lines[0]["object"]["reason"] == "Expired"
    # Watching from the compacted (current) resourceVersion still works.
    rv = core.list_namespaced_pod("default").metadata.resource_version
    events: list[tuple[str, str]] = []
    stream = watch.Watch().stream(core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=5)
    t = threading.Thread(target=collect, args=(stream, events, 1))
    t.start()
    core.create_namespaced_pod("default", pod_body("c"))
    t.join(timeout=5)
    assert events == [("ADDED", "c")]


def test_watch_bookmarks() -> None:
    with KubeAPIServer(bookmark_interval=0.2) as server:
        core = client.CoreV1Api(server.api_client())
        server_rv = core.list_namespaced_pod("default").metadata.resource_version
        resp = core.list_namespaced_pod(
            "default",
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=server_rv,
            timeout_seconds=1,
            _preload_content=False,
        )
        events = [json.loads(line) for line in resp.data.decode().splitlines() if line]
        assert len(events) >= 2 and all(e["type"] == "BOOKMARK" for e in events)
        assert events[-1]["object"]["metadata"]["resourceVersion"] == server_rv
        # Without allowWatchBookmarks there are none.
        resp = core.list_namespaced_pod(
            "default", watch=True, resource_version=server_rv, timeout_seconds=1, _preload_content=False
        )
        assert resp.data == b""


def test_watch_ends_when_client_disconnects(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    w = watch.Watch()
    stream = w.stream(core.list_namespaced_pod, "default")  # no timeout: only the disconnect ends it
    core.create_namespaced_pod("default", pod_body("p"))
    assert next(stream)["type"] == "ADDED"
    assert server.active_watches == 1
    w.stop()
    stream.close()
    wait_until(lambda: server.active_watches == 0, timeout=3)


def test_watch_ends_when_server_stops() -> None:
    server = KubeAPIServer().start()
    core = client.CoreV1Api(server.api_client())
    done = threading.Event()

    def run() -> None:
        for _ in watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=60):
            pass
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.2)
    started = time.monotonic()
    server.stop()
    assert done.wait(3), "watch did not end when the server stopped"
    assert time.monotonic() - started < 3


# --- binding -------------------------------------------------------------------------------------


def test_binding(core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("default", pod_body("p"))
    resp = bind(core, "p", "n1", uid=pod.metadata.uid)
    assert resp.status == 201 and json.loads(resp.data)["status"] == "Success"
    bound = core.read_namespaced_pod("p", "default")
    assert bound.spec.node_name == "n1"
    assert any(c.type == "PodScheduled" and c.status == "True" for c in bound.status.conditions)
    with pytest.raises(ApiException) as err:
        bind(core, "p", "n2")
    assert err.value.status == 409 and 'already assigned to node "n1"' in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:
        bind(core, "gone", "n1")
    assert err.value.status == 404
    core.create_namespaced_pod("default", pod_body("q"))
    with pytest.raises(ApiException) as err:
        bind(core, "q", "n1", uid="not-the-uid")
    assert err.value.status == 409
    assert core.read_namespaced_pod("q", "default").spec.node_name is None


def test_concurrent_bindings_one_wins(core: client.CoreV1Api, server: KubeAPIServer) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    results: list[int] = []

    def attempt(node: str) -> None:
        c = client.CoreV1Api(server.api_client())
        try:
            results.append(bind(c, "p", node).status)
        except ApiException as exc:
            results.append(exc.status)

    threads = [threading.Thread(target=attempt, args=(f"n{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [201] + [409] * 7


# --- eviction ------------------------------------------------------------------------------------


def eviction(name: str, ns: str = "default") -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}


def running_pods(core: client.CoreV1Api, n: int, labels: dict[str, str], owner: Any = None) -> list[str]:
    names = []
    for i in range(n):
        name = f"w{i}"
        body = pod_body(name, labels=labels)
        if owner is not None:
            body["metadata"]["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1",
                    "kind": owner.kind,
                    "name": owner.metadata.name,
                    "uid": owner.metadata.uid,
                    "controller": True,
                }
            ]
        core.create_namespaced_pod("default", body)
        bind(core, name, "n1")
        mark_pod_running_ready(core.api_client, "default", name)
        names.append(name)
    return names


def test_eviction_honours_pdb(api: client.ApiClient, core: client.CoreV1Api) -> None:
    policy = client.PolicyV1Api(api)
    running_pods(core, 3, {"app": "web"})
    policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "metadata": {"name": "web"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    core.create_namespaced_pod_eviction("w0", "default", eviction("w0"))
    with pytest.raises(ApiException):
        core.read_namespaced_pod("w0", "default")
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod_eviction("w1", "default", eviction("w1"))
    st = status_of(err.value)
    assert err.value.status == 429 and st["reason"] == "TooManyRequests"
    assert st["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert st["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert core.read_namespaced_pod("w1", "default").metadata.name == "w1"
    # A pod that is not yet running is evicted regardless of the budget.
    core.create_namespaced_pod("default", pod_body("pending", labels={"app": "web"}))
    core.create_namespaced_pod_eviction("pending", "default", eviction("pending"))
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod_eviction("nope", "default", eviction("nope"))
    assert err.value.status == 404


def test_eviction_percent_and_max_unavailable(
    api: client.ApiClient, core: client.CoreV1Api, server: KubeAPIServer
) -> None:
    policy = client.PolicyV1Api(api)
    rs = client.AppsV1Api(api).create_namespaced_replica_set(
        "default",
        {
            "metadata": {"name": "db"},
            "spec": {
                "replicas": 4,
                "selector": {"matchLabels": {"app": "db"}},
                "template": {
                    "metadata": {"labels": {"app": "db"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                },
            },
        },
    )
    running_pods(core, 4, {"app": "db"}, owner=rs)
    policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "metadata": {"name": "db"},
            "spec": {"maxUnavailable": "25%", "selector": {"matchLabels": {"app": "db"}}},
        },
    )
    server.sync_pdb_status()
    st = policy.read_namespaced_pod_disruption_budget("db", "default").status
    assert (st.current_healthy, st.desired_healthy, st.disruptions_allowed) == (4, 3, 1)
    core.create_namespaced_pod_eviction("w0", "default", eviction("w0"))
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod_eviction("w1", "default", eviction("w1"))
    assert err.value.status == 429


def test_percent_budget_over_bare_pods_allows_nothing(api: client.ApiClient, core: client.CoreV1Api) -> None:
    # Upstream cannot scale a percentage without a controller, and fails safe.
    running_pods(core, 2, {"app": "bare"})
    client.PolicyV1Api(api).create_namespaced_pod_disruption_budget(
        "default",
        {
            "metadata": {"name": "bare"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "bare"}}},
        },
    )
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod_eviction("w0", "default", eviction("w0"))
    assert err.value.status == 429


def test_eviction_without_pdb_deletes(core: client.CoreV1Api) -> None:
    running_pods(core, 1, {"app": "solo"})
    core.create_namespaced_pod_eviction("w0", "default", eviction("w0"))
    assert core.list_namespaced_pod("default").items == []


# --- other resource types --------------------------------------------------------------------------


def test_leases_optimistic_concurrency(api: client.ApiClient) -> None:
    coord = client.CoordinationV1Api(api)
    lease = coord.create_namespaced_lease(
        "kube-system",
        {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}},
    )
    lease.spec.holder_identity = "b"
    coord.replace_namespaced_lease("leader", "kube-system", lease)
    lease.spec.holder_identity = "c"
    with pytest.raises(ApiException) as err:
        coord.replace_namespaced_lease("leader", "kube-system", lease)
    assert err.value.status == 409
    assert coord.read_namespaced_lease("leader", "kube-system").spec.holder_identity == "b"
    with pytest.raises(ApiException) as err:
        coord.read_namespaced_lease("other", "kube-system")
    assert status_of(err.value)["message"] == 'leases.coordination.k8s.io "other" not found'


def test_events_and_apps(api: client.ApiClient, core: client.CoreV1Api) -> None:
    events = client.EventsV1Api(api)
    events.create_namespaced_event(
        "default",
        {
            "metadata": {"generateName": "ev-"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reason": "Evicted",
            "type": "Normal",
            "action": "Defrag",
            "reportingController": "gpupack.io/defrag",
            "reportingInstance": "x",
            "regarding": {"kind": "Pod", "name": "p", "namespace": "default"},
        },
    )
    assert [
        e.reason for e in events.list_namespaced_event("default", field_selector="reason=Evicted").items
    ] == ["Evicted"]
    core.create_namespaced_event(
        "default",
        {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Node", "name": "n1"}, "reason": "X"},
    )
    assert len(core.list_event_for_all_namespaces(field_selector="involvedObject.name=n1").items) == 1
    apps = client.AppsV1Api(api)
    dep = apps.create_namespaced_deployment(
        "default",
        {
            "metadata": {"name": "d"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "d"}},
                "template": {
                    "metadata": {"labels": {"app": "d"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                },
            },
        },
    )
    assert dep.metadata.generation == 1
    dep = apps.patch_namespaced_deployment("d", "default", {"spec": {"replicas": 3}})
    assert dep.metadata.generation == 2 and dep.spec.replicas == 3
    status = apps.delete_namespaced_deployment("d", "default")
    assert status["status"] == "Success"


def test_delete_preconditions_and_finalizers(core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("default", pod_body("p"))
    with pytest.raises(ApiException) as err:
        core.delete_namespaced_pod(
            "p", "default", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other"))
        )
    assert err.value.status == 409
    with pytest.raises(ApiException) as err:
        core.delete_namespaced_pod(
            "p",
            "default",
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1")),
        )
    assert err.value.status == 409
    deleted = core.delete_namespaced_pod(
        "p",
        "default",
        body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.metadata.uid)),
    )
    assert deleted.metadata.name == "p"
    core.create_namespaced_pod(
        "default", {**pod_body("f"), "metadata": {"name": "f", "finalizers": ["x.io/hold"]}}
    )
    marked = core.delete_namespaced_pod("f", "default")
    assert marked.metadata.deletion_timestamp is not None
    core.patch_namespaced_pod("f", "default", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("f", "default")
    assert err.value.status == 404


# --- fault injection -----------------------------------------------------------------------------


def test_fail_next_requests_and_delay(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    server.fail_next("GET", r"/pods/p$", 503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            core.read_namespaced_pod("p", "default")
        assert err.value.status == 503 and status_of(err.value)["reason"] == "ServiceUnavailable"
    assert core.read_namespaced_pod("p", "default").metadata.name == "p"
    server.clear_requests()
    core.list_namespaced_pod("default", label_selector="a=b")
    assert server.requests == [("GET", "/api/v1/namespaces/default/pods", {"labelSelector": "a=b"})]
    server.delay(r"/pods$", 0.3, times=1)
    started = time.monotonic()
    core.list_namespaced_pod("default")
    assert time.monotonic() - started >= 0.3


def test_max_body_bytes() -> None:
    with KubeAPIServer(max_body_bytes=2048) as server:
        core = client.CoreV1Api(server.api_client())
        big = pod_body("big")
        big["metadata"]["annotations"] = {"x": "y" * 4096}
        with pytest.raises(ApiException) as err:
            core.create_namespaced_pod("default", big)
        assert err.value.status == 413
        assert core.create_namespaced_pod("default", pod_body("small")).metadata.name == "small"


# --- controllers ---------------------------------------------------------------------------------


def wait_until(cond: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_replicaset_controller_replaces_evicted_pods(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    template = {"metadata": {"labels": {"app": "rs"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    with (
        ReplicaSetController(server, "default", "rs", template, replicas=2) as rs,
        PodRunner(server, "default"),
    ):
        names = wait_until(lambda: len(rs.pod_names()) == 2 and rs.pod_names())
        pod = core.read_namespaced_pod(names[0], "default")
        ref = pod.metadata.owner_references[0]
        assert (ref.kind, ref.name, ref.controller, ref.uid) == ("ReplicaSet", "rs", True, rs.uid)
        for name in names:
            bind(core, name, "n1")
        wait_until(
            lambda: all(core.read_namespaced_pod(n, "default").status.phase == "Running" for n in names)
        )
        core.create_namespaced_pod_eviction(names[0], "default", eviction(names[0]))
        replaced = wait_until(
            lambda: len(rs.pod_names()) == 2 and names[0] not in rs.pod_names() and rs.pod_names()
        )
        assert names[1] in replaced
        assert rs.errors == []


# --- hardening -----------------------------------------------------------------------------------


def test_restart_keeps_objects_and_cuts_watches(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    url = server.url
    ended = threading.Event()

    def run() -> None:
        for _ in watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=30):
            pass
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    time.sleep(0.2)
    server.stop()
    assert ended.wait(3)
    server.start()
    assert server.url == url
    assert core.read_namespaced_pod("p", "default").metadata.name == "p"


def test_history_limit_expires_slow_watchers() -> None:
    with KubeAPIServer(history_limit=5) as server:
        core = client.CoreV1Api(server.api_client())
        first = core.create_namespaced_pod("default", pod_body("p0")).metadata.resource_version
        for i in range(1, 20):
            core.create_namespaced_pod("default", pod_body(f"p{i}"))
        with pytest.raises(ApiException) as err:
            for _ in watch.Watch().stream(
                core.list_namespaced_pod, "default", resource_version=first, timeout_seconds=1
            ):
                pass
        assert err.value.status == 410


def test_concurrent_evictions_never_overrun_the_budget(
    server: KubeAPIServer, api: client.ApiClient, core: client.CoreV1Api
) -> None:
    names = running_pods(core, 6, {"app": "web"})
    client.PolicyV1Api(api).create_namespaced_pod_disruption_budget(
        "default",
        {
            "metadata": {"name": "web"},
            "spec": {"minAvailable": 4, "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    results: list[int] = []

    def evict(name: str) -> None:
        c = client.CoreV1Api(server.api_client())
        try:
            c.create_namespaced_pod_eviction(name, "default", eviction(name))
            results.append(201)
        except ApiException as exc:
            results.append(exc.status)

    threads = [threading.Thread(target=evict, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [201, 201, 429, 429, 429, 429]
    assert len(core.list_namespaced_pod("default").items) == 4


def test_more_than_one_pdb_is_an_error(api: client.ApiClient, core: client.CoreV1Api) -> None:
    running_pods(core, 2, {"app": "x"})
    policy = client.PolicyV1Api(api)
    for name in ("a", "b"):
        policy.create_namespaced_pod_disruption_budget(
            "default",
            {
                "metadata": {"name": name},
                "spec": {"minAvailable": 0, "selector": {"matchLabels": {"app": "x"}}},
            },
        )
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod_eviction("w0", "default", eviction("w0"))
    assert err.value.status == 500 and "more than one PodDisruptionBudget" in status_of(err.value)["message"]


def test_dry_run_delete_collection_and_namespace_cascade(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("dry"), dry_run="All")
    assert core.list_namespaced_pod("default").items == []
    for name, app in (("a", "x"), ("b", "x"), ("c", "y")):
        core.create_namespaced_pod("default", pod_body(name, labels={"app": app}))
    core.delete_collection_namespaced_pod("default", label_selector="app=x")
    assert [p.metadata.name for p in core.list_namespaced_pod("default").items] == ["c"]
    core.create_namespace({"metadata": {"name": "tmp"}})
    core.create_namespaced_pod("tmp", pod_body("p"))
    core.delete_namespace("tmp")
    assert core.list_pod_for_all_namespaces(field_selector="metadata.namespace=tmp").items == []
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("tmp", pod_body("q"))
    assert err.value.status == 404


def test_replicaset_deletion_collects_its_pods(
    server: KubeAPIServer, api: client.ApiClient, core: client.CoreV1Api
) -> None:
    apps = client.AppsV1Api(api)
    rs = apps.create_namespaced_replica_set(
        "default",
        {
            "metadata": {"name": "rs"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "rs"}},
                "template": {
                    "metadata": {"labels": {"app": "rs"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                },
            },
        },
    )
    assert rs.status.replicas == 0
    running_pods(core, 1, {"app": "rs"}, owner=rs)
    core.create_namespaced_pod("default", pod_body("unowned", labels={"app": "rs"}))
    apps.delete_namespaced_replica_set("rs", "default")
    assert [p.metadata.name for p in core.list_namespaced_pod("default").items] == ["unowned"]


def test_bad_requests_get_clear_statuses(
    server: KubeAPIServer, api: client.ApiClient, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "p", "default", {"metadata": {}}, _content_type="application/apply-patch+yaml"
        )
    assert err.value.status == 415
    import urllib3

    http = urllib3.PoolManager()
    r = http.request(
        "POST",
        server.url + "/api/v1/namespaces/default/pods",
        body=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status == 400 and json.loads(r.data)["reason"] == "BadRequest"
    r = http.request("PUT", server.url + "/api/v1/namespaces/default/pods")
    assert r.status == 405 and json.loads(r.data)["kind"] == "Status"
    r = http.request("GET", server.url + "/api/v1/widgets")
    assert r.status == 404 and json.loads(r.data)["reason"] == "NotFound"
    r = http.request("GET", server.url + "/api/v1/namespaces/default/pods/p/bogus")
    assert r.status == 404
    body = {"metadata": {"name": "other"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_pod("p", "default", body)
    assert err.value.status == 400
    assert client.VersionApi(api).get_code().major == "1"


def test_numeric_quantities_round_trip(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    body = pod_body("p")
    body["spec"]["containers"][0]["resources"] = {"limits": {"cpu": 1, "gpupack.io/gpu": 2}}
    server.create("pods", body)  # raw JSON numbers, as kubectl or a dict-based client may send
    pod = core.read_namespaced_pod("p", "default")
    assert pod.spec.containers[0].resources.limits == {"cpu": "1", "gpupack.io/gpu": "2"}
    pod.metadata.labels = {"changed": "yes"}
    assert core.replace_namespaced_pod("p", "default", pod).metadata.labels == {"changed": "yes"}


def test_binding_copies_annotations(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    body = {
        "metadata": {"name": "p", "annotations": {"gpupack.io/assignment": "{}"}},
        "target": {"name": "n1"},
    }
    core.create_namespaced_pod_binding("p", "default", body, _preload_content=False)
    pod = core.read_namespaced_pod("p", "default")
    assert pod.spec.node_name == "n1" and pod.metadata.annotations == {"gpupack.io/assignment": "{}"}


def test_direct_helpers_emit_watch_events(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    rv = core.list_node().metadata.resource_version
    server.create("nodes", {"metadata": {"name": "n1"}})
    server.set_status("nodes", "n1", {"allocatable": {"gpupack.io/gpu": "8"}})
    server.patch("nodes", "n1", {"metadata": {"labels": {"a": "b"}}})
    assert server.get("nodes", "n1")["metadata"]["labels"] == {"a": "b"}
    server.delete("nodes", "n1")
    events: list[tuple[str, str]] = []
    collect(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1), events, 4)
    assert [e[0] for e in events] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
    server.create("pods", pod_body("p"))
    server.set_status("pods", "p", {"phase": "Running"}, namespace="default")
    assert core.read_namespaced_pod("p", "default").status.phase == "Running"


def test_pod_runner_marks_only_its_nodes(server: KubeAPIServer, core: client.CoreV1Api) -> None:
    for name in ("a", "b"):
        core.create_namespaced_pod("default", pod_body(name))
    with PodRunner(server, nodes=["n1"]) as runner:
        bind(core, "a", "n1")
        bind(core, "b", "n2")
        wait_until(lambda: core.read_namespaced_pod("a", "default").status.phase == "Running")
        time.sleep(0.2)
        assert core.read_namespaced_pod("b", "default").status.phase == "Pending"
        assert runner.errors == []


def test_node_scoped_watch_sees_pods_as_they_are_bound(core: client.CoreV1Api) -> None:
    # What a kubelet (or device plugin) watching spec.nodeName=<node> relies on.
    rv = core.list_pod_for_all_namespaces().metadata.resource_version
    core.create_namespaced_pod("default", pod_body("p"))
    events: list[tuple[str, str]] = []
    w = watch.Watch()
    stream = w.stream(
        core.list_pod_for_all_namespaces,
        field_selector="spec.nodeName=n1",
        resource_version=rv,
        timeout_seconds=5,
    )
    t = threading.Thread(target=collect, args=(stream, events, 2))
    t.start()
    bind(core, "p", "n1")
    core.delete_namespaced_pod("p", "default")
    t.join(timeout=5)
    assert events == [("ADDED", "p"), ("DELETED", "p")]


def test_strategic_merge_on_template_containers(api: client.ApiClient) -> None:
    apps = client.AppsV1Api(api)
    containers = [
        {"name": "a", "image": "a:1", "resources": {"limits": {"gpupack.io/gpu": "1"}}},
        {"name": "b", "image": "b:1"},
    ]
    apps.create_namespaced_deployment(
        "default",
        {
            "metadata": {"name": "d"},
            "spec": {
                "selector": {"matchLabels": {"app": "d"}},
                "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": containers}},
            },
        },
    )
    dep = apps.patch_namespaced_deployment(
        "d", "default", {"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "a:2"}]}}}}
    )
    got = {
        c.name: (c.image, c.resources.limits if c.resources else None)
        for c in dep.spec.template.spec.containers
    }
    assert got == {"a": ("a:2", {"gpupack.io/gpu": "1"}), "b": ("b:1", None)}
    dep = apps.patch_namespaced_deployment(
        "d", "default", {"spec": {"template": {"spec": {"containers": [{"name": "b", "$patch": "delete"}]}}}}
    )
    assert [c.name for c in dep.spec.template.spec.containers] == ["a"]


def test_oversized_body_is_413_and_connection_survives() -> None:
    with KubeAPIServer(max_body_bytes=64 * 1024) as server:
        core = client.CoreV1Api(server.api_client())
        big = pod_body("big")
        big["metadata"]["annotations"] = {"x": "y" * (1024 * 1024)}
        with pytest.raises(ApiException) as err:
            core.create_namespaced_pod("default", big)
        assert err.value.status == 413 and status_of(err.value)["reason"] == "RequestEntityTooLarge"
        assert core.create_namespaced_pod("default", pod_body("small")).metadata.name == "small"
