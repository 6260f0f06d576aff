"""The published simulator's FGD and BestFit rules that decide the model-constrained openb traces."""

from collections import Counter

import numpy as np

from gpupack.core.fgd import frag
from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policies import MAX_SPEC_CPU, MAX_SPEC_GPU, bestfit_score, get_policy, schedule
from gpupack.core.workload import Shape, Workload
from gpupack.simulate.openb import PodList
from gpupack.simulate.replay import trace_workload


def test_a_node_a_shape_may_not_use_counts_all_its_free_milli_as_fragment():
    t4_only = Shape(1000, 1, 500, 0, frozenset({"T4"}))
    frees = [1000, 300]
    # On a T4 node the shape fits one GPU: only the 300-milli GPU is fragment.
    assert frag(frees, 10_000, "T4", [t4_only], [2]) == 2 * 300
    # On a node of another model the shape has "no access": everything free is fragment.
    assert frag(frees, 10_000, "G2", [t4_only], [2]) == 2 * 1300


def test_fgd_prefers_the_model_constrained_pods_cannot_use():
    # Most pods may only use T4; an unconstrained pod should go to the G2 node and keep T4 whole.
    wl = Workload.of([Shape(0, 1, 500, 0, frozenset({"T4"}))] * 9 + [Shape(0, 1, 500)])
    p = get_policy("fgd", workload=wl)
    st = ClusterState()
    st.add_node(Node("t4", [GPU(f"t4-{i}", i, "T4", 15109) for i in range(2)]))
    st.add_node(Node("g2", [GPU(f"g2-{i}", i, "G2", 32510) for i in range(2)]))
    d = schedule(st, PodRequest("ns/p", "online", (ContainerRequest("c", 1, None, 300),)), p)
    assert d.node == "g2"


def test_kept_is_the_typical_shapes_weight_that_scales_the_score():
    wl = Workload(Counter({Shape(0, 1, 500): 90, Shape(0, 1, 1000): 6, Shape(0, 1, 250): 4}))
    shapes, weights = wl.typical()
    assert len(shapes) == 2 and wl.total == 100 and wl.kept == 96 == sum(weights)


def _pods(rows):
    cpu, num, milli, spec = zip(*rows, strict=True)
    sets = [frozenset(x for x in s.split("|") if x) or None for s in spec]
    n = len(rows)
    return PodList(
        [f"p{i}" for i in range(n)],
        np.array(cpu),
        np.zeros(n, np.int64),
        np.array(num),
        np.array(milli),
        sets,
        list(spec),
    )


def test_trace_workload_keys_shapes_by_spec_text_and_ranks_ties_by_resources():
    pods = _pods(
        [(4000, 1, 500, "V100M16|V100M32")] * 2
        + [(4000, 1, 500, "V100M16|V100M32|V100M32")] * 2
        + [(8000, 1, 1000, "")] * 2
        + [(2000, 0, 0, "")] * 3
    )
    wl = trace_workload(pods, coverage=1.0)
    shapes, weights = wl.typical()
    # Same allowed set, different text: two shapes, as the published simulator keys them.
    assert len(shapes) == 4 and weights == (3, 2, 2, 2)
    # Equal counts: larger CPU first, then (same CPU, milli, count) the larger spec text.
    assert [s.spec for s in shapes[1:]] == ["", "V100M16|V100M32|V100M32", "V100M16|V100M32"]
    assert shapes[1].cpu_milli == 8000


def test_bestfit_measures_leftover_against_the_largest_node_spec():
    # 64 of 128 cores and 2 of 8 GPUs left: 1 - (0.25 + 0.125) = 0.625.
    assert bestfit_score(2 * 1000, 64_000) == 62
    assert MAX_SPEC_CPU == 128_000 and MAX_SPEC_GPU == 8000
    # A small node nearly empty is NOT a better fit than a big node nearly empty with the same
    # leftover: the published score compares absolute leftovers.
    assert bestfit_score(1000, 8000) > bestfit_score(4000, 64_000)
