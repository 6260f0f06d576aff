"""Property tests of the packing core's invariants, over every registered policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest, invariant_violations
from gpupack.core.policies import POLICIES, get_policy, schedule

container = st.one_of(
    # shared: memory and/or SM share
    st.builds(
        lambda name, gpus, mem, milli: ContainerRequest(name, gpus, mem, milli),
        st.sampled_from(["a", "b"]),
        st.integers(1, 2),
        st.one_of(st.none(), st.integers(1, 30000)),
        st.one_of(st.none(), st.integers(1, 100).map(lambda p: p * 10)),
    ).filter(lambda c: not c.exclusive),
    # whole GPUs
    st.builds(lambda gpus: ContainerRequest("w", gpus), st.integers(1, 3)),
)

pod_shape = st.tuples(
    st.sampled_from(["online", "offline"]),
    st.lists(container, min_size=1, max_size=2, unique_by=lambda c: c.name),
    st.one_of(st.none(), st.integers(1, 8000)),  # an init container's memory
)

ops = st.lists(st.tuples(st.booleans(), pod_shape), min_size=1, max_size=40)


def fleet() -> ClusterState:
    s = ClusterState()
    for n, (count, mem, model) in enumerate([(4, 24576, "A10"), (2, 81920, "A100"), (8, 16384, "T4")]):
        s.add_node(Node(f"n{n}", [GPU(f"GPU-{n}-{i}", i, model, mem) for i in range(count)]))
    s.nodes["n2"].gpus[3].healthy = False
    return s


def check(state: ClusterState) -> None:
    assert invariant_violations(state) == []
    for node in state.nodes.values():
        for g in node.gpus:
            if not g.healthy:  # the fleet's unhealthy GPU was unhealthy from the start
                assert not g.holders, "a pod was placed on an unhealthy GPU"


def run(policy_name: str, seed: int, sequence) -> list:
    state = fleet()
    policy = get_policy(policy_name, seed=seed)
    log = []
    for i, (release, (cls, containers, init_mem)) in enumerate(sequence):
        if release and state.pods:
            victim = sorted(state.pods)[i % len(state.pods)]
            state.release(victim)
            log.append(("release", victim))
        init = (ContainerRequest("init", 1, init_mem, None, init=True),) if init_mem else ()
        pod = PodRequest(f"ns/p{i}", cls, tuple(containers), init)
        d = schedule(state, pod, policy)
        log.append((pod.key, d.node, d.fit and sorted(d.fit.charged.items())))
        check(state)
    return log


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(ops, st.sampled_from(sorted(POLICIES)), st.integers(0, 2**16))
def test_invariants_hold_for_every_policy(sequence, policy_name, seed):
    run(policy_name, seed, sequence)


@settings(max_examples=15, deadline=None)
@given(ops, st.sampled_from(sorted(POLICIES)), st.integers(0, 2**16))
def test_same_seed_same_placement(sequence, policy_name, seed):
    assert run(policy_name, seed, sequence) == run(policy_name, seed, sequence)


@settings(max_examples=30, deadline=None)
@given(ops)
def test_release_restores_the_empty_state(sequence):
    state = fleet()
    policy = get_policy("bestfit")
    for i, (_, (cls, containers, _)) in enumerate(sequence):
        schedule(state, PodRequest(f"ns/p{i}", cls, tuple(containers)), policy)
    for key in list(state.pods):
        state.release(key)
    for node in state.nodes.values():
        for g in node.gpus:
            assert (g.mem_used, g.milli_used, g.exclusive, g.pod_class, g.holders) == (0, 0, False, None, {})
