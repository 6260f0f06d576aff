"""The extender keeps its last filter and prioritize answers per pod shape and updates only the
nodes changed since (the view's journal). These tests change the cluster between requests in every
way the view knows and check each answer against an extender that starts from nothing."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from ext_helpers import assume_on, container, node_obj, pod_obj

from extender.api.wire import parse_extender_args
from extender.state.view import ClusterView
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from gpupack.contract import GPUShare, Reservation
from gpupack.core.fgd import Workload, shape_of
from gpupack.core.gpupack_policy import GpupackPolicy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SHAPES = [(1, 20000, 30), (1, 40000, 50), (1, 70000, 90), (2, None, None), (1, None, None)]


def _pod(i: int, shape: tuple, owned: bool = False) -> dict:
    gpus, mem, sm = shape
    p = pod_obj(
        f"p{i}",
        [container("main", gpus, mem, sm)],
        namespace="prod",
        uid=f"uid-{i}",
        owner=("ReplicaSet", "web") if owned else None,
    )
    return p


def _reservation(node: str) -> Reservation:
    return Reservation(
        id="r1",
        namespace="prod",
        owner_kind="ReplicaSet",
        owner_name="web",
        pod_class="online",
        containers={"main": (GPUShare(f"GPU-{node}-3", 3, 30000, 40),)},
        expires=(NOW + timedelta(hours=1)).isoformat().replace("+00:00", "Z"),
    )


def _setup(n_nodes: int) -> tuple[ClusterView, GpupackPolicy, list[str]]:
    view = ClusterView()
    names = [f"n{i}" for i in range(n_nodes)]
    view.replace_nodes([node_obj(n, n=4) for n in names])
    view.synced.set()
    probe = Extender(view, GpupackPolicy(), None)
    workload = Workload()
    for j, s in enumerate(SHAPES):
        workload.add(shape_of(probe.pod_request(_pod(10_000 + j, s))))
    return view, GpupackPolicy(workload=workload), names


def _fresh(view: ClusterView, policy: GpupackPolicy) -> Extender:
    return Extender(view, policy, None, clock=lambda: NOW)


def _place(ext: Extender, view: ClusterView, pod: dict, node: str) -> bool:
    return assume_on(ext, pod, node, NOW)


@pytest.mark.slow
def test_answers_follow_every_kind_of_change():
    view, policy, names = _setup(10)
    ext = _fresh(view, policy)
    rng = random.Random(7)
    placed: list[str] = []
    checked = {"filter": 0, "prioritize": 0, "changed": 0}
    for step in range(400):
        owned = rng.random() < 0.2
        pod = _pod(step, rng.choice(SHAPES), owned)
        # kube-scheduler's own filters may leave a node or two out (their CPU is taken), or many
        r = rng.random()
        asked = (
            names
            if r < 0.5
            else rng.sample(names, len(names) - rng.choice([1, 2]))
            if r < 0.85
            else rng.sample(names, 6)
        )
        args = parse_extender_args({"Pod": pod, "NodeNames": asked})
        # the last pod was bound or dropped by now: no bind of it is still expected (BindLocks.coming;
        # the two filters below would otherwise wait on it, and answer apart as it expires)
        view.locks.expected.clear()
        out = ext.filter(args)
        view.locks.expected.clear()
        assert out == _fresh(view, policy).filter(args), f"filter differs at step {step}"
        checked["filter"] += 1
        if out["NodeNames"]:
            # sometimes the cluster changes between filter and prioritize
            if rng.random() < 0.3:
                small = _pod(50_000 + step, (1, 5000, 5))
                for other in rng.sample(out["NodeNames"], len(out["NodeNames"])):
                    if _place(ext, view, small, other):
                        placed.append(f"prod/p{50_000 + step}")
                        checked["changed"] += 1
                        break
            pargs = parse_extender_args({"Pod": pod, "NodeNames": out["NodeNames"]})
            got = ext.prioritize(pargs)
            assert got == _fresh(view, policy).prioritize(pargs), f"prioritize differs at step {step}"
            checked["prioritize"] += 1
            best = max(got, key=lambda s: (s["Score"], s["Host"]))["Host"]
            if _place(ext, view, pod, best):
                placed.append(f"prod/p{step}")
        r = rng.random()
        if r < 0.35 and placed:
            key = placed.pop(rng.randrange(len(placed)))
            view.delete_pod({"metadata": {"namespace": "prod", "name": key.split("/")[1]}})
        elif r < 0.4:
            n = rng.choice(names)
            view.apply_node({**node_obj(n, n=4), "spec": {"unschedulable": rng.random() < 0.5}})
        elif r < 0.43:
            n = rng.choice(names)
            view.delete_node(n)
            placed = [k for k in placed if k in view.pods]
            if rng.random() < 0.7:
                view.apply_node(node_obj(n, n=4 if rng.random() < 0.5 else 2))
        elif r < 0.46:
            n = rng.choice(names)
            view.apply_node(node_obj(n, n=4, reservations=[_reservation(n)] if rng.random() < 0.6 else None))
    assert checked["filter"] == 400 and checked["prioritize"] > 100 and checked["changed"] > 20


def test_a_node_filled_between_filter_and_prioritize_is_seen():
    view, policy, names = _setup(2)
    ext = _fresh(view, policy)
    big = (1, 70000, 90)
    pod = _pod(1, big)
    out = ext.filter(parse_extender_args({"Pod": pod, "NodeNames": names}))
    assert out["NodeNames"] == names
    before = {
        s["Host"]: s["Score"] for s in ext.prioritize(parse_extender_args({"Pod": pod, "NodeNames": names}))
    }
    assert before == {"n0": 10, "n1": 10}
    # n0 fills up after the answers were given: both answers must change
    for i in range(4):
        assert _place(ext, view, _pod(100 + i, big), "n0")
    scores = {
        s["Host"]: s["Score"] for s in ext.prioritize(parse_extender_args({"Pod": pod, "NodeNames": names}))
    }
    assert scores == {"n0": 0, "n1": 10}
    out = ext.filter(parse_extender_args({"Pod": _pod(2, big), "NodeNames": names}))
    assert out["NodeNames"] == ["n1"] and "n0" in out["FailedNodes"]


def test_a_journal_trimmed_past_an_answer_starts_over(monkeypatch):
    import extender.state.journal as journal_mod

    monkeypatch.setattr(journal_mod, "JOURNAL_MAX", 8)
    view, policy, names = _setup(3)
    ext = _fresh(view, policy)
    pod = _pod(1, (1, 70000, 90))
    args = parse_extender_args({"Pod": pod, "NodeNames": names})
    assert ext.filter(args)["NodeNames"] == names
    for i in range(4):
        assert _place(ext, view, _pod(100 + i, (1, 70000, 90)), "n2")
    for _ in range(20):
        view.apply_node({**node_obj("n0", n=4), "spec": {"unschedulable": True}})
        view.apply_node(node_obj("n0", n=4))
    assert view.journal.changed_since(0) is None
    assert ext.filter(args) == _fresh(view, policy).filter(args)
    assert ext.filter(args)["NodeNames"] == ["n0", "n1"]


def test_the_same_nodes_in_another_order_reuse_the_answer_and_follow_the_order():
    """kube-scheduler (percentageOfNodesToScore 100) sends the nodes that passed its own filters
    in a new order nearly every cycle: nothing is fitted again, and the answer is in the new order."""
    view, policy, names = _setup(12)
    ext = _fresh(view, policy)
    pod = _pod(1, SHAPES[0])
    first = ext.filter(parse_extender_args({"Pod": pod, "NodeNames": names}))
    ((shape, kept),) = ext.placements.answers.data.items()
    fits = 0
    real_fit = policy.fit

    def counting_fit(*a, **kw):
        nonlocal fits
        fits += 1
        return real_fit(*a, **kw)

    policy.fit = counting_fit  # type: ignore[method-assign]
    backwards = list(reversed(names))
    again = ext.filter(parse_extender_args({"Pod": _pod(2, SHAPES[0]), "NodeNames": backwards}))
    assert ext.placements.answers.data[shape] is kept  # updated in place (no node changed), not started over
    assert fits == 0
    assert again["NodeNames"] == [n for n in backwards if n in first["NodeNames"]]
    assert len(again["NodeNames"]) > 1


@pytest.mark.slow
def test_answers_follow_every_change_with_the_nodes_in_a_new_order_each_time():
    for keep_best in (0, 1):
        view, policy, names = _setup(10)
        ext = Extender(view, policy, None, clock=lambda: NOW, config=ExtenderConfig(keep_best=keep_best))
        rng = random.Random(11 + keep_best)
        placed: list[str] = []
        for step in range(300):
            pod = _pod(step, rng.choice(SHAPES), rng.random() < 0.2)
            asked = rng.sample(names, rng.choice([len(names)] * 6 + [len(names) - 1, len(names) - 2, 6]))
            args = parse_extender_args({"Pod": pod, "NodeNames": asked})
            view.locks.expected.clear()  # the last pod was bound or dropped (see the test above)
            out = ext.filter(args)
            view.locks.expected.clear()
            want = Extender(
                view, policy, None, clock=lambda: NOW, config=ExtenderConfig(keep_best=keep_best)
            ).filter(args)
            assert out == want, f"keep_best {keep_best}: filter differs at step {step}"
            if out["NodeNames"] and _place(ext, view, pod, out["NodeNames"][0]):
                placed.append(f"prod/p{step}")
            r = rng.random()
            if r < 0.35 and placed:
                key = placed.pop(rng.randrange(len(placed)))
                view.delete_pod({"metadata": {"namespace": "prod", "name": key.split("/")[1]}})
            elif r < 0.42:
                n = rng.choice(names)
                view.apply_node({**node_obj(n, n=4), "spec": {"unschedulable": rng.random() < 0.5}})
            elif r < 0.46:
                n = rng.choice(names)
                view.apply_node(
                    node_obj(n, n=4, reservations=[_reservation(n)] if rng.random() < 0.6 else None)
                )
