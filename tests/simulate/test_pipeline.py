"""The simulator's pipeline mode (gpupack.simulate.pipeline): where it must equal the default replay,
and kube-scheduler v1.28's arithmetic it relies on. The real cluster is checked against it in
tests/e2e/test_replay_realk8s.py."""

from __future__ import annotations

import pytest

from gpupack.simulate.modes import replay_mode
from gpupack.simulate.pipeline import PipelineConfig, follow_pipeline, num_feasible_nodes_to_find
from gpupack.simulate.replay import arrival_order

from .conftest import reduced_pods


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["gpupack", "fgd", "bestfit"])
def test_a_pipeline_where_the_policy_decides_everything_is_the_default_replay(openb, small_cluster, policy):
    """Every pod through the extender, which is given the workload, sees CPU, passes only its best
    node with the simulator's seed, and kube-scheduler shows it every node: nothing is left for
    kube-scheduler to decide, so every decision is the default replay's."""
    pods = reduced_pods(openb, "default")
    seed = 7
    order = arrival_order(pods, small_cluster.gpu_capacity, seed)
    cfg = dict(cpu_pods_via_extender=True, learn_workload=False, filter_keep_best=1,
               percentage_of_nodes_to_score=100, extender_seed=seed)  # fmt: skip
    want = replay_mode("default", small_cluster, pods, policy, seed, order)
    got = replay_mode("pipeline", small_cluster, pods, policy, seed, order, **cfg)
    assert got.decisions == want.decisions
    assert got.unallocated_pct_at_100 == want.unallocated_pct_at_100


@pytest.mark.slow
def test_the_shipped_pipeline_differs_where_it_must(openb, small_cluster):
    """CPU-only pods placed by kube-scheduler's default scores (and the extender learning the
    workload) change decisions, some by kube-scheduler's random draw; forced along its own free run,
    the pipeline finds every decision among its equal best, with the same GPUs."""
    pods = reduced_pods(openb, "default")
    order = arrival_order(pods, small_cluster.gpu_capacity, 3)
    default = replay_mode("default", small_cluster, pods, "gpupack", 3, order)
    pipe = replay_mode("pipeline", small_cluster, pods, "gpupack", 3, order)
    assert pipe.decisions != default.decisions and pipe.tied
    follow = follow_pipeline(small_cluster, pods, "gpupack", order, pipe.decisions, config=PipelineConfig())
    assert len(follow) == len(order)
    assert all((n < 0 and not best) or (n in best and g == fg) for (n, g), (best, fg) in
               zip(pipe.decisions, follow, strict=True))  # fmt: skip


@pytest.mark.parametrize(
    ("percentage", "nodes", "want"),
    [
        (0, 50, 50),
        (0, 150, 100),
        (0, 1000, 420),
        (0, 6000, 300),
        (100, 1000, 1000),
        (10, 5000, 500),
        (10, 500, 100),
    ],
)
def test_num_feasible_nodes_to_find_is_kube_schedulers(percentage, nodes, want):
    # 1000 nodes: 50 - 1000/125 = 42 %; 6000: 50 - 48 = 2 %, floored at 5 % = 300
    assert num_feasible_nodes_to_find(percentage, nodes) == want
