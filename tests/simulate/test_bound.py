"""The lower bound on unallocated GPUs: exact on small cases, never above an exact optimum or a replay."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupack.simulate.bound import NodeType, PodClass, bin_bound, max_allocated, node_types
from gpupack.simulate.openb import NodeList
from gpupack.simulate.replay import arrival_order, replay

from .conftest import reduced_pods


def pod(milli: int, num: int = 1, cpu: int = 1, ram: int = 1, spec: frozenset[str] | None = None) -> PodClass:
    return PodClass(cpu, ram, num, milli, spec)


def node(gpus: int = 1, cpu: int = 100, ram: int = 100, model: str = "A", count: int = 1) -> NodeType:
    return NodeType(cpu, ram, gpus, model, count)


def test_two_shares_over_half_a_gpu_do_not_share_it():
    assert max_allocated([node()], Counter({pod(600): 2})) == pytest.approx(600)


def test_shares_fill_a_gpu_exactly_and_the_rest_goes_where_it_fits():
    # 810 + 190 fill one GPU; two 500s the other; the third 500 is left out.
    arrived = Counter({pod(810): 1, pod(190): 1, pod(500): 3})
    assert max_allocated([node(gpus=2)], arrived) == pytest.approx(2000)


def test_a_share_mix_the_capacity_alone_would_allow():
    # 3 x 400 and a 700 on two GPUs: the 1900 milli fit the 2000 of capacity, and no share is over
    # half a GPU, but 700 + 400 > 1000: the best packing is 400 + 400 | 700 (1500). The LP counts
    # patterns fractionally (half of 400+400 | 700, half of 400 | 400 | ...), so it lands between.
    arrived = Counter({pod(400): 3, pod(700): 1})
    got = max_allocated([node(gpus=2)], arrived)
    assert 1500 <= got < 1900


def test_gpu_models_are_kept():
    only_b = pod(FULL := 1000, spec=frozenset({"B"}))
    assert max_allocated([node(model="A", gpus=4)], Counter({only_b: 3})) == 0
    assert max_allocated([node(model="A"), node(model="B")], Counter({only_b: 3})) == pytest.approx(FULL)


def test_multi_gpu_pods_take_gpus_of_one_node():
    # Two 2-GPU pods on two 3-GPU nodes: one each. On one 3-GPU node: only one.
    two = Counter({pod(1000, num=2): 2})
    assert max_allocated([node(gpus=3, count=2)], two) == pytest.approx(4000)
    assert max_allocated([node(gpus=3, count=1)], two) == pytest.approx(2000)
    # And a whole GPU still fits beside it.
    assert max_allocated([node(gpus=3)], two + Counter({pod(1000): 1})) == pytest.approx(3000)


def test_a_pod_bigger_than_any_node_is_left_out():
    assert max_allocated([node(gpus=2, cpu=8)], Counter({pod(1000, cpu=9): 1})) == 0
    assert max_allocated([node(gpus=2, ram=8)], Counter({pod(1000, ram=9): 1})) == 0
    assert max_allocated([node(gpus=2)], Counter({pod(1000, num=4): 1})) == 0


def test_cpu_caps_the_gpu_pods_of_a_node_type():
    # Three GPUs, CPU for two of the pods.
    arrived = Counter({pod(1000, cpu=5): 3})
    assert max_allocated([node(gpus=3, cpu=10)], arrived) == pytest.approx(2000)


def test_cpu_only_rule_keeps_early_cpu_pods():
    # One node, one GPU, CPU 10. A CPU-only pod of 6 arrives first, while the node is empty: the
    # replay places it, and the GPU pod (CPU 6) that arrives later no longer fits (exact: 0).
    cpu_pod, gpu_pod = pod(0, num=0, cpu=6), pod(1000, cpu=6)
    types = [node(cpu=10)]
    assert max_allocated(types, Counter({cpu_pod: 1, gpu_pod: 1})) == pytest.approx(1000)  # any placement
    windows = [Counter({cpu_pod: 1}), Counter({gpu_pod: 1})]
    # Pods count fractionally: 5/6 of the CPU-only pod is CPU 5 >= 10 - 6 + 1, "no room for it".
    assert max_allocated(types, windows, cpu_only="replay") < 850
    # In one window the rule cannot tell the order: the GPU pod first, then no room.
    assert max_allocated(types, [windows[0] + windows[1]], cpu_only="replay") == pytest.approx(1000)


def test_a_cpu_only_pod_left_out_blocks_later_pods_that_ask_as_much():
    # One node, one GPU, CPU 10. Two CPU-only pods of 6 arrive first: the first is placed, the
    # second finds no room and is left out, so no node has 6 CPU free from then on and the GPU pod
    # of CPU 6 that arrives later can never fit (exact: 0). Pooled fractionally without that, 5 CPU
    # of CPU-only pods makes "no room" and the GPU pod gets 5/6 of the rest.
    cpu_pod, gpu_pod = pod(0, num=0, cpu=6), pod(1000, cpu=6)
    windows = [Counter({cpu_pod: 2}), Counter({gpu_pod: 1})]
    assert max_allocated([node(cpu=10)], windows, cpu_only="replay") == pytest.approx(0)
    # A later pod that asks for less CPU than the one left out still fits where room is left.
    small = pod(1000, cpu=4)
    windows = [Counter({cpu_pod: 2}), Counter({small: 1})]
    assert max_allocated([node(cpu=10)], windows, cpu_only="replay") == pytest.approx(1000)


# --- against an exact optimum on tiny instances --------------------------------------------------


def exact(types: list[NodeType], seq: list[PodClass], rule: bool) -> int:
    """The most GPU milli any placement of `seq` allocates, by trying every placement. With `rule`,
    a CPU-only pod may be left out only if, when it arrives (in `seq` order), no node has room."""
    nodes = [t for t in types for _ in range(t.count)]
    free = [[1000] * t.gpus for t in nodes]
    cpu = [t.cpu for t in nodes]
    ram = [t.ram for t in nodes]
    best = 0

    def options(c: PodClass):
        for i, t in enumerate(nodes):
            if cpu[i] < c.cpu or ram[i] < c.ram:
                continue
            if c.num and c.spec is not None and t.model not in c.spec:
                continue
            if c.num == 0:
                yield i, ()
            elif c.milli < 1000:
                for j, f in enumerate(free[i]):
                    if f >= c.milli:
                        yield i, (j,)
            else:
                idle = [j for j, f in enumerate(free[i]) if f == 1000]
                if len(idle) >= c.num:
                    # Which idle GPUs does not matter: all are alike.
                    yield i, tuple(idle[: c.num])

    def go(k: int, alloc: int) -> None:
        nonlocal best
        best = max(best, alloc)
        if k == len(seq):
            return
        c = seq[k]
        opts = list(options(c))
        for i, gpus in opts:
            for j in gpus:
                free[i][j] -= c.milli
            cpu[i] -= c.cpu
            ram[i] -= c.ram
            go(k + 1, alloc + c.num * c.milli)
            for j in gpus:
                free[i][j] += c.milli
            cpu[i] += c.cpu
            ram[i] += c.ram
        if not (rule and c.num == 0 and opts):
            go(k + 1, alloc)

    go(0, 0)
    return best


MODELS = ("A", "B")
node_st = st.builds(
    NodeType,
    cpu=st.sampled_from([4, 8, 12]),
    ram=st.sampled_from([4, 8]),
    gpus=st.integers(1, 3),
    model=st.sampled_from(MODELS),
    count=st.integers(1, 2),
)
spec_st = st.sampled_from([None, frozenset({"A"}), frozenset({"B"}), frozenset(MODELS)])
share_st = st.builds(
    PodClass,
    cpu=st.integers(1, 6),
    ram=st.integers(1, 4),
    num=st.just(1),
    milli=st.sampled_from([100, 190, 250, 300, 400, 500, 600, 810]),
    spec=spec_st,
)
whole_st = st.builds(
    PodClass,
    cpu=st.integers(1, 8),
    ram=st.integers(1, 4),
    num=st.integers(1, 3),
    milli=st.just(1000),
    spec=spec_st,
)
cpu_only_st = st.builds(
    PodClass, cpu=st.integers(1, 8), ram=st.integers(1, 4), num=st.just(0), milli=st.just(0), spec=st.none()
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    types=st.lists(node_st, min_size=1, max_size=2, unique_by=lambda t: (t.cpu, t.ram, t.gpus, t.model)),
    seq=st.lists(st.one_of(share_st, whole_st, cpu_only_st), min_size=1, max_size=6),
    cut=st.integers(0, 6),
)
def test_bound_is_never_below_the_exact_optimum(types, seq, cut):
    any_placement = max_allocated(types, Counter(seq))
    assert any_placement >= exact(types, seq, rule=False) - 1e-6
    # The replay's rule for CPU-only pods, over two arrival windows.
    windows = [Counter(seq[:cut]), Counter(seq[cut:])]
    with_rule = max_allocated(types, windows, cpu_only="replay")
    assert with_rule >= exact(types, seq, rule=True) - 1e-6
    assert with_rule <= any_placement + 1e-6


# --- against the replays ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["default", "gpuspec25", "cpu300"])
def test_bound_is_below_every_policy_on_a_reduced_replay(openb, small_cluster, trace):
    pods = reduced_pods(openb, trace, step=10)
    capacity = small_cluster.gpu_capacity
    for seed in (42, 43):
        order = arrival_order(pods, capacity, seed)
        b = bin_bound(small_cluster, pods, order)
        assert b.unallocated_pct is not None and b.events > 0
        assert b.solved_at[0] >= 0 and len(b.solved_at) >= 1
        for policy in ("gpupack", "fgd", "bestfit"):
            achieved = replay(small_cluster, pods, policy, seed, order=order).unallocated_pct_at_100
            assert b.unallocated_pct <= achieved + 1e-6, (trace, seed, policy)
        assert b.unallocated_pct > 0  # a bound of 0 would say nothing


def test_node_types_aggregate_equal_nodes():
    nodes = NodeList(
        ["a", "b", "c"],
        np.array([8, 8, 16]),
        np.array([64, 64, 64]),
        np.array([2, 2, 2]),
        ["T4", "T4", "T4"],
    )
    assert node_types(nodes) == [NodeType(8, 64, 2, "T4", 2), NodeType(16, 64, 2, "T4", 1)]
