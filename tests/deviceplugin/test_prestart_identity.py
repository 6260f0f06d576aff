"""Pod identity at the GPU (issue 31 item 1), judged by the kubelet's real device manager
(devicemanager-harness), the real API server and the real `gpupack device-plugin` process.

`Allocate` names no pod, so the plugin hands whichever pod the kubelet admits the pending pod's
assignment. Before the container starts the kubelet calls PreStartContainer (the harness: in
GetDeviceRunContainerOptions; a failure is its `run_container_options` error, and the container is
not created). The plugin asks PodResources (tests/deviceplugin/podresources_emulator.py, answering
from the device manager's own checkpoint) which pod holds the device IDs, and refuses the wrong
one; the rightful pod's record is repaired so it is still served when the kubelet admits it.
"""

from __future__ import annotations

import urllib.request

import realk8s
from dp_node import DP
from harness import harness_pod

from gpupack import contract, handoff
from gpupack.contract import ANN_ALLOCATED, ANN_HANDOFF, RES_GPU, Assignment, decode_allocation_record


def ids(ev: dict) -> list[str]:
    return ev["device_ids"].get(RES_GPU, [])


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _refusal(dp: DP, pod: dict) -> dict:
    errs = [e for e in dp.harness.errors() if e.get("uid") == pod["metadata"]["uid"]]
    assert len(errs) == 1, dp.harness.report()
    assert errs[0]["phase"] == "run_container_options" and errs[0]["expected"] is True, errs
    return errs[0]


def _assert_served_own(dp: DP, pod: dict, a: Assignment, container: str = "main") -> None:
    """The pod's container started with exactly its own assignment, and its record names the IDs
    the kubelet holds for it."""
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    ev = dp.harness.allocations(uid)[container]
    assert ev["envs"] == handoff.container_env(a.containers[container]), dp.harness.report()
    assert {d.split("::")[0] for d in ids(ev)} == {s.uuid for s in a.containers[container]}
    ann = dp.annotations(name)
    assert ann[ANN_HANDOFF] == contract.HANDOFF_DONE, ann
    rec = decode_allocation_record(ann[ANN_ALLOCATED], name)
    assert rec.ids[container] == frozenset(ids(ev)), rec


def test_unplaced_gpu_pod_admitted_first_is_refused_and_the_pending_pod_gets_its_gpu(dp):
    """(a) A `gpupack.io/gpu` pod gpupack never placed (another scheduler, bound by hand) is admitted
    before the pending pod: Allocate hands it the pending pod's assignment, PreStartContainer
    refuses it (its container is never created) and hands the assignment back; the pending pod,
    admitted next, gets its own GPU."""
    port = realk8s.free_port()
    dp.start_plugin(None, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    stray = dp.make_pod("stray", scheduler="default-scheduler")
    dp.core.create_namespaced_pod_binding(
        "stray", dp.ns, {"metadata": {"name": "stray"}, "target": {"kind": "Node", "name": dp.node}},
        _preload_content=False,
    )  # fmt: skip
    own = dp.make_pod("own", containers=[("main", 1, 9000, 25)])
    a = dp.bind("own", gpus={"main": [2]})
    assert dp.harness.run([harness_pod(stray, expect_error=True), harness_pod(own)]) == 0, dp.harness.report()
    err = _refusal(dp, stray)["error"]
    assert f"pod {dp.ns}/stray container main holds {RES_GPU} devices" in err, err
    assert "gpupack never placed this pod" in err and "schedulerName" in err, err
    assert f"the allocation record of pod {dp.ns}/own no longer claims container(s) main" in err, err
    assert not dp.harness.allocations(stray["metadata"]["uid"])  # its container never got options
    _assert_served_own(dp, own, a)
    assert ANN_ALLOCATED not in dp.annotations("stray") and ANN_HANDOFF not in dp.annotations("stray")
    text = _metrics(port)
    assert f'gpupack_deviceplugin_prestart_refusals_total{{node="{dp.node}",reason="not_placed"}} 1.0' in text
    assert f'gpupack_deviceplugin_prestart_refusals_total{{node="{dp.node}",reason="no_holder"}} 0.0' in text


def test_late_pod_whose_handoff_failed_is_refused_and_the_next_pod_gets_its_gpu(dp):
    """(b) A pod the kubelet admits after the extender's janitor gave up its handoff (failed) and
    bound the next pod to the node: Allocate serves the late pod the next pod's assignment;
    PreStartContainer refuses the late pod and hands the assignment back, so the next pod is served
    its own GPU. Releasing the late pod's claim was safe: it never runs with a GPU."""
    late = dp.make_pod("late", containers=[("main", 1, 20000, 40)])
    nxt = dp.make_pod("next", containers=[("main", 1, 30000, 50)])
    a_late = dp.bind("late", gpus={"main": [0]})
    # the janitor (extender/verbs/stale.py) after --stale-handoff-s: handoff failed, the node is free
    dp.core.patch_namespaced_pod("late", dp.ns, {"metadata": {"annotations": handoff.failed_annotations()}})
    a_next = dp.bind("next", gpus={"main": [1]})
    rc = dp.harness.run([harness_pod(late, expect_error=True), harness_pod(nxt)], plugin_cmd=dp.plugin_cmd())
    assert rc == 0, dp.harness.report()
    err = _refusal(dp, late)["error"]
    assert f"pod {dp.ns}/late container main holds {RES_GPU} devices" in err, err
    assert a_next.containers["main"][0].uuid in err, err  # the GPU it was about to take
    assert "handoff was marked failed" in err and "Delete the pod" in err, err
    assert not dp.harness.allocations(late["metadata"]["uid"])
    _assert_served_own(dp, nxt, a_next)
    assert dp.annotations("late")[ANN_HANDOFF] == contract.HANDOFF_FAILED
    assert a_late.containers["main"][0].uuid != a_next.containers["main"][0].uuid


def test_own_pod_starts_again_after_a_kubelet_restart_with_init_container_device_reuse(dp):
    """(c) A pod gpupack placed starts, and starts again after a kubelet restart (a brand-new device
    manager restored from its checkpoint calls PreStartContainer again, no Allocate): PreStart is
    idempotent. Its init container and app container hold the same device IDs (the kubelet reuses
    them), so PodResources lists both for those IDs."""
    pod = dp.make_pod("twice", containers=[("main", 1, 8000, 20)], init=[("warm", 1, 8000, 20)])
    a = dp.bind("twice", gpus={"warm": [3], "main": [3]})
    dp.harness.start(
        [harness_pod(pod)], plugin_cmd=dp.plugin_cmd(), restart="kubelet", restart_delay=1, pods_after_restart=True
    )  # fmt: skip
    dp.harness.wait_event(
        lambda e: e.get("event") == "restart" and e.get("phase") == "stopped", 60, "restart"
    )
    dp.harness.write_pods_after_restart([harness_pod(pod)])
    assert dp.harness.finish() == 0, dp.harness.report()
    evs = [e for e in dp.harness.of("allocate") if e["uid"] == pod["metadata"]["uid"]]
    assert [e["container"] for e in evs] == ["warm", "main", "warm", "main"], dp.harness.report()
    assert len({tuple(ids(e)) for e in evs}) == 1
    for e in evs:
        assert e["envs"] == handoff.container_env(a.containers[e["container"]])
    log = "".join(f.read_text() for f in sorted(dp.dirs.base.glob("plugin.*.log")))
    assert log.count(f"PreStartContainer: pod {dp.ns}/twice may start") == 4, log[-3000:]
    assert ") refused:" not in log, log[-3000:]  # no start refused (a registration retry says "refused" too)


def test_podresources_down_refuses_the_start_with_the_reason(dp):
    """(d) Fail closed: without the kubelet's PodResources API the plugin cannot tell which pod holds
    the GPU, so even the rightful pod's container is refused, with a reason naming the socket."""
    pod = dp.make_pod("blind")
    dp.bind("blind")
    rc = dp.harness.run([harness_pod(pod, expect_error=True)], plugin_cmd=dp.plugin_cmd(podresources=False))
    assert rc == 0, dp.harness.report()
    err = _refusal(dp, pod)["error"]
    assert "pod-resources socket" in err and "does not exist" in err and "fail closed" in err, err
    assert "--pod-resources-socket" in err
