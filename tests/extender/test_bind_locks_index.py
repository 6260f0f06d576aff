"""Issue 29: the filter asks whether a node is locked only of the nodes its answer looks at, so its
cost does not grow with the handoffs pending elsewhere (slow kubelets). BindLocks.lock_check says
of each node what locked_nodes says, and keep_best skips a locked node for the next best one.

Views are plain objects (no API server)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from ext_helpers import container, node_obj, pod_obj
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.api.wire import ExtenderArgs
from extender.state.bind_locks import BindLocks
from extender.state.records import PodInfo
from extender.state.view import ClusterView
from extender.verbs import filtering
from extender.verbs.binding import assignment_from_fit
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from gpupack.contract import HANDOFF_DONE, HANDOFF_PENDING
from gpupack.core.policies import get_policy

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
NODES = [f"n{i}" for i in range(5)]

# one pod: (node, handoff, deleting, bound, inflight, doubtful)
pod_spec = st.tuples(
    st.sampled_from(NODES),
    st.sampled_from([HANDOFF_PENDING, HANDOFF_PENDING, HANDOFF_DONE, ""]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


def _locks(pods: list[tuple], claims: list[tuple], expected: list[tuple]) -> BindLocks:
    lock = threading.RLock()
    view: Any = SimpleNamespace(lock=lock, changed=threading.Condition(lock), pods={})
    locks = BindLocks(view)
    for i, (node, ho, deleting, bound, inflight, doubtful) in enumerate(pods):
        key = f"ns/p{i}"
        p = PodInfo(
            key, f"uid-{i}", node, None, "", frozenset(), ho, deleting, bound_node=node if bound else ""
        )  # type: ignore[arg-type]
        view.pods[key] = p
        locks.index_pending(p)
        if inflight:
            locks.inflight.add(key)
        if doubtful:
            locks.doubtful[key] = (p.uid, "1", "")
    for node, i, uid in claims:
        locks.claim(node, f"ns/c{i}", uid)
    for i, (until, nodes) in enumerate(expected):
        locks.expect(f"uid-e{i}", f"ns/e{i}", tuple(nodes), until)
    return locks


@settings(max_examples=300, deadline=None)
@given(
    st.lists(pod_spec, max_size=8),
    st.lists(
        st.tuples(st.sampled_from(NODES), st.integers(0, 3), st.sampled_from(["", "uid-0", "uid-c"])),
        max_size=4,
    ),
    st.lists(
        st.tuples(st.sampled_from([5.0, 15.0]), st.lists(st.sampled_from(NODES), max_size=3)), max_size=3
    ),
    st.sampled_from(["uid-0", "uid-1", "uid-e0", "uid-x"]),
    st.booleans(),
)
def test_lock_check_says_of_each_node_what_locked_nodes_says(pods, claims, expected, exclude, handoffs):
    a, b = _locks(pods, claims, expected), _locks(pods, claims, expected)
    whole = a.locked_nodes(exclude, 10.0, handoffs=handoffs)
    with b.view.lock:
        check = b.lock_check(exclude, 10.0, handoffs=handoffs)
        each = {n: k for n in NODES if (k := check(n)) is not None}
    assert each == whole
    # the index holds only nodes with a pending handoff: its size is theirs, not the nodes ever seen
    assert all(b.pending.values())
    assert set(b.pending) == {n for n, ho, d, bnd, *_ in pods if ho == HANDOFF_PENDING and (not d or bnd)}


class CountingPods(dict):
    """The view's pods, counting the lookups by key (the walk over pending handoffs makes one each)."""

    gets = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)


def _fleet(n_nodes: int) -> tuple[ClusterView, Extender]:
    view = ClusterView()
    view.replace_nodes([node_obj(f"node-{i:04d}") for i in range(n_nodes)])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    return view, ext


def _bind_pending(view: ClusterView, ext: Extender, pod: dict, node: str) -> None:
    """`pod` bound to `node` with its handoff pending (its kubelet has not admitted it yet)."""
    req = ext.pod_request(pod)
    with view.lock:
        f, _ = ext.placements.node_fit(node, req, NOW, None)
        assert f, f"{pod['metadata']['name']} does not fit {node}"
        a = assignment_from_fit(view.state.nodes[node], req, f, NOW, "", view.nodes[node].gpu_indexes)
        view.assume(req.key, req.uid, a, frozenset())
    view.mark_bound(req.key, node)


def _filter(ext: Extender, name: str, names: list[str]) -> dict:
    pod = pod_obj(name, [container("main", 1, 20000, 30)], uid=f"uid-{name}")
    return ext.filter(ExtenderArgs(pod, names, None))


def test_handoffs_pending_on_other_nodes_cost_the_filter_no_lookup():
    view, ext = _fleet(600)
    names = list(view.nodes)
    # 500 nodes each hold a pod of 8 whole GPUs whose kubelet is slow: pending, the node full
    for i, n in enumerate(names[:500]):
        _bind_pending(view, ext, pod_obj(f"whole-{i}", [container("main", 8)], uid=f"uid-whole-{i}"), n)
    assert len(view.locks.pending) == 500
    _filter(ext, "warm", names)  # the shape's answer cached: what follows is the steady state
    pods = CountingPods(view.pods)
    view.pods = pods
    out = _filter(ext, "asked", names)
    assert out["NodeNames"] and out["NodeNames"][0] in names[500:]
    # the old filter walked all 500 pending handoffs (one lookup each) on every request
    assert pods.gets < 10, pods.gets


def test_keep_best_skips_a_locked_best_node_for_the_next_and_keeps_it_when_all_are_locked():
    view, ext = _fleet(3)
    names = list(view.nodes)
    first = _filter(ext, "a", names)["NodeNames"]
    assert len(first) == 1
    best = first[0]
    # a pod bound there waits for its kubelet: the next pod goes to another node, with the reason
    _bind_pending(view, ext, pod_obj("p0", [container("main", 1, 20000, 30)], uid="uid-p0"), best)
    out = _filter(ext, "b", names)
    assert out["NodeNames"] and out["NodeNames"][0] != best
    assert "GPU handoff" in out["FailedNodes"][best]
    # every node locked: the best of them is still answered (a bind there waits rather than fails)
    for i, n in enumerate(x for x in names if x != best):
        _bind_pending(view, ext, pod_obj(f"q{i}", [container("main", 1, 20000, 30)], uid=f"uid-q{i}"), n)
    out = _filter(ext, "c", names)
    assert len(out["NodeNames"]) == 1 and not out["FailedNodes"]


def _one_gpu_node() -> tuple[ClusterView, Extender]:
    view = ClusterView()
    view.replace_nodes([node_obj("solo", n=1)])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    return view, ext


def _whole(name: str) -> dict:
    return pod_obj(name, [container("main", 1)], uid=f"uid-{name}")


def _arrive_and_hold(view: ClusterView, ext: Extender, pod: dict, node: str) -> None:
    """What Binder._bind does on a bind's arrival: claim the node, fit the pod, hold its room."""
    req = ext.pod_request(pod)
    with view.lock:
        view.locks.claim(node, req.key, req.uid)
        f, _ = ext.placements.node_fit(node, req, NOW, None)
        assert f, f
        a = assignment_from_fit(view.state.nodes[node], req, f, NOW, "", view.nodes[node].gpu_indexes)
        view.assume(req.key, req.uid, a, frozenset())
        view.locks.settle_claim(req.key)


def test_a_filter_that_overtakes_the_last_pods_bind_waits_for_it_and_gives_no_fit_the_bind_refuses():
    """Issue 31 item 7: kube-scheduler starts a pod's bind and its next pod's filter together. When
    the only node that fits is the one the first pod is about to take, the filter that overtakes
    the bind must not pass it on a view without the first pod (its bind would then refuse the fit):
    it waits for that bind to hold its room, then answers from the whole view."""
    view, ext = _one_gpu_node()
    assert ext.filter(ExtenderArgs(_whole("a"), ["solo"], None))["NodeNames"] == ["solo"]
    answers: list[dict] = []
    t = threading.Thread(target=lambda: answers.append(ext.filter(ExtenderArgs(_whole("b"), ["solo"], None))))
    t.start()
    # the filter is waiting for a's bind (not answered on a view without it)
    t.join(0.2)
    assert t.is_alive() and not answers
    _arrive_and_hold(view, ext, _whole("a"), "solo")
    t.join(5)
    assert not t.is_alive()
    out = answers[0]
    assert out["NodeNames"] == [] and "solo" in out["FailedNodes"], out


def test_a_filter_waits_at_most_briefly_for_a_pod_that_is_never_bound():
    """The expected pod may never be bound (kube-scheduler chose otherwise): after the short wait
    the node passes."""
    view, ext = _one_gpu_node()
    assert ext.filter(ExtenderArgs(_whole("a"), ["solo"], None))["NodeNames"] == ["solo"]
    t0 = time.monotonic()
    out = ext.filter(ExtenderArgs(_whole("b"), ["solo"], None))
    assert out["NodeNames"] == ["solo"], out
    assert filtering.COMING_WAIT_S * 0.9 <= time.monotonic() - t0 < filtering.WHOLE_WAIT_S


def test_a_filter_does_not_wait_when_another_node_is_free_of_expected_binds():
    view = ClusterView()
    view.replace_nodes([node_obj("n-a", n=1), node_obj("n-b", n=1)])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW, config=ExtenderConfig(keep_best=1))
    first = ext.filter(ExtenderArgs(_whole("a"), ["n-a", "n-b"], None))["NodeNames"]
    t0 = time.monotonic()
    out = ext.filter(ExtenderArgs(_whole("b"), ["n-a", "n-b"], None))
    assert out["NodeNames"] and out["NodeNames"] != first
    assert time.monotonic() - t0 < filtering.WHOLE_WAIT_S
