"""Property test: with kube-scheduler's NodeResourcesFit filter off, the extender's own check is all
that keeps a node's pods within its allocatable. Whatever pods arrive, leave and are bound in
whatever order, a node never holds more pods, CPU, memory, ephemeral storage or extended resources
than it has, and a node is refused only when the pod really does not fit there.

Pods are placed as the bind does (filter, then view.host.assume / view.host.apply_pod for the watch),
over plain objects: no API server, the arithmetic and the caches are what is under test."""

from datetime import UTC, datetime

import pytest
from ext_helpers import node_obj, pod_obj
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extender.api.wire import ExtenderArgs
from extender.state.hostuse import pod_host_request
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.core.policies import get_policy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
NODES = {
    # name: (cpu, memory MiB, ephemeral MiB, pods, example.com/nic)
    "a": ("4", 8192, 10240, 3, None),
    "b": ("2500m", 4096, 0, 5, "2"),
    "c": ("8", 16384, 20480, 2, "1"),
}

# a few shapes, so that a shape asked about again meets the answers cached for it
requests = st.sampled_from(
    [
        {},
        {"cpu": "1"},
        {"cpu": "1500m", "memory": "1Gi"},
        {"memory": "3Gi"},
        {"ephemeral-storage": "4Gi"},
        {"example.com/nic": "1"},
        {"cpu": "500m", "memory": "256Mi", "ephemeral-storage": "1Gi", "example.com/nic": "1"},
    ]
)
# (arrives: requests, init container requests or None) or (leaves: index among the bound pods)
step = st.one_of(
    st.tuples(st.just("arrive"), requests, st.one_of(st.none(), requests)),
    st.tuples(st.just("leave"), st.integers(0, 20), st.none()),
)


def node(name: str) -> dict:
    cpu, mem, eph, pods, nic = NODES[name]
    obj = node_obj(name, 1)
    alloc = {"cpu": cpu, "memory": f"{mem}Mi", "pods": str(pods)}
    if eph:
        alloc["ephemeral-storage"] = f"{eph}Mi"
    if nic:
        alloc["example.com/nic"] = nic
    obj["status"]["allocatable"] = obj["status"]["capacity"] = alloc
    return obj


def within(view: ClusterView, name: str, extra: dict | None = None) -> bool:
    """Whether the pods on `name` (plus `extra`, a pod) fit its allocatable, counted from scratch."""
    info = view.nodes[name]
    pods = [hp.use for hp in view.host.pods.values() if hp.node == name]
    pods += [a.use for a, _ in view.host.assumed.values() if a.node == name]
    if extra is not None:
        pods.append(pod_host_request(extra))
    if len(pods) > info.pods_allowed:
        return False
    alloc, other = info.allocatable, dict(info.allocatable.other)
    used = {"cpu": 0, "mem": 0, "eph": 0}
    nic = 0
    for u in pods:
        used["cpu"] += u.cpu_milli
        used["mem"] += u.mem_bytes
        used["eph"] += u.eph_bytes
        nic += dict(u.other).get("example.com/nic", 0)
    return (
        used["cpu"] <= alloc.cpu_milli
        and used["mem"] <= alloc.mem_bytes
        and used["eph"] <= alloc.eph_bytes
        and nic <= other.get("example.com/nic", 0)
    )


FILL_LEAVE_REFILL = [("arrive", {"ephemeral-storage": "4Gi"}, None)] * 3 + [
    ("leave", 0, None),
    ("arrive", {"ephemeral-storage": "4Gi"}, None),
]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=40), st.booleans())
# a resource freed that neither CPU nor memory shows must still reach the answers cached for a shape
@example(FILL_LEAVE_REFILL, True)
def test_no_node_is_ever_overcommitted_and_no_fitting_node_refused(steps, watch_echoes):
    view = ClusterView(track_host=True)
    view.replace_nodes([node(n) for n in NODES])
    view.host.replace_pages([[]])
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW)
    bound: list[dict] = []
    for i, (kind, what, init) in enumerate(steps):
        if kind == "leave":
            if bound:
                gone = bound.pop(what % len(bound))
                view.host.delete_pod(gone)
                view.host.unassume(f"h/{gone['metadata']['name']}", gone["metadata"]["uid"])
            continue
        c = {"name": "c", "image": "x", "resources": {"requests": dict(what)}}
        ic = [{"name": "i", "image": "x", "resources": {"requests": dict(init)}}] if init else None
        pod = pod_obj(f"p{i}", [c], cls=None, namespace="h", init=ic, uid=f"uid-{i}")
        out = ext.filter(ExtenderArgs(pod, list(NODES), None))
        for name in NODES:
            fits = within(view, name, pod)
            assert (name in out["NodeNames"]) == fits, (name, out, what, init)
        if not out["NodeNames"]:
            continue
        target = out["NodeNames"][0]
        # the bind charges it at once; the watch shows it later (or, here, at once)
        view.host.assume(f"h/p{i}", f"uid-{i}", target, pod_host_request(pod))
        pod["spec"]["nodeName"] = target
        if watch_echoes:
            view.host.apply_pod(pod)
        bound.append(pod)
        for name in NODES:
            assert within(view, name), (name, view.nodes[name])
