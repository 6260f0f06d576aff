"""The real `gpupack device-plugin` process against the kubelet's real device manager
(devicemanager-harness, Kubernetes v1.28.7) and the real API server.

Each pod is created in the API server, assigned and bound as the extender does (assignment +
`gpupack.io/handoff=pending`, then pods/binding), and only then admitted by the device manager
with the same uid, name and namespace. What a container gets is read from the harness's
"allocate" events: the env the container runtime would receive.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest
import realk8s
from dp_binder import BindRefused
from dp_node import DP
from faultproxy import FaultProxy
from harness import harness_pod

from gpupack import contract, handoff
from gpupack.contract import ANN_ALLOCATED, ANN_HANDOFF, Assignment, decode_allocated

SLOTS = contract.SLOTS_PER_GPU


def gpu_of(device_id: str) -> str:
    return device_id.split("::")[0]


def ids(ev: dict) -> list[str]:
    return ev["device_ids"].get(contract.RES_GPU, [])


def assert_env_is_assignment(env: dict[str, str], a: Assignment, container: str) -> None:
    """The container's env is exactly its own assignment (GPUs, memory and SM limits)."""
    shares = a.containers[container]
    assert env == handoff.container_env(shares), container
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(s.uuid for s in shares)
    if not all(s.exclusive for s in shares):
        for i, s in enumerate(shares):
            assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{s.mem_mib}m", container
        assert env["CUDA_DEVICE_SM_LIMIT"] == str(min(s.sm_pct for s in shares)), container


def assert_done(dp: DP, name: str, containers: list[str]) -> None:
    ann = dp.annotations(name)
    assert ann[ANN_HANDOFF] == contract.HANDOFF_DONE, ann
    assert decode_allocated(ann[ANN_ALLOCATED]) == containers


def admit_ok(dp: DP, *pods: dict, **kw) -> None:
    rc = dp.harness.run([harness_pod(p) for p in pods], **kw)
    assert rc == 0, dp.harness.report()


# --- issue 10 and the init / app container cases -------------------------------------------------
def test_init_container_with_the_same_count_reuses_its_ids_and_main_still_gets_its_own_limits(dp):
    """The kubelet hands `main` the init container's device IDs again and still calls Allocate:
    `main` must get its own 40000 MiB / 40 %, and the handoff must complete."""
    pod = dp.make_pod("llm", containers=[("main", 1, 40000, 40)], init=[("download", 1, 8000, 10)])
    a = dp.bind("llm")
    admit_ok(dp, pod, plugin_cmd=dp.plugin_cmd())
    got = dp.harness.allocations(pod["metadata"]["uid"])
    assert list(got) == ["download", "main"]
    assert ids(got["main"]) == ids(got["download"])  # what the real device manager does
    assert_env_is_assignment(got["download"]["envs"], a, "download")
    assert_env_is_assignment(got["main"]["envs"], a, "main")
    assert got["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40000m"
    assert got["main"]["envs"]["CUDA_DEVICE_SM_LIMIT"] == "40"
    assert_done(dp, "llm", ["download", "main"])


def test_init_containers_with_different_counts_than_the_app_containers(dp):
    """init `prep` holds 2 GPUs; app `a` (1 GPU, elsewhere) gets one of prep's IDs again; app `b`
    (3 GPUs) gets prep's other ID plus fresh slots, steered onto its assigned GPUs."""
    pod = dp.make_pod(
        "mixed",
        init=[("prep", 2, 4000, 20), ("check", 1, 2000, 5)],
        containers=[("a", 1, 30000, 30), ("b", 3, 20000, 25)],
    )
    a = dp.bind("mixed", gpus={"prep": [0, 1], "check": [0], "a": [2], "b": [1, 2, 3]})
    admit_ok(dp, pod, plugin_cmd=dp.plugin_cmd())
    got = dp.harness.allocations(pod["metadata"]["uid"])
    assert list(got) == ["prep", "check", "a", "b"]
    for c in got:
        assert_env_is_assignment(got[c]["envs"], a, c)
    prep = set(ids(got["prep"]))
    assert {gpu_of(i) for i in prep} == {s.uuid for s in a.containers["prep"]}  # steered
    assert set(ids(got["check"])) <= prep and set(ids(got["a"])) <= prep  # reused, not fresh
    b = set(ids(got["b"]))
    assert len(b) == 3 and prep - set(ids(got["a"])) <= b  # the init ID `a` left is reused by `b`
    assert {gpu_of(i) for i in b - prep} <= {s.uuid for s in a.containers["b"]}
    assert_done(dp, "mixed", ["prep", "check", "a", "b"])


def test_several_gpu_containers_cpu_only_and_whole_gpus(dp):
    pod = dp.make_pod(
        "multi",
        init=[("warm", 1, 5000, 10)],
        containers=[("a", 1, 20000, 30), ("cpu", 0, 0, 0), ("b", 2, 30000, 20), ("train", 1, 0, 0)],
    )
    a = dp.bind("multi")
    admit_ok(dp, pod, plugin_cmd=dp.plugin_cmd())
    got = dp.harness.allocations(pod["metadata"]["uid"])
    assert list(got) == ["warm", "a", "cpu", "b", "train"]
    assert got["cpu"]["envs"] == {} and ids(got["cpu"]) == []
    for c in ("warm", "a", "b", "train"):
        assert_env_is_assignment(got[c]["envs"], a, c)
    assert not [k for k in got["train"]["envs"] if k.startswith("CUDA_")]  # a whole GPU: no limits
    # GetPreferredAllocation steered fresh IDs onto the assigned GPUs
    for c in ("warm", "b", "train"):
        fresh = set(ids(got[c])) - set(ids(got["warm"])) if c != "warm" else set(ids(got[c]))
        assert {gpu_of(i) for i in fresh} <= {s.uuid for s in a.containers[c]}, c
    assert len(ids(got["b"])) == 2
    assert_done(dp, "multi", ["warm", "a", "b", "train"])


# --- restarts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["kubelet", "server"])
def test_kubelet_restart_between_two_pods(dp, mode):
    """`kubelet`: a brand-new device manager restored from the checkpoint; `server`: the
    registration server goes away and comes back. The plugin registers again and serves the
    second pod. The first pod, admitted again after the restart (as a restarted kubelet does with
    running pods), gets its checkpointed devices and env without any Allocate reaching the plugin:
    had it reached it, the plugin would have handed it the pending second pod's GPU."""
    first = dp.make_pod("first", containers=[("main", 1, 10000, 20)])
    second = dp.make_pod("second", containers=[("main", 1, 12000, 30)])
    a1 = dp.bind("first", gpus={"main": [0]})
    dp.harness.start(
        [harness_pod(first)],
        plugin_cmd=dp.plugin_cmd(),
        restart=mode,
        restart_delay=2,
        pods_after_restart=True,
    )
    dp.harness.wait_event(
        lambda e: e.get("event") == "restart" and e.get("phase") == "stopped", 60, "restart"
    )
    assert_done(dp, "first", ["main"])
    a2 = dp.bind("second", gpus={"main": [1]})  # the node is free again: the first handoff is done
    dp.harness.write_pods_after_restart([harness_pod(first), harness_pod(second)])
    assert dp.harness.finish() == 0, dp.harness.report()
    assert [e["registration"] for e in dp.harness.of("registered")] == [1, 2]
    assert dp.harness.of("reregistered")
    again = [e for e in dp.harness.of("allocate") if e["uid"] == first["metadata"]["uid"]]
    assert len(again) == 2 and ids(again[0]) == ids(again[1])
    for e in again:
        assert_env_is_assignment(e["envs"], a1, "main")
    g2 = dp.harness.allocations(second["metadata"]["uid"])["main"]
    assert_env_is_assignment(g2["envs"], a2, "main")
    assert not set(ids(again[0])) & set(ids(g2))
    assert_done(dp, "first", ["main"])
    assert_done(dp, "second", ["main"])
    served = [line for f in sorted(dp.dirs.base.glob("plugin.*.log")) for line in f.read_text().splitlines()]
    assert sum("Allocate: pod" in line for line in served) == 2, (
        "the plugin was asked twice for one container"
    )


def test_plugin_killed_and_restarted_between_two_pods(dp):
    """The plugin process dies (SIGKILL: its socket is left behind) while the kubelet restarts;
    a new plugin process registers and serves the next pod from the annotations alone."""
    first = dp.make_pod("first")
    second = dp.make_pod("second", init=[("init", 1, 3000, 10)], containers=[("main", 1, 9000, 15)])
    a1 = dp.bind("first")
    old = dp.start_plugin()
    dp.harness.start([harness_pod(first)], restart="server", restart_delay=1, pods_after_restart=True)
    dp.harness.wait_event(
        lambda e: e.get("event") == "restart" and e.get("phase") == "stopped", 60, "restart"
    )
    os.killpg(old.pid, signal.SIGKILL)
    old.wait(10)
    a2 = dp.bind("second")
    dp.harness.write_pods_after_restart([harness_pod(second)])
    dp.start_plugin()
    assert dp.harness.finish() == 0, dp.harness.report()
    assert_env_is_assignment(dp.harness.allocations(first["metadata"]["uid"])["main"]["envs"], a1, "main")
    got = dp.harness.allocations(second["metadata"]["uid"])
    assert_env_is_assignment(got["init"]["envs"], a2, "init")
    assert_env_is_assignment(got["main"]["envs"], a2, "main")
    assert_done(dp, "second", ["init", "main"])


# --- registration, devices, health -----------------------------------------------------------------
def test_registration_devices_inventory_and_unhealthy_gpus(dp):
    nvml = {
        "gpus": 8, "numa_nodes": 2, "uuid_seed": dp.node,
        "faults": {"xids": [{"gpu": 3, "xid": 43, "after_s": 0}, {"gpu": 2, "xid": 79, "after_s": 0}],
                   "lost": [{"gpu": 5, "after_s": 0}]},
    }  # fmt: skip
    dp.start_plugin(nvml)
    inv = dp.wait_inventory(lambda i: sum(not g.healthy for g in i.gpus) == 2)
    bad = {g.index: g for g in inv.gpus if not g.healthy}
    assert set(bad) == {2, 5} and bad[2].unhealthy_reason == "XID 79" and "lost" in bad[5].unhealthy_reason
    assert [g.mem_mib for g in inv.gpus] == [143771] * 8 and inv.slots_per_gpu == SLOTS
    labels = dp.core.read_node(dp.node).metadata.labels
    assert labels[contract.LABEL_GPU_COUNT] == "8" and labels[contract.LABEL_GPU_MODEL] == "NVIDIA-H200"
    for run in (1, 2):  # the second run is a restarted kubelet: the same plugin process registers again
        assert dp.harness.run() == 0, dp.harness.report()
        reg = dp.harness.of("registered")[0]
        assert reg["endpoint"].endswith("gpupack.sock") and reg["get_preferred_allocation_available"] is True
        assert reg["pre_start_required"] is True  # PreStartContainer checks the pod (issue 31)
        dev = dp.harness.of("devices")[-1]
        assert dev["healthy"] == 6 * SLOTS and dev["unhealthy"] == 2 * SLOTS, run
        assert {gpu_of(i) for i in dev["unhealthy_ids"]} == {bad[2].uuid, bad[5].uuid}
        assert dev["node_capacity"] == str(8 * SLOTS) and dev["node_allocatable"] == str(6 * SLOTS)
        assert set(dev["numa"][f"{inv.gpus[7].uuid}::0"]) == {1}


def test_process_sigterm_removes_its_socket(dp):
    p = dp.start_plugin()
    assert dp.harness.run() == 0, dp.harness.report()
    sock = dp.kubelet_dir / "gpupack.sock"
    realk8s.until(sock.exists, 10, "plugin socket served again after the harness ended")
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(15) == 0, dp.plugin_log()
    assert not sock.exists()
    assert "Traceback" not in dp.plugin_log()


# --- Allocate refusals -----------------------------------------------------------------------------
def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_pod_without_a_gpupack_assignment_is_rejected_with_a_reason(dp):
    """A pod bound by someone else (no assignment): the kubelet's Allocate fails, nothing is handed out."""
    port = realk8s.free_port()
    dp.start_plugin(None, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    pod = dp.make_pod("stray", scheduler="default-scheduler")
    dp.core.create_namespaced_pod_binding(
        "stray", dp.ns, {"metadata": {"name": "stray"}, "target": {"kind": "Node", "name": dp.node}},
        _preload_content=False,
    )  # fmt: skip
    assert dp.harness.run([harness_pod(pod, expect_error=True)]) == 0, dp.harness.report()
    assert not dp.harness.of("allocate")
    err = dp.harness.errors()[0]
    assert err["container"] == "main" and err["expected"] is True
    assert f"no pending gpupack assignment for a pod on node {dp.node}" in err["error"]
    assert "schedulerName" in err["error"]
    assert (
        f'gpupack_deviceplugin_handoff_failures_total{{node="{dp.node}",reason="no_pending"}} 1.0'
        in _metrics(port)
    )


def test_pod_of_another_scheduler_with_copied_annotations_is_not_served(dp):
    pod = dp.make_pod("copycat", scheduler="default-scheduler")
    dp.bind("copycat")
    assert dp.harness.run([harness_pod(pod, expect_error=True)], plugin_cmd=dp.plugin_cmd()) == 0, (
        dp.harness.report()
    )
    assert not dp.harness.of("allocate")
    assert "schedulerName is 'default-scheduler'" in dp.harness.errors()[0]["error"]
    assert dp.annotations("copycat")[ANN_HANDOFF] == contract.HANDOFF_FAILED


def test_unhealthy_assigned_gpu_fails_allocate_and_releases_the_node(dp):
    dp.start_plugin({**dp.nvml, "faults": {"xids": [{"gpu": 1, "xid": 79, "after_s": 0}]}})
    dp.wait_inventory(lambda i: not i.gpus[1].healthy)
    victim = dp.make_pod("victim")
    a = dp.bind("victim", gpus={"main": [1]})
    assert dp.harness.run([harness_pod(victim, expect_error=True)]) == 0, dp.harness.report()
    assert f"assigned GPU {a.containers['main'][0].uuid} is unhealthy" in dp.harness.errors()[0]["error"]
    assert dp.annotations("victim")[ANN_HANDOFF] == contract.HANDOFF_FAILED
    after = dp.make_pod("after")
    dp.binder.wait_s = 3
    a2 = dp.bind("after")  # not blocked by the rejected pod
    assert a2.containers["main"][0].uuid != a.containers["main"][0].uuid
    assert dp.harness.run([harness_pod(after)]) == 0, dp.harness.report()
    assert_env_is_assignment(dp.harness.allocations(after["metadata"]["uid"])["main"]["envs"], a2, "main")


def test_a_bound_pod_being_deleted_keeps_its_node_until_it_is_gone(dp):
    """A graceful delete of a bound pod completes only when its kubelet confirms, and until then that
    kubelet may still be admitting it (the device manager goes on calling Allocate for its
    containers). So it stays the node's pending handoff: the next pod is not bound there, and so can
    never be served in its place. Once the pod is gone, the next pod is bound and gets its own GPU."""
    dp.make_pod("gone")
    nxt = dp.make_pod("next", containers=[("main", 1, 7000, 15)])
    dp.bind("gone")
    dp.core.delete_namespaced_pod("gone", dp.ns, _preload_content=False)
    assert dp.read_pod("gone")["metadata"].get("deletionTimestamp")
    dp.binder.wait_s = 1
    with pytest.raises(BindRefused, match="waiting for the kubelet to admit pod"):
        dp.bind("next")
    dp.core.delete_namespaced_pod("gone", dp.ns, grace_period_seconds=0)  # what its kubelet confirms
    realk8s.until(lambda: "gone" not in {p.metadata.name for p in dp.core.list_namespaced_pod(dp.ns).items},
                  20, "the deleted pod gone")  # fmt: skip
    dp.binder.wait_s = 3
    a = dp.bind("next")
    admit_ok(dp, nxt, plugin_cmd=dp.plugin_cmd())
    env = dp.harness.allocations(nxt["metadata"]["uid"])["main"]["envs"]
    assert_env_is_assignment(env, a, "main")
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "7000m"


# --- the API under contention ----------------------------------------------------------------------
def test_pods_bound_at_once_are_served_one_by_one_each_with_its_own_assignment(dp):
    """Binds race; the node's pending handoff serialises them; the (restarting) kubelet admits
    each bound pod as it appears, and each container gets its own pod's size, not a peer's."""
    port = realk8s.free_port()
    dp.start_plugin(None, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    names = [f"p{i}" for i in range(5)]
    pods = {n: dp.make_pod(n, containers=[("main", 1, 5000 + 100 * i, 10)]) for i, n in enumerate(names)}
    assignments: dict[str, Assignment] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(names))

    def bind(n: str) -> None:
        try:
            barrier.wait()
            assignments[n] = dp.bind(n)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=bind, args=(n,)) for n in names]
    for t in threads:
        t.start()
    admitted: dict[str, dict] = {}
    while len(admitted) < len(names):
        pending = realk8s.until(
            lambda: handoff.pending_pods_on_node(_pods(dp), dp.node), 30, "a bound pod with a pending handoff"
        )
        n = pending[0].name
        assert dp.harness.run([harness_pod(pods[n])], keep_checkpoint=True) == 0, dp.harness.report()
        admitted[n] = dp.harness.allocations(pods[n]["metadata"]["uid"])["main"]
    for t in threads:
        t.join(30)
    assert not errors, errors
    for i, n in enumerate(names):
        assert_env_is_assignment(admitted[n]["envs"], assignments[n], "main")
        assert admitted[n]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{5000 + 100 * i}m"
        assert_done(dp, n, ["main"])
    assert dp.binder.waits > 0  # the binds really were serialised behind pending handoffs
    text = _metrics(port)
    reserved = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpupack_gpu_reserved_memory_bytes{")
    )
    assert reserved == sum(5000 + 100 * i for i in range(len(names))) * (1 << 20)
    assert f'gpupack_deviceplugin_allocate_seconds_count{{node="{dp.node}"}} {float(len(names))}' in text


def _pods(dp: DP) -> list[dict]:
    r = dp.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={dp.node}", _preload_content=False)
    return json.loads(r.data)["items"]


def test_pod_changed_during_allocate_is_reread_not_overwritten(dp, tmp_path):
    with FaultProxy(dp.cluster.url) as proxy:
        kc = dp.cluster.write_kubeconfig(tmp_path / "proxied", server=proxy.url)
        pod = dp.make_pod("busy")
        a = dp.bind("busy")
        # Hold the plugin's PATCH while someone else writes the pod: its resourceVersion goes stale.
        proxy.delay(rf"/namespaces/{dp.ns}/pods/busy$", 1.0, method="PATCH", times=1)
        dp.harness.start([harness_pod(pod)], plugin_cmd=dp.plugin_cmd(kubeconfig=kc))
        realk8s.until(lambda: proxy.count("PATCH", r"/pods/busy$") >= 1, 60, "the plugin's PATCH")
        dp.core.patch_namespaced_pod(
            "busy", dp.ns, {"metadata": {"labels": {"touched": "yes"}}},
            _content_type="application/merge-patch+json", _preload_content=False,
        )  # fmt: skip
        assert dp.harness.finish() == 0, dp.harness.report()
        assert_env_is_assignment(dp.harness.allocations(pod["metadata"]["uid"])["main"]["envs"], a, "main")
        p = dp.read_pod("busy")
        assert p["metadata"]["labels"]["touched"] == "yes"  # the other writer's change survived
        assert p["metadata"]["annotations"][ANN_HANDOFF] == contract.HANDOFF_DONE
        assert proxy.count("PATCH", r"/pods/busy$") >= 2  # ours (409), then ours again


def test_health_change_reaches_the_connected_kubelet_and_the_inventory(dp, tmp_path):
    """An XID while the kubelet is connected: a ListAndWatch update marks that GPU's slots
    unhealthy and lowers the node's allocatable; application XIDs are ignored. The kubelet is held
    connected by a slow API answer during the pod's admission."""
    trigger = tmp_path / "xids"
    nvml = {**dp.nvml, "faults": {"xid_file": str(trigger)}}
    with FaultProxy(dp.cluster.url) as proxy:
        kc = dp.cluster.write_kubeconfig(tmp_path / "proxied", server=proxy.url)
        pod = dp.make_pod("slow")
        a = dp.bind("slow", gpus={"main": [0]})
        proxy.delay(r"/api/v1/pods$", 4.0, method="GET", times=1)  # the plugin's pod list, once
        dp.harness.start([harness_pod(pod)], plugin_cmd=dp.plugin_cmd(nvml, kubeconfig=kc))
        dp.harness.wait_event(lambda e: e.get("event") == "devices", 60, "first device list")
        realk8s.until(lambda: proxy.count("GET", r"/api/v1/pods$") >= 1, 30, "the plugin's pod list")
        with trigger.open("a") as f:
            f.write("3 43\n2 79\n")
        dev = dp.harness.wait_event(
            lambda e: e.get("event") == "devices" and e["unhealthy"], 10, "health update"
        )
        assert dev["unhealthy"] == SLOTS and {gpu_of(i) for i in dev["unhealthy_ids"]} == {dp.nvml_uuid(2)}
        assert dev["node_allocatable"] == str(3 * SLOTS) and dev["node_capacity"] == str(4 * SLOTS)
        assert not dp.harness.of("allocate")  # the admission was still in flight
        assert dp.harness.finish() == 0, dp.harness.report()
    assert_env_is_assignment(dp.harness.allocations(pod["metadata"]["uid"])["main"]["envs"], a, "main")
    inv = dp.wait_inventory(lambda i: not i.gpus[2].healthy)
    assert [g.index for g in inv.gpus if not g.healthy] == [2] and inv.gpus[2].unhealthy_reason == "XID 79"
