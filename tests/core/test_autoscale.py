"""gpupack.core.autoscale: how many nodes of which group pending pods need, and which nodes the
autoscaler must keep; properties over generated fleets and pods, and the issue's cases by hand."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.autoscale import NodeGroup, moves_off, pinned_nodes, plan_scale_up, size_key
from gpupack.core.fit import Fit, fit
from gpupack.core.model import ClusterState, ContainerRequest, PodRequest, invariant_violations
from gpupack.core.node_rules import NodeFacts, pod_terms

H100, A100 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB"
GROUPS = (NodeGroup("h100", H100, 8, 81920, max_new=6), NodeGroup("a100", A100, 4, 40960, max_new=3))


def share(key: str, mem: int, milli: int | None = None, models: frozenset[str] | None = None,
          cls: str = "online") -> PodRequest:  # fmt: skip
    return PodRequest(key, cls, (ContainerRequest("c", 1, mem, milli),), gpu_models=models)


def whole(key: str, gpus: int = 1, models: frozenset[str] | None = None) -> PodRequest:
    return PodRequest(key, "online", (ContainerRequest("c", gpus),), gpu_models=models)


def fleet(n_h100: int = 0, n_a100: int = 0) -> ClusterState:
    s = ClusterState()
    for i in range(n_h100):
        s.add_node(GROUPS[0].template(f"h{i}"))
    for i in range(n_a100):
        s.add_node(GROUPS[1].template(f"a{i}"))
    return s


def place_all(state: ClusterState, pods: list[PodRequest]) -> None:
    for p in pods:
        for node in state.nodes.values():
            f = fit(node, p)
            if isinstance(f, Fit):
                state.place(p, f.placement, f.charged)
                break


pod_st = st.one_of(
    st.builds(share, st.uuids().map(str), st.integers(1000, 81920), st.one_of(st.none(), st.integers(1, 100).map(lambda p: p * 10)),
              st.sampled_from([None, frozenset({H100}), frozenset({A100})]), st.sampled_from(["online", "offline"])),
    st.builds(whole, st.uuids().map(str), st.integers(1, 8), st.sampled_from([None, frozenset({H100}), frozenset({A100})])),
)  # fmt: skip


def realise(state: ClusterState, pending: list[PodRequest], plan_nodes: dict[str, int]) -> ClusterState:
    """The fleet after the autoscaler added the plan's nodes, every pending pod placed first fit."""
    s = state.clone()
    for g in GROUPS:
        for i in range(plan_nodes.get(g.name, 0)):
            s.add_node(g.template(f"{g.name}-added-{i}"))
    return s


@settings(max_examples=60, deadline=None)
@given(st.lists(pod_st, min_size=0, max_size=30, unique_by=lambda p: p.key), st.integers(0, 2), st.integers(0, 2),
       st.lists(pod_st, max_size=20, unique_by=lambda p: p.key))  # fmt: skip
def test_plan_places_every_placeable_pod_on_the_nodes_it_asks_for(pending, n_h, n_a, running):
    state = fleet(n_h, n_a)
    place_all(state, running)
    before = {k: (v[1].node) for k, v in state.pods.items()}
    plan = plan_scale_up(state, pending, GROUPS)
    assert {k: v[1].node for k, v in state.pods.items()} == before, "the plan changed its input"
    assert set(plan.placed) | set(plan.unplaceable) == {p.key for p in pending}
    assert not set(plan.placed) & set(plan.unplaceable)
    for g in GROUPS:
        assert 0 <= plan.nodes.get(g.name, 0) <= (g.max_new or 0)
    assert sum(plan.nodes.values()) <= len(plan.placed)  # never a node no pod needs
    # the plan's own placements, replayed on the grown fleet, are sound and honour the models
    grown = realise(state, pending, plan.nodes)
    names = {f"{g.name}/new-{i}": f"{g.name}-added-{i}" for g in GROUPS for i in range(10)}
    by_key = {p.key: p for p in pending}
    for key, node in plan.placed.items():
        target = names.get(node, node)
        pod = by_key[key]
        if pod.gpu_models is not None:
            assert grown.nodes[target].model in pod.gpu_models
        f = fit(grown.nodes[target], pod)
        assert isinstance(f, Fit), f"{key} planned on {node} but does not fit there: {f}"
        grown.place(pod, f.placement, f.charged)
    assert invariant_violations(grown) == []
    # a pod is unplaceable only when no group's empty node can hold it (or growth ran out)
    for key, why in plan.unplaceable.items():
        fits_a_group = [g for g in GROUPS if isinstance(fit(g.template("t"), by_key[key]), Fit)]
        assert not fits_a_group or all(plan.nodes.get(g.name, 0) == g.max_new for g in fits_a_group), why


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=60))
def test_share_pods_get_the_memory_lower_bound_of_nodes_plus_at_most_one(quarters):
    # pods of 1/4, 2/4, 3/4 or a whole GPU's memory: an offline lower bound is their memory over a node's
    pending = [share(f"ns/p{i}", q * 20480) for i, q in enumerate(quarters)]
    groups = (NodeGroup("h100", H100, 8, 81920),)
    plan = plan_scale_up(ClusterState(), pending, groups)
    bound = math.ceil(sum(quarters) / (4 * 8))
    assert not plan.unplaceable
    assert bound <= plan.nodes["h100"] <= bound + 1


def test_forty_share_pods_on_three_full_nodes():
    state = fleet(3)
    place_all(state, [share(f"old/p{i}", 20480) for i in range(3 * 8 * 4)])  # 3 nodes, 4 shares a GPU
    pending = [share(f"ns/p{i}", 20480, 250) for i in range(40)]  # 40 quarters: 10 GPUs
    plan = plan_scale_up(state, pending, GROUPS)
    assert plan.nodes == {"h100": 2} and not plan.unplaceable


def test_model_restricted_pods_get_their_models_group_only():
    pending = [share(f"ns/a{i}", 30000, models=frozenset({A100})) for i in range(5)] + [
        share(f"ns/h{i}", 30000, models=frozenset({H100})) for i in range(3)
    ]
    plan = plan_scale_up(fleet(), pending, GROUPS)
    assert plan.nodes == {"a100": 2, "h100": 1}
    assert all(plan.placed[f"ns/a{i}"].startswith("a100/") for i in range(5))


def test_a_pod_that_fits_an_existing_or_upcoming_node_adds_none():
    state = fleet(1)
    place_all(state, [share(f"old/p{i}", 81920) for i in range(7)])  # one GPU left
    assert plan_scale_up(state, [share("ns/x", 40000)], GROUPS).nodes == {}
    two = [share("ns/x", 81920), share("ns/y", 81920)]
    assert plan_scale_up(state, two, GROUPS).nodes == {"h100": 1}
    # the node the autoscaler is adding for it counts, so a second pass asks for nothing more
    assert plan_scale_up(state, two, GROUPS, upcoming={"h100": 1}).nodes == {}


def test_a_pod_no_group_can_hold_is_unplaceable_with_each_groups_reason():
    plan = plan_scale_up(fleet(), [share("ns/big", 100000), whole("ns/w", 9)], GROUPS)
    assert plan.nodes == {} and set(plan.unplaceable) == {"ns/big", "ns/w"}
    assert "h100" in plan.unplaceable["ns/big"] and "a100" in plan.unplaceable["ns/big"]


def test_a_group_at_its_maximum_is_not_grown():
    groups = (NodeGroup("h100", H100, 8, 81920, max_new=1),)
    plan = plan_scale_up(ClusterState(), [whole(f"ns/w{i}", 8) for i in range(3)], groups)
    assert plan.nodes == {"h100": 1} and len(plan.unplaceable) == 2


def test_pinned_nodes_hold_a_pod_with_no_other_place():
    state = fleet(3)
    place_all(state, [whole("ns/whole")])  # h0 GPU 0
    for i in range(8):  # h1: a share on every GPU, so no whole GPU is free there
        f = fit(state.nodes["h1"], share(f"ns/s{i}", 50000))
        assert isinstance(f, Fit)
        state.place(share(f"ns/s{i}", 50000), f.placement, f.charged)
    # h2 is empty, so no place: the autoscaler removes empty nodes first
    pinned = pinned_nodes(state)
    # h1 has no whole GPU free; h1's eight big shares need eight GPUs, h0 has seven free
    assert set(pinned) == {"h0", "h1"} and "ns/whole" in pinned["h0"]
    state.release("ns/s7")
    # now h1's free GPU takes the whole-GPU pod, and h0's seven free GPUs h1's seven shares
    assert pinned_nodes(state) == {}


@settings(max_examples=40, deadline=None)
@given(st.lists(pod_st, max_size=25, unique_by=lambda p: p.key), st.integers(1, 3), st.integers(0, 2))
def test_pinned_is_exactly_the_nodes_whose_pods_cannot_all_move(running, n_h, n_a):
    state = fleet(n_h, n_a)
    place_all(state, running)
    before = {k: v[1].node for k, v in state.pods.items()}
    pinned = pinned_nodes(state)
    assert {k: v[1].node for k, v in state.pods.items()} == before
    assert invariant_violations(state) == []
    for name in state.nodes:
        pods = [p for p, pl, _ in state.pods.values() if pl.node == name]
        if not pods:
            assert name not in pinned
            continue
        busy = {pl.node for _, pl, _ in state.pods.values()}
        moves = moves_off(state, name, pods, [n for n in state.nodes if n in busy])
        assert (name in pinned) == isinstance(moves, str)
        if isinstance(moves, dict):  # the moves are real: replayed on a copy without the node
            s = state.clone()
            for p in pods:
                s.release(p.key)
            del s.nodes[name]
            for p in sorted(pods, key=lambda p: (size_key(p), p.key)):
                f = fit(s.nodes[moves[p.key]], p)
                assert isinstance(f, Fit), f"{p.key} moved to {moves[p.key]} but does not fit there"
                s.place(p, f.placement, f.charged)
            assert invariant_violations(s) == []
            assert all(state.nodes[moves[p.key]].gpus and moves[p.key] in busy for p in pods)


# --- a pod counts toward a group only if a node of that group would take it ------------------
GIB = 1 << 30
H100_FACTS = NodeFacts({"gpupack.io/node-group": "h100", "gpu": "h100"}, ({"key": "gpu", "value": "h100", "effect": "NoSchedule"},),
                       96000, 512 * GIB, 110)  # fmt: skip
A100_FACTS = NodeFacts({"gpupack.io/node-group": "a100", "gpu": "a100"}, (), 64000, 256 * GIB, 110)
RULED = (replace(GROUPS[0], facts=H100_FACTS), replace(GROUPS[1], facts=A100_FACTS))
TOLERATE = [{"key": "gpu", "operator": "Exists"}]


def spec(cpu: str = "1", mem: str = "1Gi", **kw) -> dict:
    return {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": mem}}}], **kw}


def test_impossible_pods_add_no_node_and_each_groups_first_reason_is_given():
    pods = [whole("imp/cpu-0", 8), whole("imp/cpu-1", 8), whole("imp/sel", 8)]
    terms = {
        "imp/cpu-0": pod_terms(spec("1000", tolerations=TOLERATE)),
        "imp/cpu-1": pod_terms(spec("1000", tolerations=TOLERATE)),
        "imp/sel": pod_terms(spec(nodeSelector={"pool": "nowhere"}, tolerations=TOLERATE)),
    }
    plan = plan_scale_up(fleet(), pods, RULED, terms=terms)
    assert plan.nodes == {} and set(plan.unplaceable) == set(terms)
    assert plan.unplaceable["imp/cpu-0"] == (
        "group h100: needs 1000 CPUs, a node has 96 CPUs; group a100: needs 1000 CPUs, a node has 64 CPUs"
    )
    assert plan.unplaceable["imp/sel"].startswith(
        "group h100: nodeSelector pool=nowhere not in template labels"
    )


def test_a_pod_goes_to_the_group_its_rules_allow_and_no_other():
    pods = [whole("ns/a", 4), whole("ns/h", 4)]
    terms = {
        "ns/a": pod_terms(spec(nodeSelector={"gpu": "a100"})),  # h100 is first but not its group
        "ns/h": pod_terms(spec()),  # tolerates nothing: the h100 taint keeps it off h100
    }
    plan = plan_scale_up(fleet(), pods, RULED, terms=terms)
    assert plan.nodes == {"a100": 2} and plan.placed["ns/a"].startswith("a100/")
    plan = plan_scale_up(
        fleet(), pods, RULED, terms={"ns/a": terms["ns/a"], "ns/h": pod_terms(spec(tolerations=TOLERATE))}
    )
    assert plan.nodes == {"a100": 1, "h100": 1}


def test_host_resources_pack_per_new_node_and_the_placeholder_carries_the_most():
    # eight 1-GPU pods of 40 CPUs each: GPUs would put all on one h100, CPUs (96) allow two a node
    pods = [whole(f"ns/p{i}") for i in range(8)]
    terms = {p.key: pod_terms(spec("40", "100Gi", tolerations=TOLERATE)) for p in pods}
    plan = plan_scale_up(fleet(), pods, RULED[:1], terms=terms)
    assert plan.nodes == {"h100": 4} and not plan.unplaceable
    assert plan.host == {"h100": (80000, 200 * 1024)}
    # without the pods' requests the GPUs alone decide: one node
    assert plan_scale_up(fleet(), pods, RULED[:1]).nodes == {"h100": 1}


def test_the_templates_pod_count_bounds_a_new_node():
    groups = (replace(GROUPS[0], facts=replace(H100_FACTS, taints=(), pods=3)),)
    pods = [share(f"ns/s{i}", 1000) for i in range(7)]
    terms = {p.key: pod_terms({}) for p in pods}
    assert plan_scale_up(fleet(), pods, groups, terms=terms).nodes == {"h100": 3}


def test_upcoming_and_existing_nodes_are_judged_by_their_labels_and_taints_too():
    pod = whole("ns/sel", 1)
    terms = {"ns/sel": pod_terms(spec(nodeSelector={"gpu": "a100"}))}
    # an upcoming h100 node has room, but the pod's selector keeps it off: an a100 node is added
    assert plan_scale_up(fleet(), [pod], RULED, {"h100": 1}, terms).nodes == {"a100": 1}
    # an existing node whose labels it fails is no place either; one whose labels match is
    state = fleet(1)
    assert plan_scale_up(state, [pod], RULED, None, terms, {"h0": H100_FACTS}).nodes == {"a100": 1}
    assert plan_scale_up(state, [pod], RULED, None, terms, {"h0": replace(A100_FACTS, name="h0")}).nodes == {}


def test_a_pod_whose_requests_cannot_be_read_is_placed_nowhere_with_the_reason():
    plan = plan_scale_up(fleet(), [whole("ns/bad")], RULED, terms={"ns/bad": pod_terms(spec("lots"))})
    assert plan.nodes == {} and plan.unplaceable["ns/bad"].startswith(
        "cannot place: container 'c' cpu request"
    )
