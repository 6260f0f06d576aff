"""The shape warmer (extender/verbs/warming.py) computes pod shapes' answers off kube-scheduler's cycle:
what it leaves in the caches must answer exactly as an extender that starts from nothing, however
the cluster changes between its chunks; after the policy learnt, a shape's old node order serves
(never a node the pod does not fit) until the warmer has scored every node again, for a bounded
while; and the pods waiting for the scheduler reach it through a watch of the real API server."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import realk8s
from ext_helpers import assume_on, container, node_obj, pod_obj, workload_policy
from realk8s import until

from extender.api.kube import Kube, api_client
from extender.api.wire import parse_extender_args
from extender.state.placement_index import shape_of
from extender.state.view import ClusterView
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from extender.verbs.scoring import STALE_ORDER_MAX_S
from extender.verbs.warming import ShapeWarmer, pending_watcher
from gpupack.core.gpupack_policy import GpupackPolicy

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SHAPES = [(1, 20000, 30), (1, 40000, 50), (1, 70000, 90), (2, None, None), (1, None, None)]


def _pod(i: int, shape: tuple, cls: str = "online") -> dict:
    gpus, mem, sm = shape
    p = pod_obj(f"p{i}", [container("main", gpus, mem, sm)], namespace="prod", uid=f"uid-{i}")
    p["metadata"].setdefault("labels", {})["gpupack.io/class"] = cls
    return p


def _view(n_nodes: int) -> tuple[ClusterView, list[str]]:
    view = ClusterView()
    names = [f"n{i}" for i in range(n_nodes)]
    view.replace_nodes([node_obj(n, n=4) for n in names])
    view.synced.set()
    return view, names


def _workload_policy(view: ClusterView) -> GpupackPolicy:
    """A policy given its workload: it learns nothing, so two extenders score alike."""
    return workload_policy(view, [_pod(10_000 + j, s) for j, s in enumerate(SHAPES)])  # type: ignore[no-any-return]


def _place(ext: Extender, pod: dict, node: str) -> bool:
    ok = assume_on(ext, pod, node, NOW)
    if ok:  # its bind has come (BindLocks.claim drops the expectation so)
        m = pod["metadata"]
        ext.view.locks.expect(m["uid"], f"{m['namespace']}/{m['name']}", (), 0.0)
    return ok


def _filter(ext: Extender, pod: dict, names: list[str]) -> dict[str, Any]:
    out = ext.filter(parse_extender_args({"Pod": pod, "NodeNames": names, "Nodes": None}))
    # no bind follows: the node it answered is not expected to take the pod (BindLocks.coming)
    m = pod["metadata"]
    ext.view.locks.expect(m["uid"], f"{m['namespace']}/{m['name']}", (), 0.0)
    return out


class Counting:
    """Counts the policy's fits and node scores (a wrapper: the policy's answers are unchanged)."""

    def __init__(self, policy: GpupackPolicy) -> None:
        self.fits = self.scores = 0
        fit, score = policy.fit, policy.node_score

        def counted_fit(*a: Any, **k: Any) -> Any:
            self.fits += 1
            return fit(*a, **k)

        def counted_score(*a: Any, **k: Any) -> Any:
            self.scores += 1
            return score(*a, **k)

        policy.fit = counted_fit  # type: ignore[method-assign]
        policy.node_score = counted_score  # type: ignore[method-assign]


@pytest.mark.parametrize("keep_best", [1, 0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_warmed_answers_equal_a_cold_extenders_with_the_cluster_changing_between_chunks(
    keep_best: int, seed: int
) -> None:
    rng = random.Random(seed)
    view, names = _view(14)
    policy = _workload_policy(view)
    cfg = ExtenderConfig(keep_best=keep_best)
    ext = Extender(view, policy, None, cfg, clock=lambda: NOW)
    ext.warmer.chunk = 3
    placed = 0

    def change_between_chunks() -> None:
        # a bind lands on a random node while the warmer is between chunks
        nonlocal placed
        if rng.random() < 0.5:
            placed += _place(ext, _pod(50_000 + rng.randrange(10**6), rng.choice(SHAPES)), rng.choice(names))

    ext.warmer._pause = change_between_chunks  # type: ignore[method-assign]
    for i in range(6):
        _place(ext, _pod(i, rng.choice(SHAPES)), rng.choice(names))
    pods = [_pod(100 + i, s, cls=rng.choice(["online", "offline"])) for i, s in enumerate(SHAPES)]
    for p in pods:
        ext.warmer.want(ext.pod_request(p))
    assert ext.warmer.drain() == len(SHAPES)
    assert placed > 0, "the cluster changed while warming"
    for p in pods:
        cold = Extender(view, policy, None, cfg, clock=lambda: NOW)
        asked = [n for n in names if rng.random() < 0.9] or names
        want = _filter(cold, p, asked)
        got = _filter(ext, p, asked)
        assert got["NodeNames"] == want["NodeNames"]
        assert got["FailedNodes"] == want["FailedNodes"]
        assert got.get("FailedAndUnresolvableNodes") == want.get("FailedAndUnresolvableNodes")
        if keep_best == 0:
            assert ext.scores_for(parse_extender_args({"Pod": p, "NodeNames": asked, "Nodes": None})) == (
                cold.scores_for(parse_extender_args({"Pod": p, "NodeNames": asked, "Nodes": None}))
            )


def test_a_filter_after_warming_fits_and_scores_no_node() -> None:
    view, names = _view(20)
    policy = _workload_policy(view)
    ext = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    for i in range(10):
        _place(ext, _pod(i, SHAPES[i % len(SHAPES)]), names[i])
    pod = _pod(100, SHAPES[1])
    ext.warmer.want(ext.pod_request(pod))
    assert ext.warmer.drain() == 1
    count = Counting(policy)
    out = _filter(ext, pod, names)
    assert len(out["NodeNames"]) == 1
    assert (count.fits, count.scores) == (0, 0)
    # answers current already: wanting the shape again queues nothing
    ext.warmer.want(ext.pod_request(_pod(101, SHAPES[1])))
    assert ext.warmer.drain() == 0


def _learning_extender(n: int, clock: list[float]) -> tuple[Extender, GpupackPolicy, list[str]]:
    view, names = _view(n)
    policy = GpupackPolicy()  # learns from the pods it is asked about
    ext = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    ext.learner.batcher.clock = lambda: clock[0]
    ext.learner.batcher.last_flush = clock[0]
    ext.warmer.attach()
    return ext, policy, names


def _flush(ext: Extender, clock: list[float], first: int) -> None:
    """Ask about new pods (each learnt) until the policy has learnt them: a new epoch."""
    epoch = ext.learner.epoch
    clock[0] += 2.0
    i = first
    while ext.learner.epoch == epoch:
        with ext.view.lock:
            ext.learner.observe(ext.pod_request(_pod(i, SHAPES[i % len(SHAPES)])))
        i += 1


def test_after_learning_the_old_order_serves_without_scoring_every_node_then_the_new_one() -> None:
    clock = [100.0]
    ext, policy, names = _learning_extender(30, clock)
    pod = _pod(1, SHAPES[0])
    first = _filter(ext, pod, names)["NodeNames"]
    shape = shape_of(ext.pod_request(pod))
    before = ext.scorer.served[shape]
    _flush(ext, clock, 1000)
    assert ext.learner.epoch > before
    # the node the old order chose fills up: the stale order must not answer it
    while _place(ext, _pod(5000 + len(ext.view.pods), SHAPES[2]), first[0]):
        pass
    count = Counting(policy)
    got = _filter(ext, _pod(2, SHAPES[0]), names)["NodeNames"]
    assert got and got[0] != first[0]
    assert count.scores <= 2, "only the node that changed is scored again"
    assert ext.scorer.served[shape] == before, "the old order served"
    assert ext.warmer.drain() >= 1
    assert ext.scorer.served[shape] == ext.learner.epoch
    assert (shape, before) not in ext.scorer.best_index.data, "the old order is dropped"
    # the new order is what a filter that scores every node now picks
    count.scores = 0
    again = _filter(ext, _pod(3, SHAPES[0]), names)["NodeNames"]
    assert count.scores == 0
    with ext.view.lock:
        ext.scorer.best_index.data.pop((shape, ext.learner.epoch))
    assert _filter(ext, _pod(4, SHAPES[0]), names)["NodeNames"] == again


def test_an_old_order_serves_for_a_bounded_while_only() -> None:
    clock = [100.0]
    ext, _policy, names = _learning_extender(10, clock)
    pod = _pod(1, SHAPES[3])
    _filter(ext, pod, names)
    shape = shape_of(ext.pod_request(pod))
    _flush(ext, clock, 1000)
    clock[0] += STALE_ORDER_MAX_S + 1  # nobody warmed it in time: the filter scores it itself
    _filter(ext, _pod(2, SHAPES[3]), names)
    assert ext.scorer.served[shape] == ext.learner.epoch


def test_without_a_warmer_every_order_is_the_current_epochs() -> None:
    clock = [100.0]
    view, names = _view(10)
    ext = Extender(view, GpupackPolicy(), None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    ext.learner.batcher.clock = lambda: clock[0]
    pod = _pod(1, SHAPES[0])
    _filter(ext, pod, names)
    shape = shape_of(ext.pod_request(pod))
    _flush(ext, clock, 1000)
    _filter(ext, _pod(2, SHAPES[0]), names)
    assert ext.scorer.served[shape] == ext.learner.epoch


def test_a_learning_policy_that_has_learnt_nothing_is_not_warmed_for() -> None:
    """A fit's GPUs follow what the policy knows and are kept across its flushes: warmed before the
    first pod is learnt, a fit would be an untaught policy's."""
    clock = [100.0]
    ext, _policy, names = _learning_extender(6, clock)
    ext.warmer.rescore(ext.pod_request(_pod(1, SHAPES[0])))  # queued without a pod learnt
    assert not ext.warmer.ready() and ext.warmer.drain() == 0
    _filter(ext, _pod(2, SHAPES[1]), names)  # the first pod asked about is learnt
    assert ext.warmer.ready() and ext.warmer.drain() == 1


def test_a_pending_pod_is_learnt_when_seen_and_its_shape_warmed_before_it_is_asked_about() -> None:
    """An extender that starts (or takes over) with pods queued learns them as its pending-pod watch
    sees them, each once: its warmer may warm their shapes at once, and the first filter of one
    fits and scores no node, nor learns its pod again."""
    clock = [100.0]
    ext, policy, names = _learning_extender(12, clock)
    for i in range(4):
        _place(ext, _pod(i, SHAPES[i % len(SHAPES)]), names[i])  # placed, not asked about: not learnt
    assert ext.learner.epoch == 0 and not ext.warmer.ready()
    first, second = _pod(100, SHAPES[1]), _pod(101, SHAPES[3])
    ext.warmer.want(ext.pod_request(first))
    assert ext.learner.epoch == 1 and ext.learner.batcher.learnt == 1  # the first pod: at once
    ext.warmer.want(ext.pod_request(second))
    assert ext.learner.batcher.waiting == [ext.pod_request(second)]  # batched, as a filter's would be
    assert ext.warmer.ready() and ext.warmer.drain() == 2
    count = Counting(policy)
    out = _filter(ext, first, names)
    assert len(out["NodeNames"]) == 1
    assert (count.fits, count.scores) == (0, 0)
    _filter(ext, second, names)
    assert (ext.learner.epoch, ext.learner.batcher.learnt, len(ext.learner.batcher.waiting)) == (1, 1, 1)


def test_a_flush_queues_the_shapes_asked_most_recent_first() -> None:
    clock = [100.0]
    ext, _policy, names = _learning_extender(6, clock)
    for i, s in enumerate(SHAPES[:3]):
        _filter(ext, _pod(i, s), names)
    ext.warmer.drain()
    _flush(ext, clock, 1000)
    queued = [shape for shape, _ in ext.warmer._queue.items()]
    assert queued == [shape_of(ext.pod_request(_pod(0, s))) for s in reversed(SHAPES[:3])]


def test_pending_pods_shapes_reach_the_warmer_through_the_watch(
    cluster: realk8s.ControlPlane, ns: str, tmp_path: Path
) -> None:
    view, _names = _view(4)
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc"))))
    ext = Extender(view, _workload_policy(view), kube, ExtenderConfig(keep_best=1))
    warmer: ShapeWarmer = ext.warmer
    wanted: list[Any] = []
    warmer.want = wanted.append  # type: ignore[method-assign]
    stop = threading.Event()
    already = _pod(1, SHAPES[0])
    already["spec"]["schedulerName"] = "gpupack-scheduler"
    cluster.core.create_namespaced_pod(ns, _strip(already))
    watcher = pending_watcher(kube, "gpupack-scheduler", warmer, stop)
    t = threading.Thread(target=watcher.run, daemon=True)
    t.start()
    try:
        until(lambda: len(wanted) == 1, 20, "the listed pending pod")
        later = _pod(2, SHAPES[3])
        later["spec"]["schedulerName"] = "gpupack-scheduler"
        cluster.core.create_namespaced_pod(ns, _strip(later))
        other = _pod(3, SHAPES[1])  # another scheduler's: not ours to warm
        other["spec"]["schedulerName"] = "default-scheduler"
        cluster.core.create_namespaced_pod(ns, _strip(other))
        until(lambda: len(wanted) >= 2, 20, "the pending pod watched")
        mark = _pod(4, SHAPES[2])  # created after the other: once seen, the other was passed over
        mark["spec"]["schedulerName"] = "gpupack-scheduler"
        cluster.core.create_namespaced_pod(ns, _strip(mark))
        until(lambda: any(w.key == f"{ns}/p4" for w in wanted), 20, "the last pending pod watched")
        assert sorted(w.key for w in wanted) == [f"{ns}/p1", f"{ns}/p2", f"{ns}/p4"]
        got = next(w for w in wanted if w.key == f"{ns}/p2")
        assert shape_of(got) == shape_of(
            ext.pod_request({**later, "metadata": {**later["metadata"], "namespace": ns}})
        )
    finally:
        stop.set()


def _strip(pod: dict) -> dict:
    """The pod as a client creates it: no uid, no namespace in the body."""
    p = {**pod, "metadata": {k: v for k, v in pod["metadata"].items() if k not in ("uid", "namespace")}}
    return p


def test_a_flush_while_scoring_scores_again_in_chunks_for_the_new_epoch() -> None:
    clock = [100.0]
    ext, _policy, names = _learning_extender(10, clock)
    ext.warmer.chunk = 3
    _filter(ext, _pod(1, SHAPES[1]), names)  # the policy has learnt one pod
    pod = ext.pod_request(_pod(2, SHAPES[0]))
    pauses = 0
    chunks = -(-len(names) // 3)

    def pause() -> None:
        nonlocal pauses
        pauses += 1
        if pauses == chunks + 1:  # the first chunk of scores: the policy learns meanwhile
            _flush(ext, clock, 2000)

    ext.warmer._pause = pause  # type: ignore[method-assign]
    assert ext.warmer.warm(pod)
    # fits in chunks; scores: the first round stops at the chunk that finds the new epoch (and
    # does not build the answer), the second scores every chunk for it, then the answer
    assert pauses == chunks + (1 + 1) + (chunks + 1)
    assert ext.scorer.served[shape_of(pod)] == ext.learner.epoch


@pytest.mark.parametrize("keep_best", [1, 0])
def test_warming_from_a_pod_already_placed_answers_as_for_any_pod_of_its_shape(keep_best: int) -> None:
    """A pending pod seen by the watch may be bound before its shape is warmed: warmed as that pod,
    its node would look as if it did not hold the pod's own share (it is that share's holder)."""
    view, names = _view(4)
    policy = _workload_policy(view)
    cfg = ExtenderConfig(keep_best=keep_best)
    ext = Extender(view, policy, None, cfg, clock=lambda: NOW)
    first = _pod(1, SHAPES[1])
    ext.warmer.want(ext.pod_request(first))
    assert _place(ext, first, names[2])
    assert ext.warmer.drain() == 1
    other = _pod(2, SHAPES[1])
    cold = Extender(view, policy, None, cfg, clock=lambda: NOW)
    req = ext.pod_request(other)
    with view.lock:
        want = cold.scorer.raw_scores(req, names, NOW)
        got = ext.scorer.raw_scores(req, names, NOW)
    assert len(set(want.values())) > 1, "the partly used node scores apart from the empty ones"
    assert got == want


def test_a_slow_filter_is_logged_with_where_its_time_went(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import extender.verbs.filtering as filtering

    view, names = _view(6)
    ext = Extender(view, _workload_policy(view), None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    monkeypatch.setattr(filtering, "SLOW_FILTER_S", 0.0)
    with caplog.at_level("INFO", logger="gpupack.extender"):
        _filter(ext, _pod(1, SHAPES[0]), names)  # a new shape: every node fitted and scored
        _filter(ext, _pod(2, SHAPES[0]), names)  # kept: none
    lines = [r.getMessage() for r in caplog.records if "slow filter" in r.getMessage()]
    assert len(lines) == 2
    assert "pod prod/p1" in lines[0] and "6 node(s) fitted, 6 scored" in lines[0]
    assert "0 node(s) fitted, 0 scored" in lines[1]
    # the warmer's work is not counted in the last filter's cost
    cost = (ext.filtering.cost.fitted, ext.filtering.cost.scored)
    assert ext.warmer.warm(ext.pod_request(_pod(5, SHAPES[2])))
    assert (ext.filtering.cost.fitted, ext.filtering.cost.scored) == cost
    monkeypatch.setattr(filtering, "SLOW_FILTER_S", 10.0)
    caplog.clear()
    _filter(ext, _pod(3, SHAPES[0]), names)
    assert not [r for r in caplog.records if "slow filter" in r.getMessage()]


def test_new_pending_shapes_are_warmed_newest_first_and_one_a_filter_answered_is_dropped() -> None:
    view, names = _view(8)
    ext = Extender(view, _workload_policy(view), None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    reqs = [ext.pod_request(_pod(i, s)) for i, s in enumerate(SHAPES[:3])]
    for r in reqs:
        ext.warmer.want(r)
    order = []
    while (item := ext.warmer._next(0)) is not None:
        order.append(shape_of(item[0]))
    # kube-scheduler takes the oldest first: those are the ones it would reach while being warmed
    assert order == [shape_of(r) for r in reversed(reqs)]

    ext.warmer.chunk = 2
    pauses = 0

    def pause() -> None:
        nonlocal pauses
        pauses += 1
        if pauses == 2:  # kube-scheduler asks about that shape while it is being warmed
            _filter(ext, _pod(100, SHAPES[0]), names)

    ext.warmer._pause = pause  # type: ignore[method-assign]
    assert not ext.warmer.warm(reqs[0]), "the filter's answer stands; the rest is not redone"
    assert pauses == 2


def test_a_flush_rescores_only_the_shapes_asked_recently() -> None:
    clock = [100.0]
    ext, _policy, names = _learning_extender(6, clock)
    ext.warmer.monotonic = lambda: clock[0]
    _filter(ext, _pod(0, SHAPES[0]), names)
    clock[0] += 120.0  # SHAPES[0] was asked two minutes ago
    _filter(ext, _pod(1, SHAPES[1]), names)
    ext.warmer.drain()
    _flush(ext, clock, 1000)
    assert [shape for shape in ext.warmer._queue] == [shape_of(ext.pod_request(_pod(1, SHAPES[1])))]
    # the old one is scored again when it is asked next, its old order serving meanwhile
    _filter(ext, _pod(2, SHAPES[0]), names)
    assert shape_of(ext.pod_request(_pod(2, SHAPES[0]))) in ext.warmer._urgent


def test_a_pending_pod_gpupack_cannot_parse_is_left_to_the_filter() -> None:
    """The watch hands on the shapes of pods it can read; one with a malformed request is skipped
    (the filter answers it with the reason), and the watch goes on."""
    view, _names = _view(2)
    ext = Extender(view, _workload_policy(view), None, ExtenderConfig(keep_best=1))
    wanted: list[Any] = []
    ext.warmer.want = wanted.append  # type: ignore[method-assign]
    watcher = pending_watcher(None, "gpupack-scheduler", ext.warmer, threading.Event())  # type: ignore[arg-type]
    bad = _pod(1, SHAPES[0])
    bad["spec"]["containers"][0]["resources"]["limits"]["gpupack.io/gpu-mem"] = "lots"
    watcher.apply(bad)
    watcher.apply(_pod(2, SHAPES[1]))
    watcher.apply(_pod(2, SHAPES[1]))  # a later event of the same pod: handed on once
    assert [w.key for w in wanted] == ["prod/p2"]
