"""Property test: the first filter of a pod shape (every node asked, each node state fitted once and
its answer handed to the other nodes in that state) answers exactly what fitting every node on its
own answers: the same nodes pass, the same reasons for the rest, and a Fit handed out afterwards
is always for the node asked about.

Clusters are plain objects (no API server): nodes of two sizes with random pods already on them,
some cordoned, some with an unreadable inventory, with no GPU slots, holding a defrag
reservation, or short of CPU for the pod; many nodes share a state, as in a real fleet."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from ext_helpers import container, node_obj, pod_obj
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.api.wire import ExtenderArgs, filter_result
from extender.state.placement_index import shape_of
from extender.state.view import ClusterView
from extender.verbs.binding import assignment_from_fit
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, HANDOFF_DONE, RES_GPU, GPUShare, Reservation
from gpupack.core.fit import Fit
from gpupack.core.policies import get_policy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SHAPES = [(1, 20000, 30), (1, 40000, 50), (1, 70000, 90), (2, None, None), (1, None, None), (1, 8000, 10)]
KINDS = ["plain", "plain", "plain", "cordoned", "corrupt", "no-slots", "reserved", "small-cpu", "two-gpus"]

node_spec = st.tuples(
    st.sampled_from(KINDS),
    st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(["online", "offline"])), max_size=4),
)


def _node(name: str, kind: str) -> dict:
    n = 2 if kind == "two-gpus" else 4
    if kind == "corrupt":
        return node_obj(name, n=n, raw_inventory="{not json")
    if kind == "reserved":
        r = Reservation(
            id=f"r-{name}", namespace="prod", owner_kind="ReplicaSet", owner_name="web",
            pod_class="online", containers={"main": (GPUShare(f"GPU-{name}-1", 1, 30000, 40),)},
            expires=(NOW + timedelta(hours=1)).isoformat().replace("+00:00", "Z"),
        )  # fmt: skip
        obj = node_obj(name, n=n, reservations=[r])
    else:
        obj = node_obj(name, n=n)
    if kind == "cordoned":
        obj["spec"] = {"unschedulable": True}
    if kind == "no-slots":
        obj["status"]["allocatable"][RES_GPU] = "0"
    if kind == "small-cpu":
        obj["status"]["allocatable"]["cpu"] = "1"
    return obj


def _pod(name: str, shape: tuple, cls: str, cpu: str | None = None) -> dict:
    gpus, mem, sm = shape
    p = pod_obj(name, [container("main", gpus, mem, sm)], cls, namespace="prod", uid=f"uid-{name}")
    if cpu is not None:
        p["spec"]["containers"][0]["resources"].setdefault("requests", {})["cpu"] = cpu
    return p


def _cluster(specs: list[tuple[str, list]]) -> tuple[ClusterView, Extender, list[str]]:
    view = ClusterView(track_host=True)
    names = [f"n{i:02d}" for i in range(len(specs))]
    view.replace_nodes([_node(n, kind) for n, (kind, _) in zip(names, specs, strict=True)])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=0))
    running = []  # placed as the policy would, handed over to their kubelets (no node is locked)
    for n, (_kind, pods) in zip(names, specs, strict=True):
        for j, (shape, cls) in enumerate(pods):
            pod = _pod(f"{n}-{j}", shape, cls)
            req = ext.pod_request(pod)
            with view.lock:
                f, _ = ext.placements.node_fit(n, req, NOW, None)
                if not f:
                    continue
                a = assignment_from_fit(view.state.nodes[n], req, f, NOW, "", view.nodes[n].gpu_indexes)
                view.assume(req.key, req.uid, a, frozenset())
            pod["metadata"]["annotations"] = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
            pod["spec"]["nodeName"] = n
            pod["status"]["phase"] = "Running"
            running.append(pod)
    view.replace_pods(running)
    return view, ext, names


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.lists(node_spec, min_size=1, max_size=14),
    st.sampled_from(SHAPES),
    st.sampled_from(["online", "offline"]),
    st.sampled_from([None, "2"]),
)
def test_first_filter_answers_as_every_node_fitted_alone(specs, shape, cls, cpu):
    view, ext, names = _cluster(specs)
    pod = _pod("asked", shape, cls, cpu)
    args = ExtenderArgs(pod, names, None)
    out = ext.filter(args)
    req = ext.pod_request(pod)
    fresh = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=0))
    passed, failed, unresolvable = [], {}, {}
    with view.lock:
        for n in names:
            r, _ = fresh.placements.node_fit(n, req, NOW, None)  # no table, no memo: this node alone
            if r:
                passed.append(n)
            else:
                (unresolvable if r.unresolvable else failed)[n] = r.reason
    assert out == filter_result(args, passed, failed, unresolvable)
    # the fit table now holds one Fit per state; each node is still handed its own
    table = ext.placements.fit_table(shape_of(req))
    with view.lock:
        for n in passed:
            f, _ = ext.placements.node_fit(n, req, NOW, table)
            assert isinstance(f, Fit) and f.placement.node == n
