"""What stands aside for filter and prioritize (extender/verbs/collector.py): full garbage collections
(never while a verb is answered unless overdue), binds and watch events (they wait for it, a
bounded time); and the verbs say when they run."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref

import pytest
import realk8s
from ext_helpers import bind_body, container, create_pod, gpu_node, node_obj, pod_obj

from extender.api.kube import Kube, api_client
from extender.api.wire import parse_bind_args
from extender.serve.app import create_extender_app
from extender.state.metrics import Metrics
from extender.state.sync import Sync
from extender.state.view import ClusterView
from extender.verbs.collector import DUE_YOUNG_COLLECTIONS, NEVER, YIELD_MAX_S, IdleCollector, VerbActivity
from extender.verbs.framework import Extender
from gpupack.core.policies import DEFAULT_POLICY, get_policy

until = realk8s.until


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def collector(
    clock: Clock, young: list[int], done: list[tuple[float, bool]]
) -> tuple[IdleCollector, VerbActivity]:
    activity = VerbActivity(clock)
    calls: list[int] = []

    def collect() -> int:
        calls.append(1)
        young[0] = 0  # as gc.collect() resets the count of young collections
        return 0

    c = IdleCollector(
        activity, idle_s=1.0, max_gap_s=300.0, clock=clock, collect=collect,
        young_count=lambda: young[0], on_collect=lambda s, o: done.append((s, o)),
        freeze=lambda: None, unfreeze=lambda: None,
    )  # fmt: skip
    return c, activity


def test_collects_only_when_due_and_quiet() -> None:
    clock, young, done = Clock(), [0], []
    c, activity = collector(clock, young, done)
    clock.t += 5
    assert not c.step()  # quiet, but nothing promoted since the last full collection
    young[0] = DUE_YOUNG_COLLECTIONS
    activity.enter()
    clock.t += 5
    assert not c.step()  # due, but a filter is being answered
    activity.leave()
    clock.t += 0.5
    assert not c.step()  # the filter ended only 0.5 s ago: the next may be on its way
    clock.t += 0.6
    assert c.step()
    assert done == [(pytest.approx(done[0][0]), False)]
    assert not c.step()  # collected: not due again


def test_overdue_collects_however_busy() -> None:
    clock, young, done = Clock(), [1], []
    c, activity = collector(clock, young, done)
    activity.enter()
    clock.t += 299
    assert not c.step()
    clock.t += 2
    assert c.step()  # cyclic garbage is not kept longer than max_gap_s
    assert done[-1][1] is True
    activity.leave()


def test_survivors_are_frozen_and_a_sweep_walks_them_again() -> None:
    clock, young, calls = Clock(), [DUE_YOUNG_COLLECTIONS], []

    def collect() -> int:
        calls.append("collect")
        young[0] = 0
        return 0

    c = IdleCollector(
        VerbActivity(clock), idle_s=1.0, max_gap_s=300.0, sweep_s=3600.0, clock=clock, collect=collect,
        young_count=lambda: young[0], freeze=lambda: calls.append("freeze"),
        unfreeze=lambda: calls.append("unfreeze"),
    )  # fmt: skip
    clock.t += 5
    assert c.step()
    assert calls == ["collect", "freeze"] and c.swept == 0
    calls.clear()
    young[0] = DUE_YOUNG_COLLECTIONS
    clock.t += 3600
    assert c.step()
    assert calls == ["unfreeze", "collect", "freeze"] and c.swept == 1
    calls.clear()
    young[0] = DUE_YOUNG_COLLECTIONS
    clock.t += 5
    assert c.step()
    assert calls == ["collect", "freeze"]  # the next sweep is an hour away again


def test_cyclic_garbage_that_was_frozen_is_freed_by_the_next_sweep() -> None:
    """With gc's own collect and freeze: a cycle that survived a full collection is frozen, so
    dropping it frees nothing until a sweep walks the frozen objects again."""

    class Node:
        other: object = None

    clock, activity = Clock(), VerbActivity(Clock())
    c = IdleCollector(activity, idle_s=0.0, max_gap_s=300.0, sweep_s=3600.0, clock=clock,
                      young_count=lambda: DUE_YOUNG_COLLECTIONS)  # fmt: skip
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        assert c.step()  # a and b are alive: they survive, frozen
        del a, b
        clock.t += 5
        assert c.step()
        assert ref() is not None  # frozen: this collection did not walk them
        clock.t += 3600
        assert c.step() and c.swept == 1
        assert ref() is None
    finally:
        gc.unfreeze()


def test_overlapping_verbs_are_busy_until_the_last_ends() -> None:
    clock = Clock()
    a = VerbActivity(clock)
    a.enter()
    a.enter()
    clock.t += 3
    a.leave()
    assert a.quiet_for() == 0.0
    a.leave()
    clock.t += 2
    assert a.quiet_for() == 2.0


def test_install_takes_full_collections_away_from_allocation() -> None:
    before = gc.get_threshold()
    c = IdleCollector(VerbActivity())
    try:
        c.install()
        assert gc.get_threshold() == (before[0], before[1], NEVER)
    finally:
        c.stop.set()
        gc.set_threshold(*before)


def test_filter_and_prioritize_mark_the_activity_bind_does_not() -> None:
    view = ClusterView()
    view.replace_nodes([node_obj("n1")])
    view.replace_pods([])
    view.synced.set()
    ext = Extender(view, get_policy(DEFAULT_POLICY), None, metrics=Metrics())
    seen: list[float] = []

    class Watching(VerbActivity):
        def enter(self) -> None:
            super().enter()
            seen.append(self.quiet_for())

    clock = Clock()
    activity = ext.activity = Watching(clock)
    app = create_extender_app(ext).test_client()
    pod = pod_obj("p", [container("c", mem=1024)])
    pod["metadata"]["uid"] = "uid-p"
    body = json.dumps({"Pod": pod, "NodeNames": ["n1"], "Nodes": None})
    for verb in ("filter", "prioritize"):
        clock.t += 10
        r = app.post(f"/{verb}", data=body, content_type="application/json")
        assert r.status_code == 200, r.data
    assert seen == [0.0, 0.0]  # busy while each ran
    clock.t += 10
    assert activity.quiet_for() == 10.0  # quiet since the last one ended
    # a bind (one that fails at once: the pod is not in the API server) is not waited for
    bad = json.dumps({"PodName": "x", "PodNamespace": "default", "PodUID": "u", "Node": "n1"})
    app.post("/bind", data=bad, content_type="application/json")
    assert seen == [0.0, 0.0]
    assert activity.quiet_for() == 10.0
    # a verb answered with an error leaves the activity quiet again
    r = app.post("/filter", data=b"{not json", content_type="application/json")
    assert r.status_code == 400
    assert len(seen) == 3
    clock.t += 1
    assert activity.quiet_for() == 1.0
    # each answered verb is timed twice: from its headers, and from its whole body in hand
    reg = ext.metrics.registry
    for verb, answered in (("filter", 1), ("prioritize", 1)):
        assert reg.get_sample_value("gpupack_extender_answer_seconds_count", {"verb": verb}) == answered
    assert reg.get_sample_value("gpupack_extender_request_seconds_count", {"verb": "filter"}) == 2
    # a body without Content-Length (chunked): marked and timed the same (the one verb path)
    r = app.post(
        "/filter", data=body, content_type="application/json",
        environ_overrides={"CONTENT_LENGTH": "", "wsgi.input_terminated": True},
    )  # fmt: skip
    assert r.status_code == 200, r.data
    assert seen[3:] == [0.0]
    assert reg.get_sample_value("gpupack_extender_answer_seconds_count", {"verb": "filter"}) == 2
    clock.t += 1
    assert activity.quiet_for() == 1.0


def test_wait_quiet_waits_for_the_verb_in_progress_and_no_longer() -> None:
    a = VerbActivity()
    a.enter()
    done = threading.Event()

    def bind_step() -> None:
        a.wait_quiet(max_s=10.0)
        done.set()

    t = threading.Thread(target=bind_step)
    t.start()
    assert not done.wait(0.2)  # stands aside while the verb runs
    a.leave()
    assert done.wait(2.0)  # and goes on as soon as it ends, long before max_s
    t.join()
    assert a.waited == 1
    a.wait_quiet(max_s=10.0)  # nothing running: no wait at all
    assert a.waited == 1


def test_wait_quiet_is_bounded_and_never_waits_for_its_own_verb() -> None:
    a = VerbActivity()
    a.enter()
    t0 = time.monotonic()
    a.wait_quiet(max_s=10.0)  # this thread answers the verb (filter cleaning a stale assignment)
    assert time.monotonic() - t0 < 1.0
    took: list[float] = []

    def other() -> None:
        t1 = time.monotonic()
        a.wait_quiet(max_s=0.3)
        took.append(time.monotonic() - t1)

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert 0.25 <= took[0] < 3.0  # a verb that hangs holds the others up for max_s only
    a.leave()


def test_binds_and_watch_events_stand_aside_while_a_verb_is_answered(cluster, ns, sfx, tmp_path) -> None:
    """Against the real API server: a bind while a filter is being answered waits for it (at most
    YIELD_MAX_S a step, so it still goes through), and one after it does not wait at all."""
    node, other = f"quiet-{sfx}", f"quiet2-{sfx}"
    gpu_node(cluster, node, n=2)
    gpu_node(cluster, other, n=2)  # the second bind's: no kubelet here ends the first one's handoff
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc"))))
    view = ClusterView(track_host=True)
    ext = Extender(view, get_policy(DEFAULT_POLICY), kube)
    sync = Sync(view, kube, watch_timeout_s=30, pause=ext.activity.wait_quiet)
    sync.start()
    try:
        assert sync.wait_ready(20)
        until(lambda: other in view.nodes, 10, "the nodes listed")

        def gpu_pod(name: str) -> dict:
            p = pod_obj(name, [container("c", gpu=1, mem=1000, sm=20)], namespace=ns)
            p["spec"]["schedulerName"] = "nobody"  # no scheduler here: the test binds it
            return create_pod(cluster.core, p, ns)

        first, second = gpu_pod("first"), gpu_pod("second")
        out: dict[str, object] = {}
        ext.activity.enter()  # a filter being answered, on this thread
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: out.update(r=ext.bind(parse_bind_args(bind_body(first, node)))))
        t.start()
        t.join(20)
        took = time.monotonic() - t0
        assert out["r"] == {"Error": ""}
        assert ext.activity.waited >= 1 and took >= YIELD_MAX_S
        ext.activity.leave()
        waited = ext.activity.waited
        assert ext.bind(parse_bind_args(bind_body(second, other))) == {"Error": ""}
        assert ext.activity.waited == waited  # nothing answered meanwhile: no wait
        until(lambda: not view.pods[f"{ns}/second"].assumed, 10, "the watch confirms the binds")
    finally:
        sync.close()
