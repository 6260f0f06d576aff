"""A new pod shape's filter from the nodes fitted within a budget (extender/verbs/sampling.py): its answer
is what a filter asked about those nodes only would answer (the policy's best of them, their
reasons), never a node the pod does not fit; the nodes are looked at in the policy's tie order, so
in a cluster of equal nodes it is the full answer; each sampled filter fits more nodes, and once
every node is fitted (by the filters or the shape warmer) the shape's whole answer serves, as an
extender without a budget answers; a pod steered by its defrag reservation, a shape that fits few
nodes or none, and a budget of 0 get the whole answer."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from ext_helpers import assume_on, container, node_obj, pod_obj, workload_policy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.api.wire import parse_extender_args
from extender.main import ConfigError, build_parser, extender_config, main
from extender.state.view import ClusterView
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from extender.verbs.sampling import CHUNK, Sample
from gpupack.contract import GPUShare, Reservation
from gpupack.core.gpupack_policy import GpupackPolicy

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SHAPES = [(1, 20000, 30), (1, 40000, 50), (1, 70000, 90), (2, None, None), (1, None, None)]
MIN_NODES = 20


def _pod(i: int, shape: tuple, cls: str = "online", **kw: Any) -> dict:
    gpus, mem, sm = shape
    p = pod_obj(f"p{i}", [container("main", gpus, mem, sm)], namespace="prod", uid=f"uid-{i}", **kw)
    p["metadata"].setdefault("labels", {})["gpupack.io/class"] = cls
    return p


def _policy(view: ClusterView) -> GpupackPolicy:
    """A policy given its workload: it learns nothing, so two extenders score alike."""
    return workload_policy(view, [_pod(10_000 + j, s) for j, s in enumerate(SHAPES)])  # type: ignore[no-any-return]


def _place(ext: Extender, pod: dict, node: str) -> bool:
    ok = assume_on(ext, pod, node, NOW)
    if ok:
        m = pod["metadata"]
        ext.view.locks.expect(m["uid"], f"{m['namespace']}/{m['name']}", (), 0.0)
    return ok


def _filter(ext: Extender, pod: dict, names: list[str]) -> dict[str, Any]:
    out = ext.filter(parse_extender_args({"Pod": pod, "NodeNames": names, "Nodes": None}))
    m = pod["metadata"]  # no bind follows
    ext.view.locks.expect(m["uid"], f"{m['namespace']}/{m['name']}", (), 0.0)
    return out


class Sampled:
    """An extender with a budget that every clock reading spends (so a sample stops as soon as it
    may: `MIN_NODES` looked at, one passing, one chunk fitted), and the samples it answered from."""

    def __init__(
        self, view: ClusterView, policy: GpupackPolicy, keep_best: int, budget_s: float = 0.5
    ) -> None:
        self.ext = Extender(
            view,
            policy,
            None,
            ExtenderConfig(keep_best=keep_best, new_shape_budget_s=budget_s),
            clock=lambda: NOW,
        )
        sampler = self.ext.filtering.sampler
        assert sampler is not None
        sampler.min_nodes = MIN_NODES
        ticks = itertools.count()
        sampler.clock = lambda: float(next(ticks))
        self.samples: list[Sample | None] = []
        sample = sampler.sample

        def recorded(*a: Any) -> Sample | None:
            s = sample(*a)
            self.samples.append(s)
            return s

        sampler.sample = recorded  # type: ignore[method-assign]


def _cluster(seed: int, n_nodes: int = 60, n_pods: int = 90) -> tuple[ClusterView, list[str], GpupackPolicy]:
    """Nodes of 4 GPUs in many states: `n_pods` pods of every shape bound at random."""
    rng = random.Random(seed)
    view = ClusterView()
    names = [f"n{i:03d}" for i in range(n_nodes)]
    view.replace_nodes([node_obj(n, n=4) for n in names])
    view.synced.set()
    policy = _policy(view)
    filler = Extender(view, policy, None, clock=lambda: NOW)
    for i in range(n_pods):
        _place(filler, _pod(i, rng.choice(SHAPES), rng.choice(["online", "offline"])), rng.choice(names))
    return view, names, policy


def _looked(s: Sample) -> list[str]:
    return sorted({*s.ok, *s.failed, *s.unresolvable})


@pytest.mark.parametrize("keep_best", [1, 0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sampled_answer_is_a_filter_of_the_nodes_looked_at(keep_best: int, seed: int) -> None:
    view, names, policy = _cluster(seed)
    s = Sampled(view, policy, keep_best)
    for i, shape in enumerate(SHAPES):
        pod = _pod(500 + i, shape, "online" if i % 2 else "offline")
        got = _filter(s.ext, pod, names)
        sample = s.samples[-1]
        assert sample is not None, "answered whole"
        looked = _looked(sample)
        assert MIN_NODES <= len(looked) < len(names) and sample.ok
        cold = Extender(view, policy, None, ExtenderConfig(keep_best=keep_best), clock=lambda: NOW)
        want = _filter(cold, pod, [n for n in names if n in set(looked)])
        assert got["NodeNames"] == want["NodeNames"]
        assert got["FailedNodes"] == want["FailedNodes"]  # the others: no reason, as not-best ones
        assert got.get("FailedAndUnresolvableNodes") == want.get("FailedAndUnresolvableNodes")
        assert s.ext.metrics.rejections.labels("not-sampled")._value.get() > 0


def test_the_sample_looks_at_nodes_in_the_policys_tie_order_so_equal_nodes_answer_as_the_whole() -> None:
    view, names, policy = _cluster(0, n_nodes=80, n_pods=0)
    s = Sampled(view, policy, keep_best=1)
    cold = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    for i, shape in enumerate(SHAPES):
        pod = _pod(700 + i, shape)
        got = _filter(s.ext, pod, names)
        assert s.samples[-1] is not None and len(_looked(s.samples[-1])) < len(names)
        assert got["NodeNames"] == _filter(cold, pod, names)["NodeNames"]
        assert _place(s.ext, pod, got["NodeNames"][0])  # the next shapes see it placed


def test_each_sampled_filter_fits_more_nodes_until_the_whole_answer_serves() -> None:
    view, names, policy = _cluster(7)
    s = Sampled(view, policy, keep_best=1)
    fits = 0
    count = policy.fit

    def counted(*a: Any, **k: Any) -> Any:
        nonlocal fits
        fits += 1
        return count(*a, **k)

    policy.fit = counted  # type: ignore[method-assign]
    looked: list[int] = []
    for i in itertools.count():
        pod = _pod(900 + i, SHAPES[0])
        got = _filter(s.ext, pod, names)
        if s.samples[-1] is None:
            break
        looked.append(len(_looked(s.samples[-1])))
        assert i < len(names), "never whole"
    assert looked == sorted(looked) and len(set(looked)) == len(looked), looked
    assert all(b - a >= CHUNK for a, b in itertools.pairwise(looked))
    fitted = fits
    cold = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    assert got["NodeNames"] == _filter(cold, pod, names)["NodeNames"]
    # the whole answer was built from what the samples fitted: no node fitted twice
    assert fitted <= len(names)
    _filter(s.ext, _pod(999, SHAPES[0]), names)
    assert s.samples[-1] is None


@pytest.mark.parametrize("keep_best", [1, 0])
def test_the_shape_warmer_finishes_a_sampled_shape_and_the_whole_answer_serves(keep_best: int) -> None:
    view, names, policy = _cluster(11)
    s = Sampled(view, policy, keep_best)
    s.ext.warmer.attach()
    pod = _pod(1000, SHAPES[1])
    _filter(s.ext, pod, names)
    assert s.samples[-1] is not None
    assert s.ext.warmer.drain() == 1  # asked to finish it
    again = _pod(1001, SHAPES[1])
    got = _filter(s.ext, again, names)
    assert s.ext.filtering.cost.sampled is None
    cold = Extender(view, policy, None, ExtenderConfig(keep_best=keep_best), clock=lambda: NOW)
    want = _filter(cold, again, names)
    assert got["NodeNames"] == want["NodeNames"] and got["FailedNodes"] == want["FailedNodes"]


def test_a_shape_that_fits_only_the_last_node_in_tie_order_is_looked_for_until_it_is_found() -> None:
    view, names, policy = _cluster(0, n_pods=0)
    s = Sampled(view, policy, keep_best=1)
    s.ext.scorer.ranked_ties()
    last = max(names, key=lambda n: policy.tie_key[n])
    for i, n in enumerate(names):
        if n != last:
            assert _place(s.ext, _pod(i, (1, None, None)), n)
    whole = _pod(2000, (4, None, None))  # only an idle node fits it
    got = _filter(s.ext, whole, names)
    assert got["NodeNames"] == [last]
    assert s.samples[-1] is None  # every node looked at: the whole answer, every reason
    assert set(got["FailedNodes"]) == set(names) - {last}


def test_a_shape_that_fits_nowhere_gets_every_nodes_reason() -> None:
    view, names, policy = _cluster(5)
    s = Sampled(view, policy, keep_best=1)
    pod = _pod(3000, (8, None, None))  # 8 GPUs on nodes of 4
    got = _filter(s.ext, pod, names)
    cold = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    want = _filter(cold, pod, names)
    assert got["NodeNames"] == [] and got["FailedNodes"] == want["FailedNodes"]
    assert set(got["FailedNodes"]) | set(got.get("FailedAndUnresolvableNodes") or {}) == set(names)


def _resv(node: str, rid: str = "r1", minutes: int = 5) -> Reservation:
    """A defrag reservation of 60,000 MiB on `node`'s GPU 0 for ReplicaSet prod/web's pods."""
    return Reservation(
        id=rid, namespace="prod", owner_kind="ReplicaSet", owner_name="web", pod_class="online",
        containers={"main": (GPUShare(f"GPU-{node}-0", 0, 60000, 50),)},
        expires=(NOW + timedelta(minutes=minutes)).isoformat().replace("+00:00", "Z"),
    )  # fmt: skip


def test_a_pod_steered_by_its_defrag_reservation_gets_the_whole_answer() -> None:
    names = [f"n{i:03d}" for i in range(40)]
    target = names[-1]
    view = ClusterView()
    view.replace_nodes([node_obj(n, n=4, reservations=[_resv(n)] if n == target else None) for n in names])
    view.synced.set()
    s = Sampled(view, _policy(view), keep_best=1)
    owner = _pod(4000, (1, 60000, 50), owner=("ReplicaSet", "web"))
    got = _filter(s.ext, owner, names)
    assert got["NodeNames"] == [target]
    assert s.samples[-1] is None
    assert "steered to node" in got["FailedNodes"][names[0]]
    # another pod's sample looks at the reserved node first: held for the owner, it does not fit
    other = _pod(4001, (4, None, None))
    got = _filter(s.ext, other, names)
    sample = s.samples[-1]
    assert sample is not None and target in sample.failed and target not in got["NodeNames"]


def test_every_node_holding_reservations_is_looked_at_before_a_sample_may_stop() -> None:
    # 40 nodes hold an expired reservation (it steers nobody, but its node is fitted every time)
    view, names, policy = _cluster(9, n_nodes=120, n_pods=0)
    for n in names[:40]:
        view.apply_node(node_obj(n, n=4, reservations=[_resv(n, minutes=-1)]))
    s = Sampled(view, policy, keep_best=1)
    owner_shape = (1, 60000, 50)
    _filter(s.ext, _pod(8000, owner_shape), names)  # a sibling's sample: the caches hold enough to stop
    assert s.samples[-1] is not None
    sampler = s.ext.filtering.sampler
    assert sampler is not None
    with view.lock:
        last = sampler.order(names)[39]  # the reserved node the owner's sample reaches last
    assert last in view.reserved
    view.apply_node(node_obj(last, n=4, reservations=[_resv(last, minutes=-1), _resv(last, "r2")]))
    with view.lock:
        assert sampler.order(names).index(last) >= CHUNK, "the steering node is beyond the first chunk"
    owner = _pod(8001, owner_shape, owner=("ReplicaSet", "web"))
    got = _filter(s.ext, owner, names)
    assert got["NodeNames"] == [last]
    assert s.samples[-1] is None  # steered: the whole answer


def test_a_sample_whose_passing_nodes_are_all_taking_other_pods_looks_further() -> None:
    view, names, policy = _cluster(0, n_pods=0)
    s = Sampled(view, policy, keep_best=1)
    with view.lock:
        order = s.ext.scorer.tie_order()
    first, last = order[0], order[-1]
    for i, n in enumerate(order[1:-1]):
        assert _place(s.ext, _pod(i, (1, None, None)), n)
    s.ext.view.locks.expect("uid-x", "prod/x", (first,), 1e12)  # a bind is on its way to `first`
    got = _filter(s.ext, _pod(9000, (4, None, None)), names)  # only an idle node fits it
    assert got["NodeNames"] == [last]
    assert "being bound there" in got["FailedNodes"][first]


def test_a_node_taking_another_pod_is_left_out_of_a_sampled_answer_with_the_reason() -> None:
    view, names, policy = _cluster(3)
    s = Sampled(view, policy, keep_best=1)
    pod = _pod(5000, SHAPES[0])
    first = _filter(s.ext, pod, names)["NodeNames"][0]
    s.ext.view.locks.expect("uid-5001", "prod/p5001", (first,), 1e12)  # its bind is on its way there
    got = _filter(s.ext, _pod(5002, SHAPES[0]), names)
    assert s.samples[-1] is not None
    assert got["NodeNames"] and got["NodeNames"][0] != first
    assert "being bound there" in got["FailedNodes"][first]


def test_a_budget_of_zero_or_a_small_request_answers_whole() -> None:
    view, names, policy = _cluster(4)
    off = Extender(view, policy, None, ExtenderConfig(keep_best=1), clock=lambda: NOW)
    assert off.filtering.sampler is None
    s = Sampled(view, policy, keep_best=1)
    _filter(s.ext, _pod(6000, SHAPES[0]), names[:MIN_NODES])
    assert s.samples[-1] is None


def test_the_flag_sets_the_budget_and_refuses_a_negative_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="new-shape-budget-ms"):
        extender_config(build_parser().parse_args(["--new-shape-budget-ms", "-1"]))
    assert extender_config(build_parser().parse_args([])).new_shape_budget_s == 0
    cfg = extender_config(
        build_parser().parse_args(["--new-shape-budget-ms", "20", "--filter-keep-best", "1"])
    )
    assert cfg.new_shape_budget_s == 0.02 and cfg.keep_best == 1
    # refused at start, before any worker runs: one line and status 2
    assert main(["--new-shape-budget-ms", "-5", "--webhook-port", "0"]) == 2
    assert "--new-shape-budget-ms must be 0 (off) or more, got -5" in capsys.readouterr().err


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    keep_best=st.sampled_from([0, 1, 2]),
    shape=st.sampled_from(SHAPES),
    cls=st.sampled_from(["online", "offline"]),
)
def test_a_sampled_answer_never_passes_a_node_the_pod_does_not_fit(
    seed: int, keep_best: int, shape: tuple, cls: str
) -> None:
    view, names, policy = _cluster(seed, n_nodes=30, n_pods=seed % 100)
    s = Sampled(view, policy, keep_best)
    pod = _pod(7000, shape, cls)
    got = _filter(s.ext, pod, names)
    checker = Extender(view, policy, None, clock=lambda: NOW)  # no caches: the view says
    req = checker.pod_request(pod)
    with view.lock:
        for n in got["NodeNames"]:
            assert checker.placements.node_fit(n, req, NOW, None)[0], n
    if keep_best:
        assert len(got["NodeNames"]) <= keep_best
    assert got["NodeNames"] or s.samples[-1] is None  # a sample answers only with a node that passes
