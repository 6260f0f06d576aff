"""gpupack.core.fit.pod_charge: the one rule for a pod's charge per GPU, max(init, sum of app)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.fit import Fit, fit_general, holds, pod_charge
from gpupack.core.model import GPU, ContainerRequest, Node, PodRequest


def test_app_containers_add_up_and_an_init_container_riding_on_them_is_charged_the_max():
    app = [[(0, 3000, 300, False)], [(0, 2000, 100, False), (1, 1000, 100, False)]]
    init = [[(0, 6000, 200, False)], [(1, 500, 900, False)]]
    assert pod_charge(app, init) == {0: (6000, 400, False), 1: (1000, 900, False)}


def test_an_init_container_off_the_app_gpus_holds_its_own_and_a_later_one_rides_on_it():
    app = [[("GPU-a", 10, 10, False)]]
    init = [[("GPU-a", 5, 5, False), ("GPU-b", 7, 70, False)], [("GPU-b", 9, 20, False)]]
    # the first adds up on both its GPUs (it needs one the app does not hold); the second runs
    # before the app containers on GPU-b, which the pod holds by then
    assert pod_charge(app, init) == {"GPU-a": (15, 15, False), "GPU-b": (9, 70, False)}


def test_exclusive_marks_the_gpu_and_no_containers_charge_nothing():
    assert pod_charge([[(2, 80000, 1000, True)]], [[(2, 100, 10, False)]]) == {2: (80000, 1000, True)}
    assert pod_charge([], []) == {} and pod_charge([[]], [[]]) == {}


container = st.tuples(st.integers(1, 2), st.integers(1, 20000), st.integers(1, 1000))


@settings(max_examples=150, deadline=None)
@given(st.lists(container, min_size=1, max_size=3), st.lists(container, max_size=3))
def test_fit_charges_what_pod_charge_says_for_its_placement(apps, inits):
    node = Node("n", [GPU(f"G{i}", i, "A100", 40000) for i in range(4)])
    pod = PodRequest(
        "ns/p", "online",
        tuple(ContainerRequest(f"a{i}", g, m, k) for i, (g, m, k) in enumerate(apps)),
        tuple(ContainerRequest(f"i{i}", g, m, k, init=True) for i, (g, m, k) in enumerate(inits)),
    )  # fmt: skip
    f = fit_general(node, pod)
    if not isinstance(f, Fit):
        return
    c = f.placement.containers
    assert f.charged == pod_charge(
        [holds(c[x.name]) for x in pod.containers], [holds(c[x.name]) for x in pod.init_containers]
    )
    for i, (mem, milli, _) in f.charged.items():
        assert mem <= node.gpus[i].mem_mib and milli <= 1000
        app_mem = sum(s.mem_mib for x in pod.containers for s in c[x.name] if s.gpu_index == i)
        init_mem = max(
            (s.mem_mib for x in pod.init_containers for s in c[x.name] if s.gpu_index == i), default=0
        )
        assert (
            max(app_mem, init_mem)
            <= mem
            <= app_mem + sum(s.mem_mib for x in pod.init_containers for s in c[x.name] if s.gpu_index == i)
        )
