"""The view and the Filter/Score steps over plain objects (no HTTP, no API server)."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from ext_helpers import H100_MIB, assigned, container, node_obj, payloads, pod_obj

from extender.api.wire import ExtenderArgs, WireError
from extender.state.hostuse import pod_host_request
from extender.state.view import ClusterView
from extender.verbs.binding import assignment_from_fit
from extender.verbs.framework import Extender
from gpupack.contract import (
    GPUShare,
    Reservation,
)
from gpupack.core.policies import DEFAULT_POLICY, get_policy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def make(nodes, policy=DEFAULT_POLICY):
    problems = []
    view = ClusterView(on_problem=lambda k, m: problems.append(k))
    view.replace_nodes(nodes)
    view.replace_pods([])
    ext = Extender(view, get_policy(policy), None, clock=lambda: NOW)
    return view, ext, problems


def args(pod, names):
    return ExtenderArgs(pod, names, None)


def usage(view):
    return {
        (n.name, g.index): (g.mem_used, g.milli_used, g.pod_class, g.exclusive)
        for n in view.state.nodes.values()
        for g in n.gpus
        if g.holders
    }


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_pods_filter_and_prioritize(mode):
    from extender.api.wire import parse_extender_args

    view, ext, _ = make([node_obj("gpu-node-a", 2), node_obj("gpu-node-b", 2)])
    for verb, body in payloads(mode):
        if verb == "bind":
            continue
        a = parse_extender_args(body)
        if verb == "filter":
            out = ext.filter(a)
            assert out["NodeNames"] == ["gpu-node-a", "gpu-node-b"], out
            if mode == "nodecache-false":
                assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == out["NodeNames"]
        else:
            scores = ext.prioritize(a)
            assert {s["Host"] for s in scores} == {"gpu-node-a", "gpu-node-b"}
            assert all(0 <= s["Score"] <= 10 and isinstance(s["Score"], int) for s in scores)


def test_filter_reasons_and_unresolvable():
    view, ext, _ = make(
        [node_obj("big", 2), node_obj("small", 1, mem=24576, model="L4"), node_obj("full", 1)]
    )
    view.apply_pod(
        assigned(
            pod_obj("hog", [container("c", 1, 70000)]), "full", {"c": (GPUShare("GPU-full-0", 0, 70000, 0),)}
        )
    )
    out = ext.filter(args(pod_obj("p", [container("c", 1, 40000, 50)]), ["big", "small", "full"]))
    assert out["NodeNames"] == ["big"]
    assert "largest GPU here has 24576 MiB" in out["FailedAndUnresolvableNodes"]["small"]
    assert out["FailedNodes"]["full"] == (
        "no GPU with 40000 MiB free for class online; largest free is 11559 MiB on GPU 0"
    )


def test_online_and_offline_never_share_a_gpu():
    view, ext, _ = make([node_obj("n", 1)])
    view.apply_pod(
        assigned(
            pod_obj("on", [container("c", 1, 1000, 10)]), "n", {"c": (GPUShare("GPU-n-0", 0, 1000, 10),)}
        )
    )
    out = ext.filter(args(pod_obj("off", [container("c", 1, 1000, 10)], cls="offline"), ["n"]))
    assert out["NodeNames"] == [] and "class offline" in out["FailedNodes"]["n"]
    out = ext.filter(args(pod_obj("on2", [container("c", 1, 1000, 10)]), ["n"]))
    assert out["NodeNames"] == ["n"]


def test_pod_the_extender_cannot_serve_is_unresolvable_everywhere():
    """A bad GPU request is the pod's problem, not the request's: every node is unresolvable with the
    reason (the scheduler shows it in the FailedScheduling event), no 4xx the user never sees."""
    _, ext, _ = make([node_obj("n", 1), node_obj("m", 1)])
    cases = [
        (pod_obj("p", [container("c", 1, 100, 150)]), "gpu-sm must be a percent in 1..100, got 150"),
        (pod_obj("p", [container("c", 1, "lots")]), "gpupack.io/gpu-mem"),
        (pod_obj("p", [container("c", 65)]), "gpupack.io/gpu=65 is more GPUs than any node has"),
        # gpu-mem alone: the contract defaults gpu to 1, but only the webhook writes it into the
        # spec; without it the kubelet never calls Allocate and the node's handoff would never end.
        (pod_obj("p", [container("c", None, 100, 10)]), "no container sets gpupack.io/gpu in its limits"),
    ]
    for pod, needle in cases:
        out = ext.filter(args(pod, ["n", "m"]))
        assert out["NodeNames"] == [] and out["FailedNodes"] == {} and out["Error"] == "", out
        why = out["FailedAndUnresolvableNodes"]
        assert set(why) == {"n", "m"} and all(needle in w for w in why.values()), (needle, why)
        assert ext.prioritize(args(pod, ["n", "m"])) == [{"Host": "n", "Score": 0}, {"Host": "m", "Score": 0}]
    # a node list gpupack knows nothing of is the request's problem (or a wrong cluster): 4xx
    with pytest.raises(WireError, match="none of the 1 node"):
        ext.filter(args(pod_obj("p", [container("c", 1, 100)]), ["ghost"]))
    out = ext.filter(args(pod_obj("p", [container("c", 1, 100)]), ["n", "ghost"]))
    assert out["NodeNames"] == ["n"] and "not in gpupack's view" in out["FailedNodes"]["ghost"]


def test_cpu_only_pod_is_placed_by_cpu_and_memory_and_the_policy():
    """A pod without gpupack resources is the policy's too: it fits by CPU/memory (on GPU-less
    nodes as well, which never publish an inventory or slots), and its bind charge, taken before any
    watch has seen it, counts for the next pod at once."""
    plain = node_obj("plain", 1)
    del plain["metadata"]["annotations"]
    plain["status"]["allocatable"].pop("gpupack.io/gpu")
    problems = []
    view = ClusterView(on_problem=lambda k, m: problems.append(k), track_host=True)
    view.replace_nodes([node_obj("g", 1), plain, node_obj("bad", raw_inventory="{not json")])
    view.replace_pods([])
    # CPU kept for GPUs (on by default) would refuse the GPU node below: this test is of the
    # placement by CPU and memory, so the rule is off here (its own test follows)
    ext = Extender(view, get_policy(DEFAULT_POLICY, keep_cpu_for_gpus=False), None, clock=lambda: NOW)

    def cpu_pod(name, cpu):
        c = {"name": "c", "image": "x", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}
        p = pod_obj(name, [c])
        p["metadata"]["uid"] = f"uid-{name}"
        return p

    for i in range(8):  # the policy learns the workload from the pods it is asked about
        w = pod_obj(f"w{i}", [container("c", 1, 1000, 10)])
        w["metadata"]["uid"] = f"uid-w{i}"
        w["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4"}
        assert ext.filter(args(w, ["g"]))["NodeNames"] == ["g"]
    out = ext.filter(args(cpu_pod("p", "40"), ["g", "plain", "bad"]))
    assert out["NodeNames"] == ["g", "plain", "bad"] and out["FailedAndUnresolvableNodes"] == {}, out
    scores = {h["Host"]: h["Score"] for h in ext.prioritize(args(cpu_pod("p", "40"), ["g", "plain"]))}
    # 40 of 64 CPUs on the GPU node would strand its GPU for GPU pods; the GPU-less node loses nothing
    assert scores["plain"] > scores["g"], scores
    view.host.assume("default/p", "uid-p", "plain", pod_host_request(cpu_pod("p", "40")))
    out = ext.filter(args(cpu_pod("q", "40"), ["g", "plain"]))
    assert out["NodeNames"] == ["g"] and out["FailedNodes"]["plain"] == "Insufficient cpu", out
    out = ext.filter(args(cpu_pod("big", "65"), ["g", "plain"]))
    assert out["NodeNames"] == [] and set(out["FailedAndUnresolvableNodes"]) == {"g", "plain"}, out
    # the assigned-pod watch shows it: counted from there, not twice; a failed Binding frees it
    bound = cpu_pod("p", "40")
    bound["spec"]["nodeName"] = "plain"
    view.host.apply_pod(bound)
    assert view.state.nodes["plain"].cpu_used == 40_000 and not view.host.assumed
    view.host.assume("default/r", "uid-r", "g", pod_host_request(cpu_pod("r", "10")))
    assert view.state.nodes["g"].cpu_used == 10_000
    view.host.unassume("default/r", "uid-r")
    assert view.state.nodes["g"].cpu_used == 0
    out = ext.filter(args(cpu_pod("s", "60"), ["g", "plain"]))
    assert out["NodeNames"] == ["g"], out


def test_a_cpu_only_pod_is_kept_off_the_cpu_a_gpu_nodes_free_gpus_need():
    """The shipped policy (CPU kept for GPUs): after GPU pods asking 4 cores for a tenth of a GPU
    (40 cores a GPU), a pod asking 25 of the GPU node's 64 cores would leave its free GPU short of
    them: refused there, unresolvably and with the reason; the GPU-less node takes it. 24 cores
    leave enough."""
    plain = node_obj("plain", 1)
    del plain["metadata"]["annotations"]
    plain["status"]["allocatable"].pop("gpupack.io/gpu")
    view = ClusterView(track_host=True)
    view.replace_nodes([node_obj("g", 1), plain])
    view.replace_pods([])
    ext = Extender(view, get_policy(DEFAULT_POLICY), None, clock=lambda: NOW)
    for i in range(8):  # the policy learns the CPU per GPU from the pods it is asked about
        w = pod_obj(f"w{i}", [container("c", 1, 1000, 10)])
        w["metadata"]["uid"] = f"uid-w{i}"
        w["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4"}
        assert ext.filter(args(w, ["g"]))["NodeNames"] == ["g"]

    def cpu_pod(name, cpu):
        c = {"name": "c", "image": "x", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}
        p = pod_obj(name, [c])
        p["metadata"]["uid"] = f"uid-{name}"
        return p

    out = ext.filter(args(cpu_pod("p", "25"), ["g", "plain"]))
    assert out["NodeNames"] == ["plain"], out
    assert out["FailedAndUnresolvableNodes"]["g"].startswith("node g: its free CPU is kept for its free GPUs")
    assert "(25000m of its 64000m free" in out["FailedAndUnresolvableNodes"]["g"]
    assert ext.filter(args(cpu_pod("q", "24"), ["g", "plain"]))["NodeNames"] == ["g", "plain"]


def test_corrupt_inventory_is_reported_not_fatal():
    view, ext, problems = make([node_obj("ok", 1), node_obj("bad", raw_inventory="{not json")])
    out = ext.filter(args(pod_obj("p", [container("c", 1, 100)]), ["ok", "bad"]))
    assert out["NodeNames"] == ["ok"]
    assert "unreadable" in out["FailedAndUnresolvableNodes"]["bad"]
    assert "corrupt-inventory" in problems


def test_prioritize_normalises_policy_scores_to_0_10():
    view, ext, _ = make([node_obj("used", 2), node_obj("empty", 2)], policy="bestfit")
    view.apply_pod(
        assigned(
            pod_obj("a", [container("c", 1, 20000, 20)]),
            "used",
            {"c": (GPUShare("GPU-used-0", 0, 20000, 20),)},
        )
    )
    scores = {
        s["Host"]: s["Score"]
        for s in ext.prioritize(args(pod_obj("p", [container("c", 1, 20000, 20)]), ["used", "empty"]))
    }
    assert scores == {"used": 10, "empty": 0}


def test_view_rebuild_is_exact_and_deletion_frees():
    nodes = [node_obj("n1", 2), node_obj("n2", 2)]
    pods = [
        assigned(
            pod_obj(
                "batch",
                [container("w", 1, 20000, 50), container("v", 1, 4096)],
                cls="offline",
                init=[container("warm", None, 2048)],
            ),
            "n1",
            {
                "warm": (GPUShare("GPU-n1-0", 0, 2048, 0),),
                "w": (GPUShare("GPU-n1-0", 0, 20000, 50),),
                "v": (GPUShare("GPU-n1-0", 0, 4096, 0),),
            },
        ),
        assigned(
            pod_obj("whole", [container("t", 2)], cls="offline"),
            "n2",
            {
                "t": (
                    GPUShare("GPU-n2-0", 0, H100_MIB, 100, True),
                    GPUShare("GPU-n2-1", 1, H100_MIB, 100, True),
                )
            },
        ),
    ]
    v1, _, _ = make(nodes)
    v1.replace_pods(pods)
    v2 = ClusterView()
    v2.replace_pods(reversed(pods))  # pods before nodes, other order: same result
    v2.replace_nodes(nodes)
    assert usage(v1) == usage(v2)
    assert usage(v1)[("n1", 0)] == (24096, 500, "offline", False)  # init rides: max(2048, 24096)
    assert usage(v1)[("n2", 1)] == (H100_MIB, 1000, "offline", True)
    v1.delete_pod(pods[1])
    assert ("n2", 0) not in usage(v1)
    done = json.loads(json.dumps(pods[0]))
    done["status"]["phase"] = "Succeeded"
    v1.apply_pod(done)
    assert usage(v1) == {}


def test_assumed_pod_survives_stale_events():
    view, ext, _ = make([node_obj("n", 1)])
    pod = pod_obj("p", [container("c", 1, 1000, 10)], uid="u1")
    from gpupack.core.request import parse_pod

    req = parse_pod(pod)
    f = ext.policy.fit(view.state.nodes["n"], req)
    a = assignment_from_fit(view.state.nodes["n"], req, f, NOW)
    view.assume("default/p", "u1", a, frozenset())
    assert view.locks.blocking_handoff("n", "other") is not None
    view.apply_pod(pod)  # an event from before our PATCH: no assignment yet
    assert usage(view)[("n", 0)][0] == 1000
    view.unassume("default/p", "u1", a)
    assert usage(view) == {}
    assert view.locks.blocking_handoff("n", "other") is None


def _resv(node_gpu="GPU-n-0", mem=60000, minutes=5):
    return Reservation(
        id="r1",
        namespace="default",
        owner_kind="ReplicaSet",
        owner_name="web",
        pod_class="online",
        containers={"c": (GPUShare(node_gpu, 0, mem, 50),)},
        expires=(NOW + timedelta(minutes=minutes)).isoformat().replace("+00:00", "Z"),
    )


def test_reservation_holds_capacity_and_steers_its_owner():
    view, ext, _ = make([node_obj("n", 1, reservations=[_resv()]), node_obj("m", 1)])
    other = pod_obj("x", [container("c", 1, 40000, 10)])
    out = ext.filter(args(other, ["n", "m"]))
    assert out["NodeNames"] == ["m"] and "defrag reservation" in out["FailedNodes"]["n"]

    owner = pod_obj("web-abc", [container("c", 1, 60000, 50)], owner=("ReplicaSet", "web"))
    out = ext.filter(args(owner, ["n", "m"]))
    assert out["NodeNames"] == ["n"]
    assert "steered to node n by defrag reservation r1" in out["FailedNodes"]["m"]
    scores = {s["Host"]: s["Score"] for s in ext.prioritize(args(owner, ["n", "m"]))}
    assert scores["n"] == 10

    # consumed by a pod whose assignment names it: holds nothing more, steers nobody
    view.apply_pod(assigned(owner, "n", {"c": (GPUShare("GPU-n-0", 0, 60000, 50),)}, reservation="r1"))
    out = ext.filter(args(pod_obj("y", [container("c", 1, 10000, 10)]), ["n", "m"]))
    assert out["NodeNames"] == ["n", "m"]


def test_expired_reservation_holds_nothing():
    view, ext, _ = make([node_obj("n", 1, reservations=[_resv(minutes=-1)])])
    out = ext.filter(args(pod_obj("x", [container("c", 1, 40000, 10)]), ["n"]))
    assert out["NodeNames"] == ["n"]


def test_filter_cache_sees_changes():
    view, ext, _ = make([node_obj("n", 1)])
    p = pod_obj("p", [container("c", 1, 50000)])
    assert ext.filter(args(p, ["n"]))["NodeNames"] == ["n"]
    view.apply_pod(
        assigned(pod_obj("q", [container("c", 1, 50000)]), "n", {"c": (GPUShare("GPU-n-0", 0, 50000, 0),)})
    )
    assert ext.filter(args(p, ["n"]))["NodeNames"] == []


def test_cli_rejects_bad_flags_in_one_line(capsys, tmp_path):
    from extender.main import main

    assert main(["--policy", "nope", "--webhook-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nope'" in err and err.count("\n") == 1
    assert main(["--webhook-port", "8443"]) == 2
    assert "needs --tls-cert and --tls-key" in capsys.readouterr().err
    assert main(["--tls-cert", str(tmp_path / "c"), "--tls-key", str(tmp_path / "k")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["--threads", "0", "--webhook-port", "0"]) == 2
    assert "--threads must be 1 or more, got 0" in capsys.readouterr().err


def test_learning_batches_in_a_burst():
    """A burst of pods costs few learning flushes (each makes the next filter of every shape score
    all nodes again): the first pod at once, then batches of 3x what was learned, at least
    OBSERVE_MIN_GAP_S apart; every pod is learned once, and with a given workload nothing is."""
    from gpupack.core import learning as fw

    _view, ext, _ = make([node_obj(f"n{i}", 2) for i in range(3)])
    t = [100.0]
    ext.learner.batcher.clock = lambda: t[0]
    learned = ext.policy.workload.counts  # type: ignore[attr-defined]

    def burst(start, k):
        for i in range(start, start + k):
            p = pod_obj(f"b{i}", [container("c", 1, 500, 10)])
            p["metadata"]["uid"] = f"uid-b{i}"
            ext.filter(args(p, ["n0", "n1", "n2"]))
            ext.prioritize(args(p, ["n0", "n1", "n2"]))  # the same pod: not learned twice
            ext.view.locks.expected.clear()  # bound, as kube-scheduler would (no filter waits on it)

    burst(0, 50)  # within one instant: only the first pod is learned
    assert ext.learner.epoch == 1 and sum(learned.values()) == 1
    t[0] += fw.OBSERVE_MIN_GAP_S
    burst(50, 1)  # batch (3) reached and the gap passed: the 50 waiting pods at once
    assert ext.learner.epoch == 2 and sum(learned.values()) == 51
    t[0] += fw.OBSERVE_MIN_GAP_S
    burst(51, 100)  # 51 learned: the next batch is 3 x 51 pods
    assert ext.learner.epoch == 2 and sum(learned.values()) == 51
    t[0] += fw.OBSERVE_FLUSH_S + 1
    burst(151, 1)  # ... or a minute
    assert ext.learner.epoch == 3 and sum(learned.values()) == 152

    _view, fixed, _ = make([node_obj("m", 2)])
    fixed.policy.learn = False  # type: ignore[attr-defined]
    fixed.learner.batcher.clock = lambda: t[0]
    before = dict(fixed.policy.workload.counts)  # type: ignore[attr-defined]
    for i in range(5):
        p = pod_obj(f"f{i}", [container("c", 1, 500, 10)])
        p["metadata"]["uid"] = f"uid-f{i}"
        fixed.filter(args(p, ["m"]))
        t[0] += fw.OBSERVE_FLUSH_S + 1
    assert fixed.learner.epoch == 0 and dict(fixed.policy.workload.counts) == before  # type: ignore[attr-defined]

    # a policy that learns nothing never flushes either (its scores never change)
    _view, plain, _ = make([node_obj("b", 2)], "bestfit")
    plain.learner.batcher.clock = lambda: t[0]
    for i in range(5):
        p = pod_obj(f"g{i}", [container("c", 1, 500, 10)])
        p["metadata"]["uid"] = f"uid-g{i}"
        plain.filter(args(p, ["b"]))
        t[0] += fw.OBSERVE_FLUSH_S + 1
    assert plain.learner.epoch == 0


def test_an_assignment_for_another_pod_or_node_is_not_charged():
    """Issue 31 item 5: a Binding that carried another pod's assignment, or put the pod on another
    node than its assignment's, is not what gpupack placed; the device plugin will not serve it,
    and the view charges nothing for it (it charged the other node's GPU before)."""
    view, _, problems = make([node_obj("a", 1), node_obj("b", 1)])
    share = {"c": (GPUShare("GPU-a-0", 0, 70000, 0),)}
    other_uid = assigned(pod_obj("x", [container("c", 1, 70000)]), "a", share, uid="someone-else")
    other_uid["metadata"]["uid"] = "uid-x"
    wrong_node = assigned(pod_obj("y", [container("c", 1, 70000)]), "a", share)
    wrong_node["spec"]["nodeName"] = "b"
    for pod in (other_uid, wrong_node):
        view.apply_pod(pod)
    assert usage(view) == {} and problems.count("foreign-assignment") == 2
    # the pod's own assignment on its own node is charged as ever
    view.apply_pod(assigned(pod_obj("z", [container("c", 1, 70000)]), "a", share))
    assert usage(view) == {("a", 0): (70000, 0, "online", False)}
