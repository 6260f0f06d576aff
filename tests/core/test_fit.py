import pytest

from gpupack.core.fit import Fit, FitFailure, fit
from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest


def node(name="n1", n=4, mem=24576, model="A10"):
    return Node(name, [GPU(f"GPU-{name}-{i}", i, model, mem) for i in range(n)])


def req(key="ns/p", cls="online", mem=None, milli=None, gpus=1, models=None, init=()):
    return PodRequest(key, cls, (ContainerRequest("c", gpus, mem, milli),), tuple(init), gpu_models=models)


def place(state, pod):
    f = fit(state.nodes["n1"], pod)
    assert isinstance(f, Fit), f
    state.place(pod, f.placement, f.charged)
    return f


def test_reason_names_largest_free_memory_and_gpu():
    st = ClusterState()
    st.add_node(node(n=2))
    place(st, req("a", mem=20000))
    place(st, req("b", mem=12288))
    r = fit(st.nodes["n1"], req(mem=20480))
    assert isinstance(r, FitFailure) and not r.unresolvable
    assert r.reason == "no GPU with 20480 MiB free for class online; largest free is 12288 MiB on GPU 1"


def test_request_larger_than_any_gpu_is_unresolvable():
    r = fit(node(), req(mem=80000))
    assert isinstance(r, FitFailure) and r.unresolvable and r.code == "gpu-mem"
    assert "largest GPU here has 24576 MiB" in r.reason


def test_wrong_model_is_unresolvable():
    r = fit(node(), req(mem=100, models=frozenset({"H100"})))
    assert isinstance(r, FitFailure) and r.unresolvable and r.code == "model"


def test_online_and_offline_never_share_a_gpu():
    st = ClusterState()
    st.add_node(node(n=1))
    place(st, req("a", cls="offline", mem=1000, milli=100))
    r = fit(st.nodes["n1"], req("b", cls="online", mem=1000, milli=100))
    assert isinstance(r, FitFailure) and r.code == "class"
    assert "other-class" in r.reason


def test_whole_gpu_needs_an_idle_gpu_and_blocks_sharing():
    st = ClusterState()
    st.add_node(node(n=2))
    place(st, req("a", mem=1000))
    f = place(st, req("w", gpus=1))
    (share,) = f.placement.containers["c"]
    assert share.exclusive
    g = st.nodes["n1"].gpus[share.gpu_index]
    assert g.exclusive and g.holders == {"w": (24576, 1000)}
    r = fit(st.nodes["n1"], req("x", gpus=1))
    assert isinstance(r, FitFailure) and r.code == "gpu-whole"
    assert "0 of 2 are idle" in r.reason


def test_unhealthy_gpus_are_never_chosen():
    n = node(n=2)
    n.gpus[0].healthy = False
    f = fit(n, req(mem=100))
    assert isinstance(f, Fit) and f.placement.containers["c"][0].gpu_index == 1
    r = fit(n, req(gpus=2))
    assert isinstance(r, FitFailure) and "unhealthy" in r.reason


def test_sharing_packs_onto_the_fullest_gpu_that_fits():
    st = ClusterState()
    st.add_node(node(n=3))
    place(st, req("a", mem=8000))
    f = place(st, req("b", mem=8000))
    assert f.placement.containers["c"][0].gpu_index == 0  # joined the used GPU, left two idle


def test_init_containers_reuse_app_gpus_at_max_not_sum():
    n = node(n=2)
    pod = PodRequest(
        "ns/p",
        "online",
        (ContainerRequest("app", 1, 10000, 300),),
        (ContainerRequest("warm", 1, 4000, 500, init=True),),
    )
    f = fit(n, pod)
    assert isinstance(f, Fit)
    assert f.placement.containers["warm"][0].gpu_index == f.placement.containers["app"][0].gpu_index
    (charge,) = f.charged.values()
    assert charge == (10000, 500, False)


def test_multi_gpu_container_gets_distinct_gpus_on_one_node():
    f = fit(node(n=4), req(mem=1000, gpus=3))
    assert isinstance(f, Fit)
    idx = [s.gpu_index for s in f.placement.containers["c"]]
    assert len(set(idx)) == 3


@pytest.mark.slow
def test_fast_single_share_path_decides_like_the_general_path():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gpupack.core.fit import fit_general

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(
            st.tuples(st.sampled_from(["online", "offline"]), st.integers(1, 20000), st.integers(0, 60)),
            max_size=12,
        ),
        st.sampled_from(["online", "offline"]),
        st.integers(1, 24576),
        st.integers(0, 100),
        st.booleans(),
    )
    def check(existing, cls, mem, pct, sick):
        n = node(n=4)
        n.gpus[2].healthy = not sick
        s = ClusterState()
        s.add_node(n)
        for i, (c, m, p) in enumerate(existing):
            f = fit(n, req(f"e{i}", cls=c, mem=m, milli=p * 10))
            if f:
                s.place(req(f"e{i}", cls=c, mem=m, milli=p * 10), f.placement, f.charged)
        pod = req(cls=cls, mem=mem, milli=pct * 10 or None)
        a, b = fit(n, pod), fit_general(n, pod)
        assert type(a) is type(b)
        if isinstance(a, Fit):
            assert a.placement == b.placement and a.charged == b.charged
        else:
            assert a.reason == b.reason

    check()
