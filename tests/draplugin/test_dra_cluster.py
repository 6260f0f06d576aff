"""`gpupack dra-plugin` against the real parts: the v1.36 kube-apiserver, kube-scheduler (its DRA
allocator) and controller-manager (the ResourceClaim controller), and the kubelet's own DRA manager
and plugin manager (bin/dramanager-harness of the v1.36.2 assets).

The tests of this module share one set-up (the `env` fixture: one fake GPU node, the deploy/dra
DeviceClasses, one kube-scheduler with a profile of its own) on the session's control plane; they run
in order: the slice first, then claims prepared through the harness, restarts, unprepare. Where the
server serves no resource.k8s.io/v1 (Kubernetes 1.28) they are skipped, and the refusal test runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import realk8s
import yaml
from kubernetes import client
from processes import error_lines

from draplugin import slices
from draplugin.claims import MIB, parse_quantity

REPO = Path(__file__).resolve().parents[2]
DEVICEPLUGIN_TESTS = str(REPO / "tests" / "deviceplugin")  # the fake NVML (fake_nvml.py)
NODE = "dra-node-0"
NS = "dra-test"
SCHEDULER = "gpupack-dra-test"
MEM_MIB = 81920
GPUS = 3


def _serves_dra(k8s: realk8s.ControlPlane) -> bool:
    try:
        res = k8s._get("/apis/resource.k8s.io/v1")
    except Exception:  # 404 before 1.34
        return False
    return any(r["name"] == "resourceslices" for r in res.get("resources", []))


class Env:
    def __init__(self, k8s: realk8s.ControlPlane, work: Path) -> None:
        self.k8s = k8s
        self.work = work
        self.cdi = work / "cdi"
        self.xids = work / "xids"
        self.xids.write_text("")
        self.nvml = work / "nvml.yaml"
        self.nvml.write_text(yaml.safe_dump({
            "gpus": GPUS, "memory_mib": MEM_MIB, "sm_count": 108, "model": "NVIDIA A100-SXM4-80GB",
            "uuid_seed": NODE, "faults": {"xid_file": str(self.xids)},
        }))  # fmt: skip
        self.resource = client.ResourceV1Api(k8s.api_client())

    def plugin_cmd(
        self, registry: str = '"$HARNESS_REGISTRY_DIR"', plugins: str = '"$HARNESS_PLUGINS_DIR"'
    ) -> str:
        return (
            f"PYTHONPATH={shlex.quote(DEVICEPLUGIN_TESTS)} exec {shlex.quote(sys.executable)} -m gpupack.cli "
            f"dra-plugin --node-name {NODE} --kubeconfig {shlex.quote(str(self.k8s.kubeconfig))} "
            f"--registry-dir {registry} --plugins-dir {plugins} --cdi-dir {shlex.quote(str(self.cdi))} "
            f"--nvml-module fake_nvml --nvml-config {shlex.quote(str(self.nvml))}"
        )

    def start_plugin(self, log: Path) -> subprocess.Popen[bytes]:
        cmd = self.plugin_cmd(str(self.work / "reg"), str(self.work / "plugins"))
        return subprocess.Popen(["sh", "-c", cmd], stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO)

    def slice(self) -> dict[str, Any] | None:
        try:
            return self.k8s.api_client().sanitize_for_serialization(
                self.resource.read_resource_slice(slices.slice_name(NODE))
            )
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def node_slices(self) -> list[Any]:
        return self.resource.list_resource_slice(field_selector=f"spec.nodeName={NODE}").items

    def harness(self, name: str, pods: list[str], **env: str) -> list[dict[str, Any]]:
        """One run of the kubelet's DRA manager with the plugin; its events (exit code in `done`)."""
        e = {
            **os.environ,
            "HARNESS_DIR": str(self.work / "kubelet"),
            "HARNESS_KUBECONFIG": str(self.k8s.kubeconfig),
            "HARNESS_PODS": json.dumps([f"{NS}/{p}" for p in pods]),
            "HARNESS_PLUGIN_CMD": self.plugin_cmd(),
            "HARNESS_PLUGIN_LOG": str(self.work / f"{name}-plugin.log"),
            "HARNESS_DRIVER": slices.DRIVER,
            "HARNESS_TIMEOUT": "120",
            **env,
        }
        harness = realk8s.binary("dramanager-harness", self.k8s.assets)
        out = self.work / f"{name}.jsonl"
        with out.open("wb") as f:
            p = subprocess.run([str(harness)], env=e, stdout=f, stderr=(self.work / f"{name}.err").open("wb"),
                               timeout=150, cwd=REPO)  # fmt: skip
        events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        assert p.returncode == 0, (
            f"harness exit {p.returncode}: {events[-5:]}\n{(self.work / f'{name}-plugin.log').read_text()[-3000:]}"
        )
        return events


@pytest.fixture(scope="module")
def env(k8s: realk8s.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not _serves_dra(k8s):
        pytest.skip("this API server serves no resource.k8s.io/v1 (DRA is GA from Kubernetes 1.34)")
    work = tmp_path_factory.mktemp("dra")
    e = Env(k8s, work)
    k8s.make_node(NODE)
    k8s.ensure_namespace(NS)
    k8s.kubectl("apply", "-f", str(REPO / "deploy" / "dra" / "deviceclasses.yaml"))
    sched = k8s.start_scheduler({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "profiles": [{"schedulerName": SCHEDULER}],
    }, name="dra-scheduler")  # fmt: skip
    try:
        yield e
    finally:
        sched.stop()
        with contextlib.suppress(client.ApiException):
            k8s.core.delete_collection_namespaced_pod(NS, grace_period_seconds=0)
        for ns in (NS, "gpupack-system", "gpupack-demo"):
            with contextlib.suppress(client.ApiException):
                k8s.core.delete_namespace(ns)
        for s in e.node_slices():
            with contextlib.suppress(client.ApiException):
                e.resource.delete_resource_slice(s.metadata.name)
        for c in ("gpupack-online", "gpupack-offline"):
            with contextlib.suppress(client.ApiException):
                e.resource.delete_device_class(c)
        with contextlib.suppress(client.ApiException):
            k8s.core.delete_node(NODE)


def _device(s: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in s["spec"]["devices"] if d["name"] == name)


def test_slice_published_kept_current_and_never_duplicated(env: Env) -> None:
    log = env.work / "standalone.log"
    p = env.start_plugin(log)
    try:
        s = realk8s.until(env.slice, 30, "the node's ResourceSlice")
        node_uid = env.k8s.core.read_node(NODE).metadata.uid
        assert s["metadata"]["ownerReferences"][0]["uid"] == node_uid
        assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1", "gpu-2"]
        assert parse_quantity(_device(s, "gpu-0")["capacity"]["memory"]["value"]) == MEM_MIB * MIB
        # a GPU turns unhealthy (XID 79: fell off the bus): tainted, marked, a new pool generation
        with env.xids.open("a") as f:
            f.write("2 79\n")
        s = realk8s.until(
            lambda: (x := env.slice()) and "taints" in _device(x, "gpu-2") and x, 20, "gpu-2 tainted"
        )
        assert _device(s, "gpu-2")["taints"][0]["key"] == "gpu.gpupack.io/unhealthy"
        assert _device(s, "gpu-2")["attributes"]["healthy"] == {"bool": False}
        assert s["spec"]["pool"]["generation"] == 2
        # deleted (as a kubelet's start wipes a node's slices): published again at once
        env.resource.delete_resource_slice(slices.slice_name(NODE))
        realk8s.until(
            lambda: (x := env.slice()) and x["metadata"]["uid"] != s["metadata"]["uid"],
            20,
            "slice re-created",
        )
    finally:
        p.terminate()
        p.wait(15)
    # a restarted plugin (GPU health starts afresh) updates the one slice, never adds a second
    env.xids.write_text("")  # the fake NVML would deliver the XID again to a new process
    p = env.start_plugin(log)
    try:
        realk8s.until(
            lambda: (x := env.slice()) and "taints" not in _device(x, "gpu-2"),
            30,
            "slice updated after restart",
        )
        assert len(env.node_slices()) == 1
    finally:
        p.terminate()
        p.wait(15)
    assert p.returncode == 0, log.read_text()[-2000:]


def _pod(name: str, template: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "schedulerName": SCHEDULER,
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [{"name": "ctr", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }


def _template(name: str, cls: str, capacity: dict[str, str] | None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}  # fmt: skip


def test_shares_allocated_by_the_scheduler_prepared_by_the_kubelet(env: Env) -> None:
    k8s = env.k8s
    if env.slice() is None:  # the slice test publishes it; alone, publish it here
        p = env.start_plugin(env.work / "standalone.log")
        try:
            realk8s.until(env.slice, 30, "the node's ResourceSlice")
        finally:
            p.terminate()
            p.wait(15)
    env.resource.create_namespaced_resource_claim_template(
        NS, _template("share", "gpupack-online", {"memory": "20Gi", "sm": "40"})
    )
    env.resource.create_namespaced_resource_claim_template(NS, _template("whole", "gpupack-offline", None))
    # the whole GPU first (a GPU of its own), then five shares of 20 GiB + 40 %: two fit on a GPU
    # by SM (3 x 40 > 100), so the fifth finds no room on the node
    pods = ["whole", "s1", "s2", "s3", "s4"]
    for name in [*pods, "s5"]:
        k8s.core.create_namespaced_pod(NS, _pod(name, "whole" if name == "whole" else "share"))
        if name == "whole":
            realk8s.until(lambda: k8s.core.read_namespaced_pod("whole", NS).spec.node_name, 30, "whole bound")
    for name in pods:
        realk8s.until(
            lambda n=name: k8s.core.read_namespaced_pod(n, NS).spec.node_name == NODE, 60, f"{name} bound"
        )

    def unschedulable() -> bool:
        conds = k8s.core.read_namespaced_pod("s5", NS).status.conditions or []
        return any(c.type == "PodScheduled" and c.status == "False" for c in conds)

    realk8s.until(unschedulable, 60, "s5 found no GPU with 40 % SM left")
    claims = {
        c["metadata"]["ownerReferences"][0]["name"]: c
        for c in (k8s.api_client().sanitize_for_serialization(x) for x in env.resource.list_namespaced_resource_claim(NS).items)
    }  # fmt: skip
    used: dict[str, list[int]] = {}
    shares = set()
    for name in pods:
        (r,) = claims[name]["status"]["allocation"]["devices"]["results"]
        u = used.setdefault(r["device"], [0, 0])
        u[0] += int(parse_quantity(r["consumedCapacity"]["memory"]) / MIB)
        u[1] += int(parse_quantity(r["consumedCapacity"]["sm"]))
        shares.add(r["shareID"])
    assert len(shares) == len(pods)
    assert len(used) == 3 and all(m <= MEM_MIB and sm <= 100 for m, sm in used.values()), used
    assert "status" not in claims["s5"] or not claims["s5"]["status"].get("allocation")

    s = env.slice()
    assert s is not None
    uuid_of = {d["name"]: d["attributes"]["uuid"]["string"] for d in s["spec"]["devices"]}
    want = {}
    for name in pods:
        (r,) = claims[name]["status"]["allocation"]["devices"]["results"]
        want[name] = (claims[name]["metadata"]["uid"], r["device"])

    # run 1: as the node's kubelet (its start wipes the node's slices; the plugin publishes again),
    # prepare, then a kubelet restart from its checkpoint and the re-prepare of the pods' sandboxes
    ev = env.harness("run1", pods, HARNESS_NODE=NODE, HARNESS_RESTART="kubelet")
    assert any(e["event"] == "slices_wiped" for e in ev)
    for name in pods:
        uid, dev = want[name]
        ids = [e["cdi_devices"] for e in ev if e["event"] == "container" and e["pod"] == f"{NS}/{name}"]
        sources = [e["source"] for e in ev if e["event"] == "container" and e["pod"] == f"{NS}/{name}"]
        assert sources == ["prepare", "checkpoint", "reprepare"], ev
        # the re-prepare repeats the id (a v1.36.2 kubelet bug, fixed upstream later): the same id
        assert all(set(x) == {f"gpu.gpupack.io/gpu={uid}-{dev}"} for x in ids), ids
        spec = json.loads((env.cdi / f"gpupack-{uid}.json").read_text())
        (d,) = spec["devices"]
        cenv = dict(x.split("=", 1) for x in d["containerEdits"]["env"])
        assert cenv["NVIDIA_VISIBLE_DEVICES"] == uuid_of[dev]
        if name == "whole":
            assert not any(k.startswith("CUDA_") for k in cenv), cenv
            assert spec["annotations"]["gpu.gpupack.io/class"] == "offline"
        else:
            assert cenv["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m" and cenv["CUDA_DEVICE_SM_LIMIT"] == "40"
            assert cenv["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
            assert cenv["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert sorted(os.listdir(env.cdi)) == sorted(f"gpupack-{uid}.json" for uid, _ in want.values())
    want_holds = {want["whole"][1]: "offline", want["s1"][1]: "online", want["s3"][1]: "online"}

    def holds() -> dict[str, str] | None:
        s = env.slice()
        return {d["name"]: d["attributes"]["holds"]["string"] for d in s["spec"]["devices"]} if s else None

    # the slice comes back after the kubelet's wipe, and its holds follow the prepares a moment later
    realk8s.until(lambda: holds() == want_holds, 30, f"the slice published again with holds {want_holds}")

    # online and offline apart by the allocator: a small offline share finds no GPU (the GPUs with
    # room hold online claims), a small online share still packs beside the online ones
    env.resource.create_namespaced_resource_claim_template(
        NS, _template("small-off", "gpupack-offline", {"memory": "1Gi", "sm": "10"})
    )
    env.resource.create_namespaced_resource_claim_template(
        NS, _template("small-on", "gpupack-online", {"memory": "1Gi", "sm": "10"})
    )
    k8s.core.create_namespaced_pod(NS, _pod("late-off", "small-off"))
    k8s.core.create_namespaced_pod(NS, _pod("late-on", "small-on"))
    realk8s.until(
        lambda: k8s.core.read_namespaced_pod("late-on", NS).spec.node_name == NODE, 60, "late-on bound"
    )
    late = {
        c.metadata.owner_references[0].name: c for c in env.resource.list_namespaced_resource_claim(NS).items
    }
    assert late["late-on"].status.allocation.devices.results[0].device in (want["s1"][1], want["s3"][1])

    def off_unschedulable() -> bool:
        conds = k8s.core.read_namespaced_pod("late-off", NS).status.conditions or []
        return any(c.type == "PodScheduled" and c.status == "False" for c in conds)

    realk8s.until(off_unschedulable, 60, "late-off kept off the GPUs holding online claims")
    k8s.core.delete_namespaced_pod("late-off", NS, grace_period_seconds=0)

    # run 2: the same kubelet state, the plugin restarted, then every pod unprepared
    ev2 = env.harness(
        "run2", pods, HARNESS_KEEP_CHECKPOINT="1", HARNESS_RESTART="plugin", HARNESS_UNPREPARE="1"
    )
    assert any(e["event"] == "reregistered" for e in ev2)
    for name in pods:
        uid, dev = want[name]
        got = {
            i
            for e in ev2
            if e["event"] == "container" and e["pod"] == f"{NS}/{name}"
            for i in e["cdi_devices"]
        }
        assert got == {f"gpu.gpupack.io/gpu={uid}-{dev}"}
    assert sum(e["event"] == "unprepared" for e in ev2) == len(pods)
    assert os.listdir(env.cdi) == []
    assert len(env.node_slices()) == 1
    # the plugin's last sync before it stopped: no GPU holds a class any more
    s = env.slice()
    assert s is not None and {d["attributes"]["holds"]["string"] for d in s["spec"]["devices"]} == {""}


def test_deploy_dra_component_accepted_by_the_api_server(env: Env, tmp_path: Path) -> None:
    k8s = env.k8s
    copy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", copy)
    k = yaml.safe_load((copy / "kustomization.yaml").read_text())
    k["components"] = ["dra"]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(k))
    objs = [o for o in yaml.safe_load_all(k8s.kubectl("kustomize", str(copy))) if o]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("DaemonSet", "gpupack-dra-plugin") in kinds and (
        "DaemonSet",
        "gpupack-device-plugin",
    ) not in kinds
    dra = [o for o in objs if "dra" in o["metadata"]["name"] or o["kind"] in ("DeviceClass", "Namespace")]
    examples = [
        o for f in ("dra-share.yaml", "dra-whole-gpu.yaml")
        for o in yaml.safe_load_all((REPO / "deploy" / "examples" / f).read_text()) if o
    ]  # fmt: skip
    k8s.ensure_namespace("gpupack-system")
    k8s.ensure_namespace("gpupack-demo")
    try:
        out = k8s.kubectl(
            "apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(dra + examples)
        )
    finally:  # gpupack-system goes with the module (the next test applies deploy/dra/ into it)
        with contextlib.suppress(client.ApiException):
            k8s.core.delete_namespace("gpupack-demo")
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == len(dra) + len(examples), out
    assert {o["kind"] for o in dra} >= {"DaemonSet", "ClusterRole", "ClusterRoleBinding", "ServiceAccount",
                                         "DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}  # fmt: skip


def test_plugin_runs_on_its_rbac_and_writes_only_its_own_nodes_slice(env: Env) -> None:
    """deploy/dra's ServiceAccount, ClusterRole and admission policy applied for real: the plugin,
    with the token a DaemonSet pod on the node gets, publishes its slice; the same token cannot
    write another node's slice."""
    k8s, ns, sa = env.k8s, "gpupack-system", "gpupack-dra-plugin"
    k8s.ensure_namespace(ns)
    for f in ("serviceaccount.yaml", "rbac.yaml", "policy.yaml"):
        k8s.kubectl("apply", "--server-side", "-f", str(REPO / "deploy" / "dra" / f))
    try:
        pod = k8s.core.create_namespaced_pod(ns, {"metadata": {"name": "dra-plugin-pod"}, "spec": {
            "nodeName": NODE, "serviceAccountName": sa, "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})  # fmt: skip
        token = k8s.core.create_namespaced_service_account_token(sa, ns, {"spec": {"expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}}}).status.token  # fmt: skip
        assert k8s.token_node_claim(token) == NODE
        as_plugin = client.ResourceV1Api(k8s.new_api_client(token))
        other = slices.resource_slice("some-other-node", [])
        other["spec"]["devices"] = []

        def refused() -> str:
            try:
                as_plugin.create_resource_slice(other)
            except client.ApiException as e:
                return e.body if "may write only the ResourceSlices of its own node" in (e.body or "") else ""
            # created before the policy took effect: remove it, try again
            env.resource.delete_resource_slice(other["metadata"]["name"])
            return ""

        assert NODE in realk8s.until(refused, 30, "the own-node policy refusing another node's slice")
        env.resource.delete_resource_slice(slices.slice_name(NODE))
        kubeconfig = k8s.write_kubeconfig(env.work / "plugin-sa.kubeconfig", token=token)
        cmd = env.plugin_cmd(str(env.work / "reg"), str(env.work / "plugins")).replace(
            str(k8s.kubeconfig), str(kubeconfig)
        )
        log = env.work / "rbac-plugin.log"
        p = subprocess.Popen(["sh", "-c", cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
        try:
            realk8s.until(env.slice, 30, "the slice published with the DaemonSet's permissions")
        finally:
            p.terminate()
            p.wait(15)
        assert "Forbidden" not in log.read_text() and "failed" not in log.read_text(), log.read_text()[-2000:]
    finally:
        k8s.kubectl("delete", "--ignore-not-found", "-f", str(REPO / "deploy" / "dra" / "policy.yaml"),
                    "-f", str(REPO / "deploy" / "dra" / "rbac.yaml"))  # fmt: skip


def test_refused_where_dra_is_not_served(k8s: realk8s.ControlPlane, tmp_path: Path) -> None:
    """Kubernetes before 1.34 (the suite's v1.28): one line, status 1; the device plugin stays the way."""
    if _serves_dra(k8s):
        pytest.skip("this API server serves resource.k8s.io/v1; the refusal is checked on v1.28")
    p = subprocess.run(
        [sys.executable, "-m", "gpupack.cli", "dra-plugin", "--node-name", "n1", "--kubeconfig", str(k8s.kubeconfig),
         "--registry-dir", str(tmp_path / "reg"), "--plugins-dir", str(tmp_path / "plugins"),
         "--cdi-dir", str(tmp_path / "cdi"), "--nvml-module", "fake_nvml", "--nvml-config", "{gpus: 1}"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": DEVICEPLUGIN_TESTS},
    )  # fmt: skip
    assert p.returncode == 1
    assert error_lines(p.stderr) == [
        "gpupack dra-plugin: this cluster does not serve resource.k8s.io/v1 (DRA needs Kubernetes 1.34 "
        "or later); use gpupack device-plugin"
    ]
    assert not (tmp_path / "reg").exists()  # nothing served
