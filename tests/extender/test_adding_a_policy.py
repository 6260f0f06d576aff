"""Adding a policy is one module (tests/policy_tightest_node.py) and one registry entry: the
extender selects and runs it by name, and the simulator replays it with its own vectorised scorer,
taking the decisions its per-node code takes (docs/architecture.md, "Adding a policy")."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest
from ext_helpers import container, node_obj, pod_obj
from policy_tightest_node import SPEC, TightestNodePolicy

from extender.api.wire import ExtenderArgs
from extender.main import make_policy
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.core import policies
from gpupack.simulate import cli as simulate_cli
from gpupack.simulate.openb import NodeList, PodList
from gpupack.simulate.replay import NotReplayable, replay, replay_generic


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, SPEC.name, SPEC)
    return SPEC


def test_the_extender_selects_and_runs_a_registered_policy(registered):
    policy = make_policy(argparse.Namespace(policy="tightest-node", filter_keep_best=0, workload_file=None,
                                            policy_seed=0))  # fmt: skip
    assert isinstance(policy, TightestNodePolicy) and not policy.learn
    view = ClusterView(on_problem=lambda k, m: None)
    view.replace_nodes([node_obj("big", 8), node_obj("small", 2)])
    view.replace_pods([])
    ext = Extender(view, policy, None)
    pod = pod_obj("p", [container("main", gpu=1)])
    names = ["big", "small"]
    assert ext.filter(ExtenderArgs(pod, names, None))["NodeNames"] == names
    # the node left tightest scores highest
    assert ext.prioritize(ExtenderArgs(pod, names, None)) == [
        {"Host": "big", "Score": 0},
        {"Host": "small", "Score": 10},
    ]


def _cluster() -> tuple[NodeList, PodList]:
    """24 nodes of 1, 2, 4 and 8 GPUs, and 300 pods of shares, whole GPUs and CPU only."""
    rng = np.random.default_rng(5)
    n = 24
    nodes = NodeList([f"n{i}" for i in range(n)], np.full(n, 96_000, np.int64), np.full(n, 400_000, np.int64),
                     np.array([(1, 2, 4, 8)[i % 4] for i in range(n)], np.int64), ["V100M32"] * n)  # fmt: skip
    m = 300
    num = rng.choice([0, 1, 1, 1, 2, 4], m)
    milli = np.where(num == 1, rng.choice([250, 500, 1000], m), 1000) * (num > 0)
    pods = PodList([f"p{i}" for i in range(m)], rng.integers(1000, 16_000, m), rng.integers(1000, 60_000, m),
                   num.astype(np.int64), milli.astype(np.int64), [None] * m)  # fmt: skip
    return nodes, pods


def test_the_simulator_replays_a_registered_policy_as_its_per_node_code(registered):
    nodes, pods = _cluster()
    fast = replay(nodes, pods, "tightest-node", 42, keep_decisions=True)
    slow = replay_generic(nodes, pods, "tightest-node", 42)
    assert fast.decisions == slow.decisions and fast.curve == slow.curve
    assert 0 < fast.placed < fast.arrived
    # and it is not the random draw the replay once stood in for a policy it could not score
    assert fast.decisions != replay(nodes, pods, "random", 42, keep_decisions=True).decisions


def test_the_simulator_refuses_a_policy_it_cannot_replay(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(policies.POLICIES, SPEC.name, replace(SPEC, fast_scorer=None))
    nodes, pods = _cluster()
    with pytest.raises(NotReplayable, match="no vectorised scorer"):
        replay(nodes, pods, "tightest-node", 42)
    node_csv, pod_csv = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    node_csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,400000,2,V100M32\n")
    pod_csv.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1000,1,500\n")
    rc = simulate_cli.main(["--trace", str(pod_csv), "--nodes", str(node_csv), "--policy", "tightest-node",
                            "--seeds", "1", "--jobs", "1", "--no-chart"])  # fmt: skip
    assert rc == 2
    assert "'tightest-node' cannot be replayed faithfully" in capsys.readouterr().err
