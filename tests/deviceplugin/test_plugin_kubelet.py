"""The device plugin against the test kubelet (gRPC on unix sockets) and KubeAPIServer (HTTP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from dp_binder import TestBinder
from dp_util import NODE, until

from deviceplugin.api import HEALTHY, UNHEALTHY
from gpupack import contract, handoff
from gpupack.contract import ANN_ALLOCATED, ANN_HANDOFF, ANN_INVENTORY, RES_GPU, RES_GPU_MEM

REPO = Path(__file__).resolve().parents[2]
SLOTS = contract.SLOTS_PER_GPU


def make_pod(core, name, containers=(("main", 1, 10000),), init=(), ns="default"):
    def cs(lst):
        out = []
        for cname, n, mem in lst:
            limits = {RES_GPU: str(n)}
            if mem:
                limits[RES_GPU_MEM] = str(mem)
            out.append({"name": cname, "image": "busybox", "resources": {"limits": limits}})
        return out

    body = {"metadata": {"name": name, "namespace": ns},
            "spec": {"schedulerName": contract.SCHEDULER_NAME, "containers": cs(containers)}}
    if init:
        body["spec"]["initContainers"] = cs(init)
    return json.loads(core.create_namespaced_pod(ns, body, _preload_content=False).data)


def read_pod(core, name, ns="default"):
    return json.loads(core.read_namespaced_pod(name, ns, _preload_content=False).data)


def node_inventory(core):
    n = json.loads(core.read_node(NODE, _preload_content=False).data)
    raw = n["metadata"].get("annotations", {}).get(ANN_INVENTORY)
    return (contract.decode_inventory(raw, NODE) if raw else None), n["metadata"].get("labels", {})


def test_registers_and_advertises_slots(kubelet, start_plugin, core):
    plugin, nvml = start_plugin()
    assert kubelet.wait_for(lambda: kubelet.registrations and len(kubelet.devices) == 8 * SLOTS, 10)
    assert kubelet.registrations == ["gpupack.sock"]
    assert all(h == HEALTHY for h in kubelet.devices.values())
    assert kubelet.last_message_bytes < 8 * 1024
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    inv, labels = node_inventory(core)
    assert [g.mem_mib for g in inv.gpus] == [143771] * 8 and inv.slots_per_gpu == SLOTS
    assert labels[contract.LABEL_GPU_COUNT] == "8" and labels[contract.LABEL_GPU_MODEL] == "NVIDIA-H200"


def test_health_change_reaches_listandwatch_and_inventory(kubelet, start_plugin, core):
    plugin, nvml = start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    bad = nvml.uuid(2)
    nvml.inject_xid(3, 43)  # application error: ignored
    nvml.inject_xid(2, 79)
    assert kubelet.wait_for(lambda: kubelet.devices.get(f"{bad}::0") == UNHEALTHY, 5)
    unhealthy = {d.split("::")[0] for d, h in kubelet.devices.items() if h == UNHEALTHY}
    assert unhealthy == {bad}
    assert until(lambda: not {g.uuid: g for g in node_inventory(core)[0].gpus}[bad].healthy, 5)
    inv = node_inventory(core)[0]
    assert [g.uuid for g in inv.gpus if not g.healthy] == [bad]
    assert {g.uuid: g for g in inv.gpus}[bad].unhealthy_reason == "XID 79"
    # a GPU that falls off the bus: reported, the plugin keeps serving
    nvml.lose(5)
    lost = nvml.gpus[5].uuid
    assert kubelet.wait_for(lambda: kubelet.devices.get(f"{lost}::0") == UNHEALTHY, 5)
    assert until(lambda: "lost" in {g.uuid: g for g in node_inventory(core)[0].gpus}[lost].unhealthy_reason, 5)


def test_kubelet_restart_registers_again(kubelet, start_plugin):
    plugin, _ = start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 1 and kubelet.devices, 10)
    kubelet.restart()  # removes our socket and re-creates kubelet.sock
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and len(kubelet.devices) == 8 * SLOTS, 5)
    assert os.path.exists(plugin.socket_path)
    kubelet.restart()
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 3, 5)


def test_allocate_multi_container_pod(kubelet, start_plugin, core):
    plugin, nvml = start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    make_pod(core, "multi", containers=[("a", 1, 20000), ("cpu", 0, 0), ("b", 2, 30000)], init=[("warm", 1, 5000)])
    a = TestBinder(core).bind("default", "multi", NODE)
    res = kubelet.admit(read_pod(core, "multi"))
    assert res.ok, res.error
    assert list(res.envs) == ["warm", "a", "b"]
    for cname, env in res.envs.items():
        shares = a.containers[cname]
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(s.uuid for s in shares)
        for i, s in enumerate(shares):
            assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{s.mem_mib}m"
    assert len(res.device_ids["b"]) == 2
    # GetPreferredAllocation steered the kubelet to slots of the assigned GPUs (its NUMA view matches)
    for cname, ids in res.device_ids.items():
        assert [i.split("::")[0] for i in ids] == [s.uuid for s in a.containers[cname]]
    ann = read_pod(core, "multi")["metadata"]["annotations"]
    assert ann[ANN_HANDOFF] == "done" and json.loads(ann[ANN_ALLOCATED]) == ["warm", "a", "b"]
    # A kubelet retry of the last container gets the same answer, not someone else's GPU.
    again = kubelet.allocate(res.device_ids["b"])
    assert dict(again.container_responses[0].envs) == res.envs["b"]


def test_whole_gpu_gets_no_limits(kubelet, start_plugin, core):
    start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    make_pod(core, "whole", containers=[("train", 2, 0)])
    a = TestBinder(core).bind("default", "whole", NODE)
    res = kubelet.admit(read_pod(core, "whole"))
    assert res.ok, res.error
    env = res.envs["train"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(s.uuid for s in a.containers["train"])
    assert not [k for k in env if k.startswith("CUDA_")]


def test_allocate_without_assignment_fails_with_a_reason_and_hands_out_nothing(kubelet, start_plugin, core):
    plugin, _ = start_plugin(metrics_port=0, metrics_addr="127.0.0.1")
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(kubelet.healthy_devices()[:1])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"no pending gpupack assignment for a pod on node {NODE}" in e.value.details()
    assert "schedulerName" in e.value.details()
    text = urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=5).read().decode()
    assert 'gpupack_handoff_failures_total{reason="no_pending"} 1.0' in text


def test_twenty_pods_bound_at_once_each_get_their_own_assignment(kubelet, start_plugin, core, api):
    plugin, _ = start_plugin(metrics_port=0, metrics_addr="127.0.0.1")
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    kubelet.run_admission(core, NODE)
    names = [f"p{i:02d}" for i in range(20)]
    for i, n in enumerate(names):
        make_pod(core, n, containers=[("main", 1, 5000 + 100 * i)])
    binder = TestBinder(core)
    assignments: dict[str, contract.Assignment] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def bind(n):
        try:
            start.wait()
            assignments[n] = binder.bind("default", n, NODE)
        except BaseException as e:  # report in the main thread
            errors.append(e)

    threads = [threading.Thread(target=bind, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert kubelet.wait_for(lambda: len(kubelet.admissions) == 20, 30)
    by_uid = {handoff.pod_view(read_pod(core, n)).uid: n for n in names}
    for uid, adm in kubelet.admissions.items():
        n = by_uid[uid]
        assert adm.ok, (n, adm.error)
        want = assignments[n].containers["main"][0]
        assert adm.envs["main"]["NVIDIA_VISIBLE_DEVICES"] == want.uuid
        assert adm.envs["main"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{want.mem_mib}m"  # this pod's size, not a peer's
    for n in names:
        assert read_pod(core, n)["metadata"]["annotations"][ANN_HANDOFF] == "done"
    assert binder.waits > 0  # binds really were serialised behind pending handoffs
    text = urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=5).read().decode()
    reserved = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("gpupack_gpu_reserved_memory_mib{")
    )
    assert reserved == sum(5000 + 100 * i for i in range(20))
    assert "gpupack_allocate_seconds_count 20.0" in text


def test_pod_deleted_between_bind_and_allocate_leaves_nothing_stuck(kubelet, start_plugin, core):
    start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    binder = TestBinder(core, wait_s=3)
    make_pod(core, "gone")
    make_pod(core, "next", containers=[("main", 1, 7000)])
    binder.bind("default", "gone", NODE)
    core.delete_namespaced_pod("gone", "default", _preload_content=False)
    # the node is not blocked by the deleted pod, and Allocate serves the next pod, not the ghost
    a = binder.bind("default", "next", NODE)
    res = kubelet.admit(read_pod(core, "next"))
    assert res.ok, res.error
    assert res.envs["main"]["NVIDIA_VISIBLE_DEVICES"] == a.containers["main"][0].uuid
    assert res.envs["main"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "7000m"


def test_a_pending_pod_blocks_the_next_bind_until_admitted(kubelet, start_plugin, core):
    start_plugin()
    assert until(lambda: node_inventory(core)[0] is not None, 10)
    binder = TestBinder(core, wait_s=0.5)
    make_pod(core, "first")
    make_pod(core, "second")
    binder.bind("default", "first", NODE)
    from dp_binder import BindRefused

    with pytest.raises(BindRefused, match="waiting for the kubelet to admit pod default/first"):
        binder.bind("default", "second", NODE)
    assert kubelet.wait_for(lambda: kubelet.devices, 10)
    assert kubelet.admit(read_pod(core, "first")).ok
    binder.bind("default", "second", NODE)


def _kubeconfig(path: Path, url: str) -> None:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        f"clusters:\n- name: t\n  cluster:\n    server: {url}\n"
        "contexts:\n- name: t\n  context:\n    cluster: t\n    user: t\n"
        "users:\n- name: t\n  user:\n    token: test\n"
    )


def test_process_registers_and_sigterm_removes_its_socket(kubelet, core, api, plugin_dir, tmp_path):
    kc = tmp_path / "kubeconfig"
    _kubeconfig(kc, api.url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupack", "device-plugin", "--node-name", NODE, "--kubelet-dir", plugin_dir,
         "--kubeconfig", str(kc), "--fake-gpus", "2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert kubelet.wait_for(lambda: len(kubelet.devices) == 2 * SLOTS, 20), "plugin did not register"
        sock = os.path.join(plugin_dir, "gpupack.sock")
        assert os.path.exists(sock)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
        assert not os.path.exists(sock)
        assert "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unhealthy_assigned_gpu_fails_allocate_and_releases_the_node(kubelet, start_plugin, core):
    plugin, nvml = start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    binder = TestBinder(core, wait_s=2)
    make_pod(core, "victim")
    a = binder.bind("default", "victim", NODE)
    bad = a.containers["main"][0]
    nvml.inject_xid(bad.index, 79)
    assert kubelet.wait_for(lambda: kubelet.devices.get(f"{bad.uuid}::0") == UNHEALTHY, 5)
    res = kubelet.admit(read_pod(core, "victim"))
    assert not res.ok and f"assigned GPU {bad.uuid} is unhealthy" in res.error
    assert read_pod(core, "victim")["metadata"]["annotations"][ANN_HANDOFF] == "failed"
    make_pod(core, "after")
    a2 = binder.bind("default", "after", NODE)  # not blocked by the rejected pod
    assert a2.containers["main"][0].uuid != bad.uuid
    assert kubelet.admit(read_pod(core, "after")).ok


def test_pod_changed_during_allocate_is_reread_not_overwritten(kubelet, start_plugin, core, api):
    start_plugin()
    assert kubelet.wait_for(lambda: len(kubelet.devices) == 8 * SLOTS, 10)
    assert until(lambda: node_inventory(core)[0] is not None, 5)
    make_pod(core, "busy")
    a = TestBinder(core).bind("default", "busy", NODE)
    # Hold the plugin's PATCH while someone else writes the pod: its resourceVersion goes stale.
    api.delay(r"/pods/busy$", 0.5, method="PATCH", times=1)
    api.clear_requests()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("res", kubelet.admit(read_pod(core, "busy"))))
    t.start()
    assert until(lambda: api.count_requests("PATCH", r"/pods/busy$") >= 1, 5)
    core.patch_namespaced_pod("busy", "default", {"metadata": {"labels": {"touched": "yes"}}},
                              _content_type="application/merge-patch+json", _preload_content=False)
    t.join(15)
    res = out["res"]
    assert res.ok, res.error
    assert res.envs["main"]["NVIDIA_VISIBLE_DEVICES"] == a.containers["main"][0].uuid
    pod = read_pod(core, "busy")
    assert pod["metadata"]["labels"]["touched"] == "yes"  # the other writer's change survived
    assert pod["metadata"]["annotations"][ANN_HANDOFF] == "done"
    assert api.count_requests("PATCH", r"/pods/busy$") >= 3  # ours (409), theirs, ours again
