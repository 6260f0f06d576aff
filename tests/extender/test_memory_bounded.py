"""The extender's memory follows the live pods, nodes and pod shapes, not how many came and went:
every map kept per pod is emptied when the pod goes, per node when the node goes, and every map
kept per pod shape (whose fields a tenant writes) is capped. Each rule has a test here that fails
without it; `test_ten_thousand_pods_...` drives 10,000 pods with distinct shapes through the same
handlers the watches feed, and the real-cluster test below 1,500 through the real API server."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import realk8s
from ext_helpers import container, node_obj, pod_obj
from kubernetes import client
from realk8s import until

from extender.api.kube import Kube, api_client
from extender.api.wire import BindArgs, parse_extender_args
from extender.state.bind_locks import EXPECTED_SWEEP
from extender.state.journal import JOURNAL_MAX
from extender.state.placement_index import CACHE_SHAPES, STATE_IDS_MAX
from extender.state.records import init_names, pod_slots
from extender.state.sync import Sync
from extender.state.view import ClusterView
from extender.state.view_upkeep import view_sizes
from extender.verbs.bind_pods import PodMemory
from extender.verbs.binding import assignment_from_fit
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from extender.verbs.warming import QUEUE_MAX, TOLD_MAX, pending_watcher
from gpupack import handoff
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    RES_GPU,
    SLOTS_PER_GPU,
    Assignment,
    GPUShare,
)
from gpupack.core.gpupack_policy import GpupackPolicy
from gpupack.core.learning import OBSERVE_BATCH_MAX
from gpupack.core.workload import LEARNT_SHAPES_MAX, Shape, Workload

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


# Kept per pod shape, per node or per learning batch: capped rather than emptied. Structure -> its
# cap, in a cluster of `nodes` nodes.
def _caps(nodes: int) -> dict[str, int]:
    return {
        "view.journal": JOURNAL_MAX,
        "fitter.shapes": CACHE_SHAPES,
        "fitter.fits": CACHE_SHAPES * nodes,
        "fitter.node_states": nodes,
        "fitter.state_ids": STATE_IDS_MAX,
        "scorer.keys": CACHE_SHAPES,
        "scorer.scores": CACHE_SHAPES * nodes,
        "scorer.priorities": CACHE_SHAPES,
        "scorer.best_index": CACHE_SHAPES,
        "scorer.served": 4 * CACHE_SHAPES + 64,
        "policy.tie_key": nodes,
        "filter.answers": CACHE_SHAPES,
        "learner.shapes": LEARNT_SHAPES_MAX,
        "learner.waiting": OBSERVE_BATCH_MAX,
        "warmer.urgent": QUEUE_MAX,
        "warmer.queue": QUEUE_MAX,
        "warmer.pending": QUEUE_MAX,
        "warmer.seen": CACHE_SHAPES,
    }


def _nodes(n: int) -> list[dict[str, Any]]:
    return [node_obj(f"n{i}") for i in range(n)]


def _extender(nodes: int = 8, keep_best: int = 1) -> Extender:
    view = ClusterView(track_host=True)
    view.replace_nodes(_nodes(nodes))
    view.synced.set()
    return Extender(view, GpupackPolicy(), None, ExtenderConfig(keep_best=keep_best), clock=lambda: NOW)


def _gpu_pod(i: int, mem: int | None = None, ns: str = "tenant") -> dict[str, Any]:
    """A pending pod as kube-scheduler sends it: its own GPU memory request, so its own shape."""
    p = pod_obj(f"p{i}", [container("main", 1, mem if mem is not None else 1000 + i)], namespace=ns,
                uid=f"uid-{i}")  # fmt: skip
    p["metadata"]["resourceVersion"] = str(10 + i)
    return p


def _cpu_pod(i: int, node: str = "", ns: str = "tenant", milli: int = 0) -> dict[str, Any]:
    cpu = f"{milli or 100 + i}m"
    c = {"name": "main", "image": "registry.invalid/x:1", "resources": {"requests": {"cpu": cpu}}}
    p = pod_obj(f"c{i}", [c], namespace=ns, uid=f"uid-c{i}")
    p["metadata"]["resourceVersion"] = str(10 + i)
    if node:
        p["spec"]["nodeName"] = node
    return p


def _filter(ext: Extender, pod: dict[str, Any], names: list[str]) -> list[str]:
    out: list[str] = ext.filter(parse_extender_args({"Pod": pod, "NodeNames": names}))["NodeNames"]
    return out


def _bind(ext: Extender, pod: dict[str, Any], node: str) -> dict[str, Any]:
    """What Binder does for a GPU pod, without the API server: the claim, the pod its filter sent,
    the fit and assumed assignment, bound; then the pod as the assigned-pod watch shows it."""
    m = pod["metadata"]
    key, uid = f"{m['namespace']}/{m['name']}", m["uid"]
    args = BindArgs(m["name"], m["namespace"], uid, node)
    view = ext.view
    with view.lock:
        view.locks.claim(node, key, uid)
    remembered, req = ext.binder.pods.recall(args)
    assert remembered is not None and req is not None
    with view.lock:
        f, _ = ext.placements.node_fit(node, req, NOW, None)
        assert f, f
        a = assignment_from_fit(view.state.nodes[node], req, f, NOW, "", view.nodes[node].gpu_indexes)  # type: ignore[arg-type]
        view.assume(key, uid, a, init_names(pod), pod_slots(pod), req.host)
        view.locks.settle_claim(key)
        view.mark_bound(key, node)
        view.locks.unclaim(node, key)
    echo = copy.deepcopy(pod)
    echo["metadata"]["annotations"] = handoff.binding_annotations(a)
    echo["metadata"]["annotations"][ANN_HANDOFF] = HANDOFF_DONE  # the device plugin's Allocate came
    echo["spec"]["nodeName"] = node
    echo["status"] = {"phase": "Running"}
    return echo


def _grew(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The structures not back at their size before (those capped: above their cap)."""
    caps = _caps(after["view.nodes"])
    out = {}
    for k, v in after.items():
        if k in caps:
            if v > caps[k]:
                out[k] = (before.get(k, 0), v)
        elif v != before.get(k, 0):
            out[k] = (before.get(k, 0), v)
    return out


def test_ten_thousand_pods_with_distinct_shapes_leave_nothing_behind() -> None:
    """10,000 pods, each of its own shape (GPU memory 1,001..10,000 MiB), through what the watches
    and verbs feed: the pending-pod watch sees each, kube-scheduler filters and prioritizes it;
    one in four is bound (its assignment charged, the assigned-pod watch showing it) and then
    deleted, the others are deleted while pending; one in ten is a CPU-only pod bound and deleted,
    one in fifty carries an unreadable assignment. Every per-pod structure is back at its size
    before, every per-shape one within its cap."""
    ext = _extender()
    view = ext.view
    names = list(view.nodes)
    pending = pending_watcher(None, "gpupack-scheduler", ext.warmer, threading.Event())  # type: ignore[arg-type]
    ext.warmer.attach()
    before = ext.tracked_sizes()
    t0 = time.perf_counter()
    bound = 0
    for i in range(10_000):
        pod = _gpu_pod(i)
        pending.apply(pod)  # waiting for kube-scheduler: learnt, its shape queued for warming
        kept = _filter(ext, pod, names)
        assert kept, f"pod {i} fits nowhere"
        if i % 3 == 0:
            ext.prioritize(parse_extender_args({"Pod": pod, "NodeNames": names}))
        if i % 4 == 0:
            echo = _bind(ext, pod, kept[0])
            bound += 1
            pending.delete(pod)  # it left the unbound selection
            view.apply_assigned(echo)
            assert view.pods[f"tenant/p{i}"].assignment_raw == echo["metadata"]["annotations"][ANN_ASSIGNMENT]
            view.delete_assigned(echo)
        else:
            pending.delete(pod)  # deleted while waiting
        if i % 10 == 0:
            cpu = _cpu_pod(i)
            view.host.assume(f"tenant/c{i}", f"uid-c{i}", names[i % len(names)], ext.pod_request(cpu).host)
            view.host.bound(f"tenant/c{i}", f"uid-c{i}")
            shown = _cpu_pod(i, names[i % len(names)])
            view.apply_assigned(shown)
            view.delete_assigned(shown)
        if i % 50 == 0:
            bad = _cpu_pod(i, names[0])
            bad["metadata"]["name"] = f"bad{i}"
            bad["metadata"]["annotations"] = {ANN_ASSIGNMENT: "{not json"}
            view.apply_assigned(bad)
            assert f"pod/tenant/bad{i}" in view.problems
            view.delete_assigned(bad)
    took = time.perf_counter() - t0
    after = ext.tracked_sizes()
    print(f"\n10,000 pods in {took:.1f} s ({bound} bound); tracked before {before}\nafter {after}")
    assert _grew(before, after) == {}
    assert after["learner.shapes"] <= LEARNT_SHAPES_MAX
    assert after["learner.shapes"] > 0 and ext.policy.workload.forgotten > 0  # type: ignore[attr-defined]
    assert view.journal.seq > 2 * bound and len(view.journal.entries) <= JOURNAL_MAX
    # every GPU is free again
    assert all(g.mem_used == 0 and not g.holders for n in view.state.nodes.values() for g in n.gpus)
    assert all(n.requested == view.nodes["n1"].requested for n in view.nodes.values())


# --- each rule, on its own -----------------------------------------------------------------------


def test_a_deleted_pods_problem_goes_with_it_even_if_it_was_never_charged() -> None:
    view = ClusterView()
    view.replace_nodes(_nodes(1))
    bad = _cpu_pod(1, "n0")
    bad["metadata"]["annotations"] = {ANN_ASSIGNMENT: "{not json"}
    view.apply_assigned(bad)
    assert "pod/tenant/c1" in view.problems and "tenant/c1" not in view.pods
    view.delete_assigned(bad)
    assert "pod/tenant/c1" not in view.problems
    # one that ended (Succeeded) too
    view.apply_assigned(bad)
    view.apply_assigned({**bad, "status": {"phase": "Succeeded"}})
    assert view.problems == {}
    # and one deleted while the watch was away: the relist that does not show it drops it
    view.apply_assigned(bad)
    view.replace_assigned_pages([[]])
    assert view.problems == {}


def test_a_node_with_no_pods_left_keeps_no_entry_in_the_per_node_maps() -> None:
    ext = _extender(nodes=2)
    view = ext.view
    pod = _gpu_pod(1)
    _filter(ext, pod, ["n0", "n1"])
    echo = _bind(ext, pod, "n0")
    assert view.slot_use == {"n0": {"tenant/p1": 1}}
    view.apply_assigned(echo)
    view.delete_assigned(echo)
    assert view.slot_use == {} and view.consumed == {}


def test_a_deleted_node_leaves_nothing_in_the_caches_or_the_problems() -> None:
    ext = _extender(nodes=3, keep_best=0)
    view = ext.view
    names = list(view.nodes)
    for i in range(3):
        pod = _gpu_pod(i)
        _filter(ext, pod, names)
        ext.prioritize(parse_extender_args({"Pod": pod, "NodeNames": names}))
    broken = node_obj("n2", raw_inventory="{not json")
    view.apply_node(broken)
    assert "node/n2/inventory" in view.problems
    with view.lock:
        assert any("n2" in t for t in ext.placements.fits.data.values())
        assert any("n2" in t for t in ext.scorer.scores.data.values())
    view.delete_node("n2")
    with view.lock:
        assert not any("n2" in t for t in ext.placements.fits.data.values())
        assert not any("n2" in t for t in ext.scorer.scores.data.values())
        assert "n2" not in ext.placements._states
    assert not any(k.startswith("node/n2/") for k in view.problems)


def test_expected_binds_go_with_their_pod_and_expire_without_a_filter_to_sweep_them() -> None:
    ext = _extender(nodes=2)
    locks = ext.view.locks
    # kube-scheduler is expected to bind pod 1 to n0; the pod is deleted before its bind comes
    locks.expect("uid-1", "tenant/p1", ("n0",), time.monotonic() + 60)
    pending = pending_watcher(None, "gpupack-scheduler", ext.warmer, threading.Event())  # type: ignore[arg-type]
    pending.delete(_gpu_pod(1))
    assert locks.expected == {}
    # expectations that expired, with no filter coming to pass over them: swept as the map grows
    for i in range(10 * EXPECTED_SWEEP):
        locks.expect(f"uid-{i}", f"tenant/p{i}", ("n0",), time.monotonic() - 1)
    assert len(locks.expected) <= EXPECTED_SWEEP + 1


def test_a_filtered_pod_is_dropped_when_it_goes_and_the_kept_pods_are_bounded_in_bytes() -> None:
    ext = _extender(nodes=1)
    pending = pending_watcher(None, "gpupack-scheduler", ext.warmer, threading.Event())  # type: ignore[arg-type]
    pod = _gpu_pod(1)
    pending.apply(pod)
    _filter(ext, pod, ["n0"])
    assert len(ext.binder.pods) == 1 and "uid-1" in ext.warmer.told
    pending.delete(pod)  # deleted before kube-scheduler bound it
    assert len(ext.binder.pods) == 0 and ext.binder.pods.bytes == 0 and not ext.warmer.told

    memory = PodMemory(size=100, max_bytes=40_000)
    big = [_gpu_pod(i) for i in range(10)]
    for p in big:
        p["metadata"]["annotations"] = {"tenant.example/blob": "x" * 9_000}  # ~9.6 KB as JSON
        memory.remember(p)
    assert memory.bytes <= 40_000 and len(memory) == 4  # the newest four
    assert memory.recall(BindArgs("p9", "tenant", "uid-9", "n0"))[0] is not None
    huge = _gpu_pod(99)
    huge["metadata"]["annotations"] = {"tenant.example/blob": "x" * 20_000}  # over a quarter of it
    memory.remember(huge)
    assert memory.recall(BindArgs("p99", "tenant", "uid-99", "n0")) == (None, None)
    assert len(memory) == 3


def test_the_pending_watchs_uids_follow_a_relist() -> None:
    ext = _extender(nodes=1)
    pending = pending_watcher(None, "gpupack-scheduler", ext.warmer, threading.Event())  # type: ignore[arg-type]
    for i in range(5):
        pending.apply(_gpu_pod(i, mem=1000))
    assert len(ext.warmer.told) == 5
    # the watch was away while four were bound or deleted: the relist shows one
    pending.replace(iter([[_gpu_pod(3, mem=1000)]]))
    assert list(ext.warmer.told) == ["uid-3"]
    assert TOLD_MAX >= 1


def test_a_learnt_mix_keeps_its_popular_shapes_however_many_one_off_shapes_come() -> None:
    wl = Workload(max_shapes=64)
    popular = [Shape(1000, 1, 500, 20000), Shape(2000, 1, 1000), Shape(4000, 2, 1000)]
    for _ in range(50):
        for s in popular:
            wl.add(s)
    for i in range(5_000):  # a tenant's pods, each asking for another GPU memory size
        wl.add(Shape(1000, 1, 300, 1 + i))
        assert len(wl.counts) <= 64
    assert all(wl.counts[s] == 50 for s in popular)
    assert set(popular) <= set(wl.typical()[0])
    assert wl.forgotten > 4_900
    # a policy that learns gets the bound; one given its workload keeps it whole
    assert GpupackPolicy().workload.max_shapes == LEARNT_SHAPES_MAX
    assert GpupackPolicy(workload=Workload()).workload.max_shapes is None


def test_the_sizes_are_exported_as_a_gauge() -> None:
    from extender.state.gpu_gauges import render

    ext = _extender(nodes=1)
    text = render(ext.metrics.registry).decode()
    assert 'gpupack_extender_tracked_entries{structure="view.pods"} 0.0' in text
    assert 'gpupack_extender_tracked_entries{structure="view.nodes"} 1.0' in text
    # a second Extender on the same metrics does not register a second collector
    Extender(ext.view, GpupackPolicy(), None, metrics=ext.metrics)
    assert render(ext.metrics.registry).decode().count('structure="view.nodes"') == 1


# --- the real API server ------------------------------------------------------------------------

# 1,500 in CI (~15-25 s on 2 cores); GPUPACK_MEMORY_TEST_PODS=10000 by hand
REAL_PODS = int(os.environ.get("GPUPACK_MEMORY_TEST_PODS", "1500"))
# GPU pods bound per node: each takes 1% of a GPU's SMs, so at most 100 a GPU
BOUND_PER_NODE = 400
WAIT_S = 60 + REAL_PODS / 50


def _in_threads(fn: Any, items: list[Any], threads: int = 8) -> None:
    errors: list[BaseException] = []

    def work(part: list[Any]) -> None:
        try:
            for x in part:
                fn(x)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    ts = [threading.Thread(target=work, args=(items[k::threads],)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]


def _list(core: client.CoreV1Api, ns: str) -> list[dict[str, Any]]:
    return list(orjson.loads(core.list_namespaced_pod(ns, _preload_content=False).data)["items"])


def _body(p: dict[str, Any]) -> dict[str, Any]:
    """The pod as a client creates it: no uid, resourceVersion or namespace in the body."""
    meta = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion", "namespace")}
    return {**p, "metadata": meta}


def test_pods_created_and_deleted_through_the_api_server_leave_the_tracked_state_as_it_was(
    cluster: realk8s.ControlPlane, ns: str, sfx: str, tmp_path: Path
) -> None:
    """1,500 pods through the real API server, watched by the extender's own Sync (nodes, assigned
    pods, namespaces) and pending-pod watch: 500 pending GPU pods each of its own shape (learnt,
    some filtered), 500 GPU pods bound with an assignment by a Binding (charged from the watch),
    500 CPU-only pods on the node; then all deleted. Every tracked structure is back at its size
    before, or within its cap."""
    core = cluster.core
    third = REAL_PODS // 3
    nodes = [f"mem{k}-{sfx}" for k in range(third // BOUND_PER_NODE + 1)]
    node = nodes[0]
    for n in nodes:
        cluster.make_node(n, extended={RES_GPU: str(SLOTS_PER_GPU * 8)}, pods=str(REAL_PODS), cpu="1000",
                          annotations=node_obj(n)["metadata"]["annotations"])  # fmt: skip
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc"))))
    view = ClusterView(track_host=True)
    ext = Extender(view, GpupackPolicy(), kube, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    sync = Sync(view, kube, watch_timeout_s=60)
    pending = pending_watcher(kube, "gpupack-scheduler", ext.warmer, sync.stop)
    ext.warmer.attach()
    sync.start()
    threading.Thread(target=pending.run, name="watch-pending-pods", daemon=True).start()
    try:
        assert sync.wait_ready(30)
        until(
            lambda: pending.listed.is_set() and set(nodes) <= set(view.nodes),
            30,
            "the nodes, pending pods listed",
        )
        before = ext.tracked_sizes()
        shaped = [_body(_gpu_pod(i, ns=ns)) for i in range(third)]
        to_bind = [_body(_gpu_pod(i, mem=100, ns=ns)) for i in range(third, 2 * third)]
        cpu = [_body(_cpu_pod(i, node, ns=ns, milli=10)) for i in range(2 * third, REAL_PODS)]
        t0 = time.perf_counter()
        _in_threads(
            lambda b: core.create_namespaced_pod(ns, b, _preload_content=False), shaped + to_bind + cpu
        )
        created = time.perf_counter() - t0
        until(lambda: len(ext.warmer.told) >= 2 * third, WAIT_S, "the pending pods watched")
        listed = {o["metadata"]["name"]: o for o in _list(core, ns)}
        for k, b in enumerate(shaped[:200]):  # kube-scheduler asks about some of them
            o = listed[b["metadata"]["name"]]
            assert _filter(ext, o, nodes)
            if k < 196:  # its bind is not coming (the next filter would wait for it); 4 are left
                ext.view.locks.expect(o["metadata"]["uid"], "", (), 0.0)
        assert len(ext.binder.pods) == 200

        def bind(b: dict[str, Any]) -> None:
            # what the extender's bind posts: one Binding carrying the assignment (handoff done, as
            # the device plugin would have it: no kubelet runs here)
            o = listed[b["metadata"]["name"]]
            k = int(b["metadata"]["name"][1:])
            on, gpu = nodes[k % len(nodes)], k // len(nodes) % 8
            share = GPUShare(f"GPU-{on}-{gpu}", gpu, 100, 1)
            a = Assignment(o["metadata"]["uid"], on, "online", {"main": (share,)})
            ann = {**handoff.binding_annotations(a), ANN_HANDOFF: HANDOFF_DONE}
            kube.bind(ns, o["metadata"]["name"], o["metadata"]["uid"], on, ann)

        _in_threads(bind, to_bind)
        until(lambda: len(view.pods) == third, WAIT_S, "the bound GPU pods charged from the watch")
        until(lambda: view_sizes(view)["host.pods"] >= 2 * third, WAIT_S, "every bound pod watched")
        during = ext.tracked_sizes()
        assert during["view.problems"] == before["view.problems"]  # every assignment charged cleanly
        t1 = time.perf_counter()
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        until(lambda: not _list(core, ns), 2 * WAIT_S, "the pods deleted")
        with contextlib.suppress(AssertionError):  # the assert below says what is left
            until(lambda: _grew(before, ext.tracked_sizes()) == {}, WAIT_S, "the tracked state back")
        assert _grew(before, ext.tracked_sizes()) == {}
        deleted = time.perf_counter() - t1
        print(f"\n{REAL_PODS} pods created in {created:.1f} s, deleted and seen gone in {deleted:.1f} s"
              f"\nbefore {before}\nwith them {during}\nafter {ext.tracked_sizes()}")  # fmt: skip
        assert during["view.pods"] == third and during["warmer.told"] >= third
        assert all(g.mem_used == 0 for n in nodes for g in view.state.nodes[n].gpus)
    finally:
        sync.close()
