"""The pure defrag planner: invariants in the target state, caps, determinism, and the choices."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.defrag import Limits, Plan, PlanError, plan_baseline, plan_defrag, verify_plan
from gpupack.core.model import (
    FULL,
    GPU,
    ClusterState,
    ContainerRequest,
    Node,
    PodRequest,
    invariant_violations,
)
from gpupack.core.policies import get_policy, schedule


def check_invariants(state: ClusterState) -> None:
    assert invariant_violations(state) == []


def fleet(spec) -> ClusterState:
    s = ClusterState()
    for n, (count, mem, model) in enumerate(spec):
        s.add_node(Node(f"n{n}", [GPU(f"GPU-{n}-{i}", i, model, mem) for i in range(count)]))
    return s


def pod(key: str, cls: str = "offline", mem: int = 4000, milli: int = 100, gpus: int = 1, **kw) -> PodRequest:
    ns = key.split("/")[0]
    c = ContainerRequest("c", gpus, mem, milli) if mem or milli else ContainerRequest("c", gpus)
    return PodRequest(
        key, cls, (c,), namespace=ns, owner=kw.pop("owner", ("ReplicaSet", key.split("/")[1])), **kw
    )


def put(state: ClusterState, p: PodRequest, node: str, gpu_indices: list[int]) -> None:
    """Place `p` on exactly these GPUs (fit() would choose for itself)."""
    from gpupack.core.model import Placement, Share

    c = p.containers[0]
    n = state.nodes[node]
    shares, charged = [], {}
    for i in gpu_indices:
        mem = n.gpus[i].mem_mib if c.exclusive else (c.mem_mib or 0)
        milli = FULL if c.exclusive else (c.milli or 0)
        shares.append(Share(i, mem, milli, c.exclusive))
        charged[i] = (mem, milli, c.exclusive)
    state.place(p, Placement(node, {c.name: tuple(shares)}), charged)


# --- properties ---------------------------------------------------------------------------------
container = st.one_of(
    st.builds(
        lambda gpus, mem, milli: ContainerRequest("c", gpus, mem, milli),
        st.integers(1, 2),
        st.integers(1000, 40000),
        st.integers(1, 60).map(lambda p: p * 10),
    ),
    st.builds(lambda gpus: ContainerRequest("c", gpus), st.integers(1, 2)),  # whole GPUs
)
pod_shape = st.tuples(
    st.sampled_from(["online", "offline"]),
    container,
    st.sampled_from([None, frozenset({"A100"}), frozenset({"L4"})]),
    st.integers(0, 3),  # workload
)
scenario = st.tuples(
    st.lists(pod_shape, min_size=1, max_size=45),
    st.integers(0, 2**16),  # placement seed
    st.lists(st.booleans(), min_size=45, max_size=45),  # departures
    st.lists(st.booleans(), min_size=45, max_size=45),  # movable
    st.builds(
        Limits,
        max_evictions=st.integers(0, 12),
        max_per_node=st.integers(0, 5),
        max_per_namespace=st.integers(0, 6),
        max_workload_share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    ),
)
SPEC = [(4, 81920, "A100"), (4, 81920, "A100"), (2, 24576, "L4"), (4, 24576, "L4"), (2, 81920, "A100")]


def build(shapes, seed, departures) -> ClusterState:
    state = fleet(SPEC)
    policy = get_policy("random", seed=seed)
    for i, (cls, c, models, wl) in enumerate(shapes):
        ns = f"ns{i % 3}"
        p = PodRequest(
            f"{ns}/p{i}", cls, (c,), gpu_models=models, namespace=ns, owner=("ReplicaSet", f"w{wl}")
        )
        schedule(state, p, policy)
    for i, gone in enumerate(departures):
        if gone:
            state.release(f"ns{i % 3}/p{i}")
    return state


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(scenario, st.sampled_from(["ratio", "emptiest"]))
def test_plan_keeps_every_invariant_and_cap(sc, order):
    shapes, seed, departures, movable_bits, limits = sc
    state = build(shapes, seed, departures)
    movable = {f"ns{i % 3}/p{i}" for i, ok in enumerate(movable_bits) if ok}
    before = json.dumps(sorted((k, sorted(c.items())) for k, (_, _, c) in state.pods.items()))
    plan = plan_defrag(state, movable, limits, order=order)
    # The input is untouched (the planner works on clones).
    assert json.dumps(sorted((k, sorted(c.items())) for k, (_, _, c) in state.pods.items())) == before

    final = verify_plan(state, plan)
    check_invariants(final)
    used_before = {(n.name, g.uuid) for n in state.nodes.values() for g in n.gpus if not g.empty}
    moved = [m.pod for m in plan.moves]
    assert len(moved) == len(set(moved)), "a pod moves at most once"
    for m in plan.moves:
        assert m.pod in movable
        _, _, charged = state.pods[m.pod]
        assert not any(ex for _, _, ex in charged.values()), "an exclusive pod was moved"
        for uuid in m.to_gpus:
            assert (m.to_node, uuid) in used_before, "a pod was moved onto an idle GPU"
    for grp in plan.groups:
        for uuid in grp.gpus_freed:
            assert (grp.node, uuid) in used_before
            assert final.nodes[grp.node].gpu(uuid).empty
    assert plan.used_gpus_before - plan.used_gpus_after == plan.gpus_freed
    assert plan.gpus_freed >= len(plan.groups)
    # Caps.
    assert plan.evictions <= limits.max_evictions
    if limits.max_per_node > 0:
        assert max(Counter(m.from_node for m in plan.moves).values(), default=0) <= limits.max_per_node
    if limits.max_per_namespace > 0:
        assert max(Counter(m.namespace for m in plan.moves).values(), default=0) <= limits.max_per_namespace
    if limits.max_workload_share > 0:
        replicas = Counter((p.namespace, p.owner) for p, _, _ in state.pods.values())
        for (ns, owner), n in Counter(
            (m.namespace, (m.owner_kind, m.owner_name)) for m in plan.moves
        ).items():
            assert n <= max(1, int(limits.max_workload_share * replicas[(ns, owner)]))


@settings(max_examples=30, deadline=None)
@given(scenario)
def test_plan_is_deterministic_whatever_the_insertion_order(sc):
    shapes, seed, departures, _, limits = sc
    state = build(shapes, seed, departures)
    # The same cluster, with nodes and pods recorded in reverse order.
    other = ClusterState()
    for name in reversed(list(state.nodes)):
        n = state.nodes[name]
        other.add_node(Node(n.name, [GPU(g.uuid, g.index, g.model, g.mem_mib) for g in n.gpus]))
    for key in reversed(list(state.pods)):
        p, placement, charged = state.pods[key]
        other.place(p, placement, charged)
    a = plan_defrag(state, None, limits).to_dict()
    b = plan_defrag(state, None, limits).to_dict()
    c = plan_defrag(other, None, limits).to_dict()
    assert a == b == c


# --- choices on hand-made states -----------------------------------------------------------------
def test_two_half_empty_gpus_become_one():
    s = fleet([(2, 81920, "A100")])
    put(s, pod("a/p1", mem=20000, milli=300), "n0", [0])
    put(s, pod("a/p2", mem=10000, milli=200), "n0", [1])
    plan = plan_defrag(s)
    assert plan.evictions == 1 and plan.gpus_freed == 1
    m = plan.moves[0]
    assert m.pod == "a/p2", "the lighter GPU is drained"
    assert m.to_gpus == ("GPU-0-0",)
    assert [g.gpus_freed for g in plan.groups] == [("GPU-0-1",)]


def test_nothing_moves_when_nothing_fits_or_nothing_is_movable():
    s = fleet([(2, 81920, "A100")])
    put(s, pod("a/p1", mem=60000, milli=300), "n0", [0])
    put(s, pod("a/p2", mem=30000, milli=200), "n0", [1])
    assert plan_defrag(s).evictions == 0  # 60000 + 30000 > 81920
    s2 = fleet([(2, 81920, "A100")])
    put(s2, pod("a/p1", mem=20000), "n0", [0])
    put(s2, pod("a/p2", mem=10000), "n0", [1])
    assert plan_defrag(s2, movable=set()).evictions == 0
    assert plan_defrag(s2, movable={"a/p1"}).moves[0].pod == "a/p1"


def test_classes_never_mix_and_models_hold():
    s = fleet([(2, 81920, "A100"), (1, 24576, "L4")])
    put(s, pod("a/on", cls="online", mem=10000), "n0", [0])
    put(s, pod("a/off", cls="offline", mem=10000), "n0", [1])
    assert plan_defrag(s).evictions == 0, "online and offline GPUs cannot be merged"
    # A pod allowed only on L4 sits on the L4; the A100 GPU with room is no target for it.
    s = fleet([(2, 81920, "A100"), (1, 24576, "L4")])
    put(s, pod("a/x", mem=10000), "n0", [0])
    put(s, pod("a/only-l4", mem=4000, gpu_models=frozenset({"L4"})), "n1", [0])
    plan = plan_defrag(s)
    assert [m.pod for m in plan.moves] == ["a/x"] or plan.evictions == 0
    assert all(m.pod != "a/only-l4" for m in plan.moves)


def test_exclusive_pods_stay_and_their_gpus_are_no_target():
    s = fleet([(3, 81920, "A100")])
    put(s, pod("a/whole", mem=0, milli=0), "n0", [0])
    put(s, pod("a/small", mem=1000), "n0", [1])
    put(s, pod("a/small2", mem=1000), "n0", [2])
    plan = plan_defrag(s)
    assert all(m.pod != "a/whole" for m in plan.moves)
    assert all("GPU-0-0" not in m.to_gpus for m in plan.moves)
    assert plan.gpus_freed == 1


def test_a_two_gpu_pod_alone_frees_two_gpus_with_one_eviction_and_is_preferred():
    s = fleet([(4, 81920, "A100"), (4, 81920, "A100")])
    put(s, pod("a/big", mem=8000, milli=100, gpus=2), "n0", [0, 1])
    put(s, pod("a/one", mem=2000, milli=100), "n0", [2])
    put(s, pod("a/t1", mem=20000, milli=300), "n1", [0])
    put(s, pod("a/t2", mem=20000, milli=300), "n1", [1])
    plan = plan_defrag(s, limits=Limits(max_evictions=1))
    assert [m.pod for m in plan.moves] == ["a/big"]
    assert plan.gpus_freed == 2 and plan.gpus_per_eviction == 2.0
    base = plan_baseline(s, limits=Limits(max_evictions=1))
    assert base.gpus_per_eviction <= plan.gpus_per_eviction


def test_whole_nodes_come_second():
    # Two candidates cost one eviction for one GPU each; draining n1's only used GPU frees the node.
    s = fleet([(2, 81920, "A100"), (2, 81920, "A100"), (2, 81920, "A100")])
    put(s, pod("a/anchor", mem=40000, milli=500), "n0", [0])
    put(s, pod("a/n0-light", mem=2000, milli=100), "n0", [1])
    put(s, pod("a/n1-only", mem=3000, milli=100), "n1", [0])
    put(s, pod("a/anchor2", mem=40000, milli=500), "n2", [0])
    put(s, pod("a/anchor3", mem=40000, milli=500), "n2", [1])
    plan = plan_defrag(s, limits=Limits(max_evictions=1))
    assert plan.moves[0].pod == "a/n1-only"
    assert plan.nodes_freed == ["n1"]


def test_caps_per_node_namespace_and_workload():
    s = fleet([(4, 81920, "A100")])
    put(s, pod("a/big", mem=50000, milli=500), "n0", [0])
    for i in range(1, 4):
        put(
            s, pod(f"{'a' if i < 3 else 'b'}/p{i}", mem=1000, milli=10, owner=("ReplicaSet", "rs")), "n0", [i]
        )
    assert plan_defrag(s, limits=Limits(max_per_node=2, max_workload_share=1.0)).evictions == 2
    assert (
        plan_defrag(s, limits=Limits(max_per_namespace=1, max_workload_share=1.0)).evictions == 2
    )  # a:1, b:1
    # a/rs has 2 replicas: a 0.5 share allows 1; b/rs has 1 replica: at least one may move.
    plan = plan_defrag(s, limits=Limits(max_workload_share=0.5))
    assert Counter(m.namespace for m in plan.moves) == {"a": 1, "b": 1}
    assert plan.skipped["cap:workload"] >= 1


def test_verify_plan_rejects_a_tampered_plan():
    s = fleet([(2, 81920, "A100")])
    put(s, pod("a/p1", cls="online", mem=20000), "n0", [0])
    put(s, pod("a/p2", mem=10000), "n0", [1])
    put(s, pod("a/p3", mem=10000), "n0", [1])
    s.release("a/p3")
    ok = fleet([(2, 81920, "A100")])
    put(ok, pod("a/p1", mem=20000), "n0", [0])
    put(ok, pod("a/p2", mem=10000), "n0", [1])
    good = plan_defrag(ok)
    assert good.evictions == 1
    # Replaying the same moves on a state where the target GPU is online must fail loudly.
    with pytest.raises(PlanError, match="online|offline"):
        verify_plan(s, Plan(moves=list(good.moves), groups=list(good.groups)))
