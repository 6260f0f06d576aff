"""The fast replay path must take exactly the decisions the per-node policy code takes."""

import numpy as np
import pytest

from gpupack.simulate.replay import BINS, arrival_order, replay, replay_generic

from .conftest import reduced_pods


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trace", "policy"),
    [
        ("default", "fgd"),
        ("default", "bestfit"),
        ("default", "gpupack"),
        ("gpuspec10", "gpupack"),
        ("gpuspec10", "fgd"),
        # CPU runs short: gpupack rewards removed stranding on some nodes (gpupack_policy.gain).
        ("cpu300", "gpupack"),
        ("gpuspec25", "gpupack"),
    ],
)
def test_fast_path_equals_generic_path(openb, small_cluster, trace, policy):
    pods = reduced_pods(openb, trace)
    fast = replay(small_cluster, pods, policy, 42, keep_decisions=True)
    slow = replay_generic(small_cluster, pods, policy, 42)
    assert len(fast.decisions) == len(slow.decisions) > 400
    mismatch = [i for i, (a, b) in enumerate(zip(fast.decisions, slow.decisions, strict=True)) if a != b]
    assert not mismatch, (
        f"first differing arrival {mismatch[0]}: fast {fast.decisions[mismatch[0]]} generic {slow.decisions[mismatch[0]]}"
    )
    assert fast.curve == slow.curve
    # The replay did real work: some placements and, past full load, some drops.
    assert 0 < fast.placed < fast.arrived


def test_random_policy_places_only_feasible(openb, small_cluster):
    pods = reduced_pods(openb, "default")
    r = replay(small_cluster, pods, "random", 43, keep_decisions=True)
    assert r.placed > 0 and len(r.curve) == BINS


def test_arrival_order_inflates_to_130_percent(openb, small_cluster):
    pods = reduced_pods(openb, "default")
    cap = small_cluster.gpu_capacity
    a = arrival_order(pods, cap, 42)
    b = arrival_order(pods, cap, 42)
    c = arrival_order(pods, cap, 43)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    req = pods.gpu_request
    total = int(req[a].sum())
    assert total <= 1.3 * cap
    # Every original pod arrives once before the copies.
    assert sorted(a[: len(pods)].tolist()) == list(range(len(pods)))
    # Stopped at the first draw that would pass 130%: no pod could have been one more arrival and
    # the largest request would pass the limit.
    assert total + req.max() > 1.3 * cap


def test_arrival_order_trims_a_trace_above_130_percent(openb, small_cluster):
    pods = reduced_pods(openb, "default", step=2)  # ~4,000 pods on ~51 nodes: far above 130%
    cap = small_cluster.gpu_capacity
    a = arrival_order(pods, cap, 42)
    assert len(a) < len(pods)
    assert int(pods.gpu_request[a].sum()) <= 1.3 * cap


@pytest.mark.slow
def test_gpupack_beats_fgd_on_reduced_default_trace(openb, small_cluster):
    pods = reduced_pods(openb, "default", step=10)
    seeds = (42, 43, 44)
    fgd = np.mean([replay(small_cluster, pods, "fgd", s).unallocated_pct_at_100 for s in seeds])
    ours = np.mean([replay(small_cluster, pods, "gpupack", s).unallocated_pct_at_100 for s in seeds])
    assert ours < fgd, (ours, fgd)
