"""Host CPU/memory in the extender's view, `--filter-keep-best` against the simulator's schedule(),
and the workload file: over plain objects (no HTTP, no API server; the real-cluster counterparts
are in test_extender_keep_best.py)."""

import json
import random
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from ext_helpers import H100_MIB, container, node_obj, pod_obj

from extender.api.wire import ExtenderArgs
from extender.main import build_parser, make_policy
from extender.state.hostuse import HostUse, pod_host_request
from extender.state.view import ClusterView
from extender.verbs.binding import assignment_from_fit
from extender.verbs.config import ExtenderConfig
from extender.verbs.framework import Extender
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, HANDOFF_DONE
from gpupack.core.fgd import Shape, Workload, WorkloadError, workload_from_json, workload_to_json
from gpupack.core.fit import Fit
from gpupack.core.policies import get_policy, schedule

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
GI = 1024**3
REPO = Path(__file__).resolve().parents[2]


def res(cpu=None, mem=None, limits=False):
    r = {k: v for k, v in (("cpu", cpu), ("memory", mem)) if v is not None}
    return {"resources": {"limits" if limits else "requests": r}}


def host_pod(name, node, containers, init=(), phase="Running", uid=None, ns="h", overhead=None):
    spec = {
        "nodeName": node,
        "containers": [{"name": f"c{i}", **c} for i, c in enumerate(containers)],
        "initContainers": [{"name": f"i{i}", **c} for i, c in enumerate(init)],
    }
    if overhead:
        spec["overhead"] = overhead
    return {
        "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}"},
        "spec": spec,
        "status": {"phase": phase},
    }


def sized_node(name, cpu="16", memory="64Gi", n=8, mem=H100_MIB, model="NVIDIA-H100-80GB-HBM3"):
    obj = node_obj(name, n, mem, model)
    obj["status"]["allocatable"].update(cpu=cpu, memory=memory)
    return obj


def test_pod_request_is_kube_schedulers():
    # app containers add up; a larger init container wins per resource; limits stand in for a
    # missing request (API defaulting); overhead is added on top; sidecars run beside everything
    p = host_pod("a", "n", [res("500m", "1Gi"), res("1", limits=True)], init=[res("3", "100Mi")],
                 overhead={"cpu": "100m", "memory": "64Mi"})  # fmt: skip
    assert pod_host_request(p) == HostUse(3100, GI + 64 * 2**20)
    side = {"restartPolicy": "Always", **res("1", "1Gi")}
    p = host_pod("b", "n", [res("2", "1Gi")], init=[side, res("2500m", "512Mi")])
    # max(app 2 + sidecar 1, init 2.5 + sidecar 1) CPU; max(1 + 1, 0.5 + 1) GiB
    assert pod_host_request(p) == HostUse(3500, 2 * GI)
    assert pod_host_request(host_pod("c", "n", [{}])) == HostUse(0, 0)
    # CPU rounds up to whole milli, as kube-scheduler's MilliValue does
    assert pod_host_request(host_pod("d", "n", [res("1.0001")])) == HostUse(1001, 0)


def test_node_cpu_and_memory_follow_every_assigned_pod():
    view = ClusterView(track_host=True)
    view.replace_nodes([sized_node("n1")])
    node = view.state.nodes["n1"]
    assert (node.cpu_milli, node.ram_mib, node.cpu_used, node.ram_used) == (16000, 65536, 0, 0)
    v0 = view.version("n1")
    a = host_pod("a", "n1", [res("2", "4Gi")], init=[res("5", "1Gi")])
    b = host_pod("b", "n1", [res("250m", "100Mi"), res("250m", "100Mi")])
    view.host.replace_pages([[a, b]])
    assert (node.cpu_used, node.ram_used) == (5500, 4096 + 200)
    assert view.version("n1") > v0  # cached fits and scores of the node are stale now
    # status-only updates change nothing; a pod that ends, or goes, frees its share
    v1 = view.version("n1")
    view.host.apply_pod(a)
    assert view.version("n1") == v1
    view.host.apply_pod({**a, "status": {"phase": "Succeeded"}})
    assert (node.cpu_used, node.ram_used) == (500, 200)
    view.host.delete_pod(b)
    assert (node.cpu_used, node.ram_used) == (0, 0)
    # a relist drops what is missing from it; a pod on a node not known yet counts once it appears
    view.host.apply_pod(b)
    view.host.apply_pod(host_pod("c", "n2", [res("1")]))
    view.host.replace_pages([[host_pod("c", "n2", [res("1")])]])
    assert node.cpu_used == 0
    view.apply_node(sized_node("n2", cpu="4"))
    assert view.state.nodes["n2"].cpu_used == 1000
    # allocatable follows the node; an inventory change (rebuild) keeps the count
    view.apply_node(sized_node("n2", cpu="6"))
    assert view.state.nodes["n2"].cpu_milli == 6000
    view.apply_node(sized_node("n2", cpu="6", n=4))
    assert (view.state.nodes["n2"].cpu_milli, view.state.nodes["n2"].cpu_used) == (6000, 1000)


def test_a_bound_gpupack_pod_is_charged_once_from_assume_to_deletion():
    view = ClusterView(track_host=True)
    view.replace_nodes([sized_node("n1")])
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW)
    pod = pod_obj("g", [container("c", gpu=1, mem=1000, sm=20)], namespace="h", uid="uid-g")
    pod["spec"]["containers"][0]["resources"]["requests"].update(cpu="3", memory="2Gi")
    req = ext.pod_request(pod)
    assert (req.cpu_milli, req.ram_mib) == (3000, 2048)
    f = ext.policy.fit(view.state.nodes["n1"], req)
    assert isinstance(f, Fit)
    a = assignment_from_fit(view.state.nodes["n1"], req, f, NOW)
    node = view.state.nodes["n1"]
    view.assume("h/g", "uid-g", a, frozenset(), 1, pod_host_request(pod))
    assert (node.cpu_used, node.ram_used) == (3000, 2048)  # before any watch has seen it
    bound = json.loads(json.dumps(pod))
    bound["spec"]["nodeName"] = "n1"
    view.host.apply_pod(bound)  # the assigned-pod watch shows it: still once
    assert (node.cpu_used, node.ram_used) == (3000, 2048)
    view.apply_pod({**bound, "metadata": {**bound["metadata"], "annotations": {ANN_ASSIGNMENT: a.to_json()}}})
    assert node.cpu_used == 3000
    view.host.delete_pod(bound)  # the assigned-pod watch first: the gpupack record still holds it
    assert node.cpu_used == 3000
    view.delete_pod(bound)
    assert (node.cpu_used, node.ram_used) == (0, 0)
    # a bind rolled back before any watch saw it gives its share back
    view.assume("h/g", "uid-g", a, frozenset(), 1, pod_host_request(pod))
    assert node.cpu_used == 3000
    view.unassume("h/g", "uid-g", a)
    assert node.cpu_used == 0


def test_filter_refuses_a_node_without_the_cpu_and_the_view_off_ignores_it():
    pod = pod_obj("g", [container("c", gpu=1, mem=1000, sm=20)], namespace="h", uid="uid-g")
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "4"
    for track, passed in ((True, ["roomy"]), (False, ["busy", "roomy"])):
        view = ClusterView(track_host=track)
        view.replace_nodes([sized_node("busy", cpu="8"), sized_node("roomy", cpu="8")])
        view.host.replace_pages([[host_pod("hog", "busy", [res("6")])]])
        ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW)
        out = ext.filter(ExtenderArgs(pod, ["busy", "roomy"], None))
        assert out["NodeNames"] == passed, out
        if track:
            assert out["FailedNodes"]["busy"] == "Insufficient cpu"


def test_pod_request_counts_ephemeral_storage_hugepages_and_extended_resources_but_not_gpupacks():
    big = {
        "resources": {
            "requests": {"ephemeral-storage": "1Gi", "hugepages-2Mi": "4Mi", "example.com/nic": "1"},
            "limits": {"example.com/nic": "1", "gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "1000"},
        }
    }
    init = {"resources": {"limits": {"example.com/nic": "3", "ephemeral-storage": "512Mi"}}}
    p = host_pod("e", "n", [big, big], init=[init], overhead={"cpu": "10m"})
    # per resource: max(two app containers, the init container), then the overhead
    assert pod_host_request(p) == HostUse(
        10, 0, 2 * GI, (("example.com/nic", 3), ("hugepages-2Mi", 8 * 2**20))
    )


def node_with(name, **alloc):
    obj = sized_node(name)
    obj["status"]["allocatable"].update(alloc)
    return obj


def filter_on(view, pod, names):
    return Extender(view, get_policy("gpupack"), None, clock=lambda: NOW).filter(
        ExtenderArgs(pod, names, None)
    )


def test_filter_checks_what_kube_schedulers_node_resources_fit_would():
    """The shipped profile turns NodeResourcesFit's Filter off: the extender refuses a node for
    every resource kube-scheduler would, in its words, and a request beyond the node's allocatable
    as unresolvable."""
    view = ClusterView(track_host=True)
    view.replace_nodes(
        [node_with("full", pods="2"), node_with("nic", **{"example.com/nic": "2"}), node_with("plain")]
    )
    cpu_only = {"resources": {"requests": {"cpu": "1"}}}
    view.host.replace_pages([[host_pod("a", "full", [{}]), host_pod("b", "full", [{}]),
                                  host_pod("c", "nic", [{"resources": {"requests": {"example.com/nic": "1"}}}])]])  # fmt: skip
    out = filter_on(view, host_pod("p", "", [cpu_only], uid="uid-p"), ["full", "nic", "plain"])
    # a pod that requests nothing still takes a pod slot
    assert out["FailedNodes"] == {"full": "Too many pods"} and out["NodeNames"] == ["nic", "plain"], out
    two = {"resources": {"requests": {"example.com/nic": "2"}}}
    out = filter_on(view, host_pod("q", "", [two], uid="uid-q"), ["full", "nic", "plain"])
    assert out["NodeNames"] == [], out
    assert out["FailedNodes"] == {"nic": "Insufficient example.com/nic"}, out
    # the nodes without the resource at all, or with too few pod slots in all, can never take it;
    # every short resource is named
    assert out["FailedAndUnresolvableNodes"] == {
        "full": "Too many pods, Insufficient example.com/nic",
        "plain": "Insufficient example.com/nic",
    }, out
    disk = {"resources": {"requests": {"ephemeral-storage": "60Gi", "memory": "1Gi"}}}
    view.replace_nodes(
        [
            node_with("nic", **{"ephemeral-storage": "100Gi"}),
            node_with("plain", **{"ephemeral-storage": "50Gi"}),
        ]
    )
    view.host.apply_pod(host_pod("d", "nic", [disk]))
    out = filter_on(view, host_pod("r", "", [disk], uid="uid-r"), ["nic", "plain"])
    assert out["FailedNodes"] == {"nic": "Insufficient ephemeral-storage"}, out
    assert out["FailedAndUnresolvableNodes"] == {"plain": "Insufficient ephemeral-storage"}, out


def test_a_pod_that_requests_nothing_changes_the_answer_of_its_node():
    """A pod slot taken or freed must reach cached answers: the node's version moves with it."""
    view = ClusterView(track_host=True)
    view.replace_nodes([node_with("n", pods="1")])
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW)
    pod = host_pod("p", "", [{"resources": {"requests": {"cpu": "1"}}}], uid="uid-p")
    assert ext.filter(ExtenderArgs(pod, ["n"], None))["NodeNames"] == ["n"]
    other = host_pod("o", "n", [{}])
    view.host.apply_pod(other)
    assert ext.filter(ExtenderArgs(pod, ["n"], None))["FailedNodes"] == {"n": "Too many pods"}
    view.host.delete_pod(other)
    assert ext.filter(ExtenderArgs(pod, ["n"], None))["NodeNames"] == ["n"]


WORKLOAD = Workload.of(
    [Shape(4000, 1, 300)] * 6
    + [Shape(8000, 1, 1000)] * 3
    + [Shape(16000, 2, 1000)] * 2
    + [Shape(2000, 1, 500)] * 4
)


def _random_cluster(rng: random.Random, even: bool = False) -> list[dict]:
    """10 nodes of random sizes; `even`: 20 nodes of two kinds, so that many are in the same state
    (the extender fits and scores each state once) until the pods tell them apart."""
    if even:
        return [sized_node(f"n{i:02d}", cpu="32" if i % 3 else "64", n=4, memory="256Gi") for i in range(20)]
    out = []
    for i in range(10):
        n = rng.choice([2, 4, 8])
        out.append(sized_node(f"n{i:02d}", cpu=str(rng.choice([16, 32, 64, 96])), n=n, memory="256Gi"))
    return out


def _random_pod(rng: random.Random, i: int) -> dict:
    shape = rng.choice([(1, 300), (1, 500), (1, None), (2, None), (1, 700)])
    c = container(
        "c",
        gpu=shape[0],
        mem=None if shape[1] is None else 8000,
        sm=None if shape[1] is None else shape[1] // 10,
    )
    c["resources"]["requests"]["cpu"] = str(rng.choice([1, 2, 4, 8, 12]))
    return pod_obj(f"p{i}", [c], namespace="h", uid=f"uid-p{i}")


@pytest.mark.parametrize("seed,even", [(1, False), (2, False), (3, False), (4, True), (5, True)])
def test_filter_keep_best_passes_exactly_schedules_node_and_the_bind_its_gpus(seed, even):
    rng = random.Random(seed)
    view = ClusterView(track_host=True)
    view.replace_nodes(_random_cluster(rng, even))
    view.replace_pods([])
    # CPU-only pods of other schedulers: the stranding term must see them
    view.host.replace_pages([[host_pod(f"cpu{i}", f"n{rng.randrange(10):02d}", [res(str(rng.choice([4, 8, 12])))])
                                  for i in range(8 if not even else 3)]])  # fmt: skip
    ext = Extender(
        view,
        get_policy("gpupack", seed=7, workload=WORKLOAD),
        None,
        clock=lambda: NOW,
        config=ExtenderConfig(keep_best=1),
    )
    sim = get_policy("gpupack", seed=7, workload=WORKLOAD)
    names = sorted(view.nodes)
    rng.shuffle(names)  # kube-scheduler's order of the feasible nodes is its own
    placed = 0
    for i in range(40):
        pod = _random_pod(rng, i)
        req = ext.pod_request(pod)
        if even and i % 7 == 6:
            ext.learner.batcher.flushes += (
                1  # as after a learning flush: every node of every shape is scored again
            )
        want = schedule(view.state.clone(), req, sim, commit=False)
        out = ext.filter(ExtenderArgs(pod, names, None))
        if want.node is None:
            assert out["NodeNames"] == [], out
            continue
        assert out["NodeNames"] == [want.node], (i, out["NodeNames"], want.node)
        # the other fitting nodes are left out without a reason; the nodes it does not fit keep theirs
        reasons = {**out["FailedNodes"], **out["FailedAndUnresolvableNodes"]}
        assert set(reasons) == set(want.failures), (i, reasons, want.failures)
        # the bind fits again on the chosen node: the same GPUs as the simulator's
        f, _ = ext.placements.node_fit(want.node, req, NOW, None)
        assert isinstance(f, Fit) and want.fit is not None
        assert f.charged == want.fit.charged and f.placement.containers == want.fit.placement.containers
        a = assignment_from_fit(view.state.nodes[want.node], req, f, NOW)
        view.assume(req.key, req.uid, a, frozenset(), 1, pod_host_request(pod))
        view.locks.inflight.discard(req.key)
        view.locks.expected.clear()  # the bind has arrived (BindLocks.claim drops it)
        bound = json.loads(json.dumps(pod))
        bound["spec"]["nodeName"] = want.node
        bound["metadata"]["annotations"] = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
        view.apply_pod(bound)  # bound, its handoff done (the next pod's filter is not steered off)
        placed += 1
    assert placed >= 15  # the cluster filled up: ties and CPU limits were exercised


def test_nodes_in_the_same_state_but_without_free_slots_never_pass():
    # the GPUs of "dry" are as free as every other node's, but its kubelet has no gpupack.io/gpu
    # slot left to give: nodes in the same GPU state are fitted and scored once, and that must
    # never carry over to it
    nodes = [sized_node(f"n{i}") for i in range(6)]
    nodes[0]["metadata"]["name"] = "dry"
    nodes[0]["status"]["allocatable"]["gpupack.io/gpu"] = "0"
    view = ClusterView(track_host=True)
    view.replace_nodes(nodes)
    names = [n["metadata"]["name"] for n in nodes]
    ext = Extender(
        view,
        get_policy("gpupack", workload=WORKLOAD),
        None,
        clock=lambda: NOW,
        config=ExtenderConfig(keep_best=1),
    )
    for i in range(4):
        ext.learner.batcher.flushes += i % 2  # the full rescoring path too
        pod = pod_obj(f"g{i}", [container("c", gpu=1, mem=1000, sm=20)], namespace="h", uid=f"uid-g{i}")
        out = ext.filter(ExtenderArgs(pod, names, None))
        assert out["NodeNames"] and out["NodeNames"] != ["dry"], out
        assert "slot" in out["FailedNodes"]["dry"], out["FailedNodes"]
        ext.filtering.keep_best = 0
        assert "dry" not in ext.filter(ExtenderArgs(pod, names, None))["NodeNames"]
        ext.filtering.keep_best = 1


@pytest.mark.parametrize("keep_best", [0, 1])
def test_filter_steers_the_next_pod_off_a_node_another_pod_is_being_bound_to(keep_best):
    view = ClusterView(track_host=True)
    view.replace_nodes([sized_node("a"), sized_node("b")])
    ext = Extender(
        view,
        get_policy("gpupack", workload=WORKLOAD),
        None,
        clock=lambda: NOW,
        config=ExtenderConfig(keep_best=keep_best),
    )

    def pod(i: int) -> dict:
        return pod_obj(f"g{i}", [container("c", gpu=1, mem=1000, sm=20)], namespace="h", uid=f"uid-g{i}")

    first = ext.filter(ExtenderArgs(pod(1), ["a", "b"], None))["NodeNames"]
    view.locks.claim(first[0], "h/g1", "uid-g1")  # its bind has come: the node is locked until it ends
    out = ext.filter(ExtenderArgs(pod(2), ["a", "b"], None))
    other = "b" if first[0] == "a" else "a"
    assert out["NodeNames"] == [other], out
    assert "is being bound there" in out["FailedNodes"][first[0]]
    # with no other node that fits, a node whose bind holds nothing yet is not answered: a fit
    # there could be refused by that bind (an Error, which kube-scheduler retries)
    out = ext.filter(ExtenderArgs(pod(3), [first[0]], None))
    assert out["NodeNames"] == [] and "try again" in out["Error"], out
    # once the bind holds its room (binding.py: at its arrival, when its filter is remembered),
    # the locked node is answered: the bind waits its turn
    view.locks.settle_claim("h/g1")
    out = ext.filter(ExtenderArgs(pod(3), [first[0]], None))
    assert out["NodeNames"] == [first[0]] and out["FailedNodes"] == {}, out
    view.locks.unclaim(first[0], "h/g1")
    view.locks.expected.clear()  # and the binds the filters above expect have come and gone
    assert first[0] in ext.filter(ExtenderArgs(pod(4), ["a", "b"], None))["NodeNames"]


def test_filter_keep_best_zero_passes_every_fitting_node():
    view = ClusterView(track_host=True)
    view.replace_nodes([sized_node("a"), sized_node("b"), sized_node("c")])
    ext = Extender(view, get_policy("gpupack"), None, clock=lambda: NOW)
    pod = pod_obj("g", [container("c", gpu=1, mem=1000, sm=20)], namespace="h", uid="uid-g")
    assert ext.filter(ExtenderArgs(pod, ["a", "b", "c"], None))["NodeNames"] == ["a", "b", "c"]
    ext.filtering.keep_best = 2
    out = ext.filter(ExtenderArgs(pod, ["a", "b", "c"], None))
    # the third fits too: it is left out, with no reason (kube-scheduler would never show it)
    assert len(out["NodeNames"]) == 2 and out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}


def test_workload_round_trips_and_keeps_its_order():
    wl = Workload.of(
        [Shape(1000, 1, 500, 0, frozenset({"A", "B"}), "online", "A|B")] * 2 + [Shape(2000, 2, 1000)] * 2
    )
    back = workload_from_json(json.loads(json.dumps(workload_to_json(wl))))
    assert list(back.counts.items()) == list(wl.counts.items())
    assert back.typical() == wl.typical() and back.coverage == wl.coverage


@pytest.mark.parametrize(
    "doc,message",
    [
        ([], "expected a JSON object"),
        ({"format": "x", "shapes": []}, "format: expected 'gpupack.io/workload/v1'"),
        ({"format": "gpupack.io/workload/v1", "shapes": []}, "shapes: expected a non-empty list"),
        ({"format": "gpupack.io/workload/v1", "shapes": [{"count": 1, "cpu_milli": 1, "gpus": "1", "milli": 5}]},
         "shapes[0].gpus: expected a whole number, got '1'"),
        ({"format": "gpupack.io/workload/v1", "shapes": [{"count": 1, "cpu_milli": 1, "gpus": 1, "milli": 1500}]},
         "shapes[0].milli: 1500 is out of range (0..1000)"),
        ({"format": "gpupack.io/workload/v1", "shapes": [{"count": 1, "cpu_milli": 1, "gpus": 1, "mili": 5}]},
         "shapes[0]: unknown field(s) mili"),
        ({"format": "gpupack.io/workload/v1", "shapes": [{"count": 1, "cpu_milli": 1, "gpus": 1, "milli": 5}] * 2},
         "shapes[1]: the same shape as shapes[0]"),
        ({"format": "gpupack.io/workload/v1", "coverage": 2, "shapes": []}, "coverage: expected a number in (0, 1]"),
    ],
)  # fmt: skip
def test_workload_errors_name_the_field(doc, message):
    with pytest.raises(WorkloadError) as e:
        workload_from_json(doc)
    assert message in str(e.value)


@pytest.mark.slow
def test_extender_cli_refuses_a_bad_workload_file_in_one_line(tmp_path):
    bad = tmp_path / "w.json"
    cases = [
        ("{not json", "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ('{"format": "gpupack.io/workload/v1", "shapes": [{"count": 0, "cpu_milli": 1, "gpus": 1, "milli": 5}]}',
         "shapes[0].count: 0 is out of range (>= 1)"),
    ]  # fmt: skip
    for text, message in cases:
        bad.write_text(text)
        r = subprocess.run(
            [sys.executable, "-m", "extender.main", "--webhook-port", "0", "--workload-file", str(bad)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 2, r
        assert r.stderr.strip() == f"gpupack extender: --workload-file {bad}: {message}", r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "extender.main", "--webhook-port", "0", "--workload-file", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2 and "cannot read it: No such file or directory" in r.stderr, r.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(workload_to_json(WORKLOAD)))
    args = build_parser().parse_args(["--policy", "random", "--workload-file", str(good)])
    with pytest.raises(ValueError, match="policy random does not use a workload"):
        make_policy(args)
    policy = make_policy(build_parser().parse_args(["--workload-file", str(good), "--policy-seed", "42"]))
    assert policy.workload.counts == WORKLOAD.counts and not policy.learn  # type: ignore[attr-defined]


def test_a_pod_asking_for_no_gpu_is_refused_where_its_cpu_would_strand_gpus():
    """--keep-cpu-for-gpus (on by default): a CPU-only pod passes the GPU node whose CPU is to
    spare and the node without GPUs, and is refused, unresolvably and with the reason, on the GPU
    node whose CPU its GPUs need (the GPU pods seen ask 8 cores a GPU)."""
    wl = Workload.of([Shape(8000, 1, 1000)] * 5)
    view = ClusterView(track_host=True)
    view.replace_nodes([sized_node("tight", cpu="16", n=2), sized_node("spare", cpu="32", n=2),
                        sized_node("plain", cpu="8", n=0)])  # fmt: skip
    view.replace_pods([])
    pod = host_pod("cpu", "", [res("2")], uid="uid-cpu")
    del pod["spec"]["nodeName"]
    for flags, passed in (
        ([], ["spare", "plain"]),
        (["--no-keep-cpu-for-gpus"], ["tight", "spare", "plain"]),
    ):
        args = build_parser().parse_args(flags)
        policy = make_policy(args)
        assert policy.keep_cpu_for_gpus is (not flags)
        policy.workload = wl
        ext = Extender(view, policy, None, clock=lambda: NOW)
        out = ext.filter(ExtenderArgs(pod, ["tight", "spare", "plain"], None))
        assert out["NodeNames"] == passed, out
        if not flags:
            why = out["FailedAndUnresolvableNodes"]["tight"]
            assert why.startswith(
                "node tight: its free CPU is kept for its free GPUs (2000m of its 16000m free"
            )
            assert "8000m CPU per GPU" in why
