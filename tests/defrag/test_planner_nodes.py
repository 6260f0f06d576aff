"""The nodes objective of the pure planner (`gpupack defrag --objective nodes`): whole nodes
emptied cheapest first, pods land only on nodes that stay, all or nothing per node."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import check_invariants, fleet, pod, put

from gpupack.core.defrag import Limits, plan_nodes, verify_plan
from gpupack.core.model import ContainerRequest, PodRequest

FREE = Limits(max_evictions=100, max_per_node=0, max_per_namespace=0, max_workload_share=0)


def three_nodes():
    """n0: two heavy pods; n1: one light pod; n2: two light pods. Cheapest to empty: n1, then n2."""
    s = fleet([(2, 80000, "A")] * 3)
    put(s, pod("a/h1", mem=50000, milli=500), "n0", [0])
    put(s, pod("a/h2", mem=50000, milli=500), "n0", [1])
    put(s, pod("a/l1", mem=8000, milli=100), "n1", [0])
    put(s, pod("a/l2", mem=8000, milli=100), "n2", [0])
    put(s, pod("a/l3", mem=8000, milli=100), "n2", [1])
    return s


def test_cheapest_node_first_and_targets_stay():
    s = three_nodes()
    before = repr(s.pods)
    plan = plan_nodes(s, None, FREE)
    assert repr(s.pods) == before, "the input is not modified"
    assert [g.node for g in plan.groups] == ["n1", "n2"] and plan.nodes_freed == ["n1", "n2"]
    assert {m.to_node for m in plan.moves} == {"n0"}
    after = verify_plan(s, plan)
    check_invariants(after)
    assert all(g.empty for n in ("n1", "n2") for g in after.nodes[n].gpus)
    assert plan.used_gpus_before - plan.used_gpus_after == plan.gpus_freed == 3


def test_a_node_that_received_pods_is_not_drained_and_no_pod_moves_twice():
    s = fleet([(1, 80000, "A")] * 3)
    put(s, pod("a/x", mem=30000, milli=300), "n0", [0])
    put(s, pod("a/y", mem=30000, milli=300), "n1", [0])
    put(s, pod("a/z", mem=10000, milli=100), "n2", [0])
    plan = plan_nodes(s, None, FREE)
    moved = [m.pod for m in plan.moves]
    assert len(moved) == len(set(moved))
    targets = {m.to_node for m in plan.moves}
    assert not targets & set(plan.nodes_freed)
    assert len(plan.nodes_freed) == 2  # z then one of x/y onto the other


def test_protected_and_unmovable_nodes_are_never_emptied():
    s = three_nodes()
    plan = plan_nodes(s, lambda p: p.key != "a/l1", FREE, protected=["n2"])
    assert plan.skipped["protected"] == 1 and plan.skipped["not-movable"] == 1
    # Only n0 may be emptied; a node that is never emptied is still a fine target.
    assert plan.nodes_freed == ["n0"] and {m.from_node for m in plan.moves} == {"n0"}


def test_all_or_nothing_per_node():
    s = fleet([(1, 80000, "A"), (1, 80000, "A")])
    put(s, pod("a/big", mem=70000, milli=700), "n0", [0])
    put(s, pod("a/m1", mem=20000, milli=200), "n1", [0])
    # n1's pod does not fit next to the big one and n0's does not fit on n1: nothing moves.
    plan = plan_nodes(s, None, FREE)
    assert plan.moves == [] and plan.skipped["no-target"] == 2


def test_whole_gpu_pods_move_to_idle_gpus_of_a_node_that_stays():
    s = fleet([(4, 80000, "A"), (2, 80000, "A")])
    put(s, pod("a/small", mem=8000, milli=100), "n0", [0])
    put(s, pod("a/small2", mem=8000, milli=100), "n0", [1])
    whole = PodRequest(
        "a/whole", "offline", (ContainerRequest("c", 1),), namespace="a", owner=("ReplicaSet", "w")
    )
    put(s, whole, "n1", [0])
    plan = plan_nodes(s, None, FREE)
    assert plan.nodes_freed == ["n1"] and [(m.pod, m.to_node) for m in plan.moves] == [("a/whole", "n0")]
    check_invariants(verify_plan(s, plan))


def test_caps_hold_per_run_and_per_node():
    s = three_nodes()
    assert plan_nodes(s, None, Limits(max_evictions=2, max_per_node=0, max_per_namespace=0,
                                      max_workload_share=0)).nodes_freed == ["n1"]  # fmt: skip
    assert plan_nodes(s, None, Limits(max_evictions=10, max_per_node=1, max_per_namespace=0,
                                      max_workload_share=0)).nodes_freed == ["n1"]  # fmt: skip


def test_baseline_drains_the_least_utilised_node_first():
    s = fleet([(2, 80000, "A")] * 3)
    put(s, pod("a/h1", mem=60000, milli=600), "n0", [0])
    put(s, pod("a/h2", mem=60000, milli=600), "n0", [1])
    # n1: two tiny pods (2 evictions, least utilised); n2: one medium pod (1 eviction).
    put(s, pod("a/t1", mem=2000, milli=50), "n1", [0])
    put(s, pod("a/t2", mem=2000, milli=50), "n1", [1])
    put(s, pod("a/m", mem=16000, milli=300), "n2", [0])
    ours = plan_nodes(
        s, None, Limits(max_evictions=2, max_per_node=0, max_per_namespace=0, max_workload_share=0)
    )
    base = plan_nodes(s, None, Limits(max_evictions=2, max_per_node=0, max_per_namespace=0, max_workload_share=0),
                      order="emptiest")  # fmt: skip
    assert ours.nodes_freed == ["n2"] and base.nodes_freed == ["n1"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.sampled_from([4000, 16000, 30000]),
                          st.sampled_from([100, 300, 500]), st.sampled_from(["online", "offline"])),
                max_size=24))  # fmt: skip
def test_random_clusters_keep_every_invariant(pods):
    s = fleet([(4, 40000, "A")] * 6)
    from gpupack.core.fit import Fit, fit

    for i, (n, _g, mem, milli, cls) in enumerate(pods):
        p = pod(f"ns{i % 3}/p{i}", cls=cls, mem=mem, milli=milli)
        f = fit(s.nodes[f"n{n}"], p)
        if isinstance(f, Fit):
            s.place(p, f.placement, f.charged)
    plan = plan_nodes(s, None, FREE)
    after = verify_plan(s, plan)
    check_invariants(after)
    freed = set(plan.nodes_freed)
    assert all(all(g.empty for g in after.nodes[n].gpus) for n in freed)
    assert all(
        m.to_node not in freed and any(not g.empty for g in s.nodes[m.to_node].gpus) for m in plan.moves
    )
    assert len({m.pod for m in plan.moves}) == len(plan.moves)
