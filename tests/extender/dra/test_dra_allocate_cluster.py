"""gpupack allocating DRA claims against the real v1.36 parts: kube-apiserver (the MutatingAdmissionPolicy
that gates pods, claim status validation), kube-controller-manager (claims made from templates,
deallocation) and an unmodified kube-scheduler honouring the allocation and binding the pod.

One set-up for the module (two fake nodes of two 80 GiB GPUs with `gpupack dra-plugin`'s slices, the
deploy/dra DeviceClasses, a scheduler profile of its own, the allocator in this process); skipped
where the server serves no resource.k8s.io/v1 (Kubernetes 1.28).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import realk8s
from kubernetes import client

from draplugin.slices import resource_slice
from extender.controllers.dra.allocator import Writer, placed_node
from extender.controllers.dra.claims import GATE
from extender.controllers.dra.controller import DraAllocator
from gpupack.contract import GPUInfo, parse_quantity
from gpupack.core.policies import get_policy
from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient

REPO = Path(__file__).resolve().parents[3]
NS = "dra-allocate"
SCHED = "gpupack-dra-allocate-test"
NODES = ("dra-alloc-0", "dra-alloc-1")
CLASSES = {"gpupack-online": "online", "gpupack-offline": "offline"}
GI = 1 << 30


class Env:
    def __init__(self, k8s: realk8s.ControlPlane) -> None:
        self.k8s = k8s
        self.api = k8s.api_client()
        self.res = client.ResourceV1Api(self.api)
        self.core = k8s.core
        self.alloc: DraAllocator | None = None
        self.gating_policy = False

    def start_allocator(self, node_only: bool = False) -> DraAllocator:
        api = self.k8s.new_api_client()
        events = EventRecorder(KubeClient(api), "test", "gpupack-dra-allocator")
        # BestFit (the core's tightest-GPU policy): a packing the assertions can name whatever the
        # order the pods come in; which node and GPU the default policy picks is the replay's business
        # (benchmarks/replay_dra_gpupack.py: the same placements as the simulator's)
        self.alloc = DraAllocator(api, get_policy("bestfit"), CLASSES, events, node_only=node_only)
        self.alloc.start()
        assert self.alloc.store.wait_synced(30)
        return self.alloc

    def stop_allocator(self) -> None:
        if self.alloc is not None:
            self.alloc.stop()
            self.alloc = None

    def claims(self) -> list[dict[str, Any]]:
        return list(
            json.loads(self.res.list_namespaced_resource_claim(NS, _preload_content=False).data)["items"]
        )

    def pod(self, name: str) -> Any:
        return self.core.read_namespaced_pod(name, NS)


def _serves_dra(k8s: realk8s.ControlPlane) -> bool:
    try:
        res = k8s._get("/apis/resource.k8s.io/v1")
    except Exception:  # 404 before 1.34
        return False
    return any(r["name"] == "resourceslices" for r in res.get("resources", []))


def _template(name: str, cls: str, capacity: dict[str, str] | None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}  # fmt: skip


@pytest.fixture(scope="module")
def env(k8s: realk8s.ControlPlane) -> Iterator[Env]:
    if not _serves_dra(k8s):
        pytest.skip("this API server serves no resource.k8s.io/v1 (gpupack allocating DRA claims needs 1.36)")
    e = Env(k8s)
    k8s.kubectl("apply", "-f", str(REPO / "deploy" / "dra" / "deviceclasses.yaml"))
    try:
        k8s.kubectl("apply", "-f", str(REPO / "deploy" / "examples" / "dra-allocate-gate.yaml"))
        e.gating_policy = True
    except Exception as err:  # a server without MutatingAdmissionPolicy v1: the tests gate pods themselves
        print(f"gate policy not applied: {err}")
    k8s.ensure_namespace(NS)
    if (
        e.gating_policy
    ):  # in force once a dry run shows the gate (the server's policy cache follows the apply)
        probe = _pod(e, "probe", "share-online", gate=False)
        realk8s.until(
            lambda: k8s.core.create_namespaced_pod(NS, probe, dry_run="All").spec.scheduling_gates,
            30,
            "the gate policy in force",
        )
    for n in NODES:
        k8s.make_node(n, cpu="32", memory="128Gi")
        gpus = [GPUInfo(uuid=f"GPU-{n}-{j}", index=j, model="NVIDIA A100-SXM4-80GB", mem_mib=81920, sm_count=108)
                for j in range(2)]  # fmt: skip
        e.res.create_resource_slice(resource_slice(n, gpus, node_uid=k8s.core.read_node(n).metadata.uid))
    for name, cls, cap in (("share-online", "gpupack-online", {"memory": "20Gi", "sm": "40"}),
                           ("share-offline", "gpupack-offline", {"memory": "20Gi", "sm": "40"}),
                           ("hostile", "gpupack-online", {"memory": "1Gi", "cores": "3"})):  # fmt: skip
        e.res.create_namespaced_resource_claim_template(NS, _template(name, cls, cap))
    sched = k8s.start_scheduler({"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
                                 "profiles": [{"schedulerName": SCHED}]}, name="dra-allocate-scheduler")  # fmt: skip
    e.start_allocator()
    try:
        yield e
    finally:
        e.stop_allocator()
        sched.stop()
        if e.gating_policy:  # other tests' pods with claims must not be gated by it
            k8s.kubectl(
                "delete", "-f", str(REPO / "deploy" / "examples" / "dra-allocate-gate.yaml"), check=False
            )
            # gone once a dry run shows no gate (the server's policy cache follows the delete)
            probe = _pod(e, "probe", "share-online", gate=False)
            realk8s.until(
                lambda: not k8s.core.create_namespaced_pod(NS, probe, dry_run="All").spec.scheduling_gates,
                30,
                "the gate policy gone",
            )
        k8s.core.delete_namespace(NS)
        for n in NODES:
            k8s.core.delete_node(n)


@pytest.fixture(autouse=True)
def _no_pods_left(env: Env) -> Iterator[None]:
    """A test that fails midway must not leave its pods holding the GPUs the next tests need."""
    yield
    env.core.delete_collection_namespaced_pod(NS, grace_period_seconds=0)
    realk8s.until(
        lambda: not env.core.list_namespaced_pod(NS).items and not env.claims(), 60, "pods and claims gone"
    )


def _pod(env: Env, name: str, template: str | None, gate: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "x", "resources": {"requests": {"cpu": "1"}}}
    spec: dict[str, Any] = {"schedulerName": SCHED, "containers": [c], "terminationGracePeriodSeconds": 0}
    if template:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
        c["resources"]["claims"] = [{"name": "gpu"}]
    if gate and not (env.gating_policy and template):  # the policy gates pods naming claims
        spec["schedulingGates"] = [{"name": GATE}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _bound(env: Env, names: list[str], timeout: float = 40) -> dict[str, str]:
    def all_bound() -> dict[str, str] | None:
        nodes = {n: env.pod(n).spec.node_name for n in names}
        return nodes if all(nodes.values()) else None

    out: dict[str, str] = realk8s.until(all_bound, timeout, f"pods {names} bound", interval=0.1)
    return out


def _check_devices(env: Env) -> dict[tuple[str, str], set[str]]:
    """Per device: the classes of the claims on it; asserts no memory/SM overfill and that every
    claim's pod is bound on the claim's node."""
    mem: dict[tuple[str, str], Decimal] = {}
    sm: dict[tuple[str, str], Decimal] = {}
    classes: dict[tuple[str, str], set[str]] = {}
    for c in env.claims():
        alloc = (c.get("status") or {}).get("allocation")
        if not alloc:
            continue
        cls = c["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]
        for r in alloc["devices"]["results"]:
            key = (r["pool"], r["device"])
            mem[key] = mem.get(key, Decimal(0)) + parse_quantity(r["consumedCapacity"]["memory"])
            sm[key] = sm.get(key, Decimal(0)) + parse_quantity(r["consumedCapacity"]["sm"])
            classes.setdefault(key, set()).add(cls)
            uuid.UUID(r["shareID"])
        for ref in c["status"].get("reservedFor") or []:
            bound = env.pod(ref["name"]).spec.node_name
            assert bound in (None, placed_node(c)), (c["metadata"]["name"], bound)
    assert all(v <= 80 * GI for v in mem.values()), mem
    assert all(v <= 100 for v in sm.values()), sm
    return classes


def test_both_classes_created_at_once_are_packed_apart_and_bound_where_allocated(env: Env) -> None:
    names = [f"on-{i}" for i in range(4)] + [f"off-{i}" for i in range(4)]
    created = [  # all at once: the scheduler sees none of them before gpupack has allocated it
        env.core.create_namespaced_pod(
            NS, _pod(env, n, "share-online" if n.startswith("on") else "share-offline")
        )
        for n in names
    ]
    if env.gating_policy:  # as admitted (the allocator may have taken the gate off since)
        assert all(any(g.name == GATE for g in (p.spec.scheduling_gates or [])) for p in created)
    nodes = _bound(env, names)
    classes = _check_devices(env)
    assert all(len(v) == 1 for v in classes.values()), classes  # online and offline never on one GPU
    used = {c: sum(1 for v in classes.values() if v == {c}) for c in CLASSES}
    assert used == {"gpupack-online": 2, "gpupack-offline": 2}, used  # 4 x 40 % packs onto 2 GPUs per class
    for c in env.claims():
        assert "resource.kubernetes.io/delete-protection" in c["metadata"].get("finalizers", [])
        pod = c["metadata"]["ownerReferences"][0]["name"]
        assert nodes[pod] == placed_node(c)
    # a ninth share finds no GPU of its class with room, and no empty GPU: it stays gated, with the reason
    env.core.create_namespaced_pod(NS, _pod(env, "on-late", "share-online"))
    realk8s.until(lambda: env.alloc is not None and any(r.reason for r in env.alloc.retry.values()), 20,
                  "the late pod refused")  # fmt: skip
    p = env.pod("on-late")
    assert not p.spec.node_name and any(g.name == GATE for g in p.spec.scheduling_gates or [])
    # room made (an online pod ends): the late pod is placed on the next pass after the change
    env.core.delete_namespaced_pod("on-0", NS, grace_period_seconds=0)
    _bound(env, ["on-late"], timeout=90)
    assert all(len(v) == 1 for v in _check_devices(env).values())
    for n in [*names[1:], "on-late"]:
        env.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
    realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")


def test_a_hostile_claim_stays_gated_alone_and_a_pod_without_gpupack_claims_is_ungated(env: Env) -> None:
    env.core.create_namespaced_pod(NS, _pod(env, "bad", "hostile"))
    env.core.create_namespaced_pod(NS, _pod(env, "good", "share-online"))
    env.core.create_namespaced_pod(NS, _pod(env, "cpu-only", None, gate=True))  # gated by hand, no claims
    _bound(env, ["good", "cpu-only"])

    def refused() -> Any:
        evs = env.core.list_namespaced_event(NS, field_selector="involvedObject.name=bad").items
        return [e for e in evs if e.reason == "GPUClaimRefused"]

    (ev,) = realk8s.until(refused, 20, "an Event on the hostile pod")
    assert "no capacity cores" in ev.message
    bad = env.pod("bad")
    assert not bad.spec.node_name and any(g.name == GATE for g in bad.spec.scheduling_gates or [])
    # its retries back off: no hot loop while nothing changes
    # its tries back off (1 s, 2 s, 4 s...) however often the cluster changes: no hot loop. Changes
    # are made here (other pods created and deleted) so that passes run while the pod is refused.
    assert env.alloc is not None
    tries = env.alloc.counts.refused
    t0 = time.monotonic()
    for i in range(6):
        env.core.create_namespaced_pod(NS, _pod(env, f"churn-{i}", None, gate=False))
    realk8s.until(lambda: time.monotonic() - t0 > 3.0, 5, "3 s of churn", interval=0.2)
    assert (
        env.alloc.counts.refused - tries <= 3
    )  # at most at 1 + 2 s after its first refusal (and one racing)
    for i in range(6):
        env.core.delete_namespaced_pod(f"churn-{i}", NS, grace_period_seconds=0)
    for n in ("bad", "good", "cpu-only"):
        env.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
    realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")


def test_a_restart_between_the_allocation_and_the_ungating_loses_nothing(env: Env) -> None:
    env.stop_allocator()
    env.core.create_namespaced_pod(NS, _pod(env, "r-0", "share-offline"))
    env.core.create_namespaced_pod(NS, _pod(env, "r-1", "share-offline"))

    def made() -> Any:
        p = env.pod("r-0")
        return p.status.resource_claim_statuses and p.status.resource_claim_statuses[0].resource_claim_name

    cname = realk8s.until(made, 20, "r-0's claim made")
    claim = json.loads(env.res.read_namespaced_resource_claim(cname, NS, _preload_content=False).data)
    pod = env.api.sanitize_for_serialization(env.pod("r-0"))
    # what a controller that crashed right after its allocation write left: the claim allocated, the pod gated
    results = [{"request": "gpu", "driver": "gpu.gpupack.io", "pool": NODES[1], "device": "gpu-1",
                "consumedCapacity": {"memory": "20Gi", "sm": "40"}}]  # fmt: skip
    written = Writer(env.api).allocate(claim, results, NODES[1], pod)
    share_id = written["status"]["allocation"]["devices"]["results"][0]["shareID"]
    # a stale second write (the crashed controller's view) fails on the resourceVersion: nothing booked twice
    with pytest.raises(client.ApiException) as e:
        Writer(env.api).allocate(claim | {"metadata": {**claim["metadata"], "finalizers": ["x/y"]}}, results,
                                 NODES[0], pod)  # fmt: skip
    assert e.value.status == 409
    env.start_allocator()
    nodes = _bound(env, ["r-0", "r-1"])
    assert nodes["r-0"] == NODES[1]
    after = json.loads(env.res.read_namespaced_resource_claim(cname, NS, _preload_content=False).data)
    assert after["status"]["allocation"]["devices"]["results"][0]["shareID"] == share_id  # not re-allocated
    classes = _check_devices(env)
    # r-1 was placed counting r-0's allocation from the claims alone: beside it (40 % + 40 %), not over it
    assert classes[(NODES[1], "gpu-1")] == {"gpupack-offline"}
    for n in ("r-0", "r-1"):
        env.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
    realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")


def test_a_tenant_can_neither_skip_the_gate_nor_take_it_off(env: Env, tmp_path: Path) -> None:
    if not env.gating_policy:
        pytest.skip("the server serves no MutatingAdmissionPolicy v1: the gate policies cannot be applied")
    env.stop_allocator()  # nothing ungates while the tenant tries
    try:
        rbac = client.RbacAuthorizationV1Api(env.api)
        rbac.create_namespaced_role(NS, {"metadata": {"name": "tenant"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "update", "patch"]}]})  # fmt: skip
        rbac.create_namespaced_role_binding(NS, {
            "metadata": {"name": "tenant"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                        "name": "tenant"},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": NS}]})  # fmt: skip
        kc = env.k8s.service_account_kubeconfig(tmp_path / "tenant.kubeconfig", NS, "tenant")
        from kubernetes import config as kconfig

        tenant = client.CoreV1Api(kconfig.new_client_from_config(str(kc)))
        body = _pod(env, "t-0", "share-online", gate=False)  # the tenant asks no gate: it gets one
        realk8s.until(lambda: _try_create(tenant, body), 20, "the tenant's pod created")
        p = env.pod("t-0")
        assert any(g.name == GATE for g in p.spec.scheduling_gates or [])
        with pytest.raises(client.ApiException) as e:
            tenant.patch_namespaced_pod("t-0", NS, [{"op": "remove", "path": "/spec/schedulingGates"}])
        assert e.value.status in (403, 422) and "only gpupack's DRA allocator" in e.value.body
    finally:
        env.start_allocator()
    _bound(env, ["t-0"])  # the allocator may
    env.core.delete_namespaced_pod("t-0", NS, grace_period_seconds=0)
    realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")


def _try_create(api: client.CoreV1Api, body: dict[str, Any]) -> bool:
    try:
        api.create_namespaced_pod(NS, body)
        return True
    except client.ApiException as e:
        if e.status == 403:  # the Role's grant not yet seen by the authorizer
            return False
        raise


def test_gpupack_extender_dra_allocate_places_gated_pods(env: Env, tmp_path: Path) -> None:
    """The wiring: `gpupack extender --dra-allocate --dra-place-pods` runs the allocator; a gated pod
    with no claims is pinned to the node the policy picks."""
    from processes import ExtenderProcess

    env.stop_allocator()
    ext = ExtenderProcess(env.k8s.kubeconfig, tmp_path / "extender.log", "--dra-allocate", "--dra-place-pods")
    try:
        ext.wait_ready(60)
        env.core.create_namespaced_pod(NS, _pod(env, "x-gpu", "share-offline"))
        env.core.create_namespaced_pod(NS, _pod(env, "x-cpu", None, gate=True))
        nodes = _bound(env, ["x-gpu", "x-cpu"], timeout=60)
        cpu = env.pod("x-cpu")
        assert cpu.metadata.annotations["gpupack.io/dra-pinned-node"] == nodes["x-cpu"]
        (term,) = (
            cpu.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        )
        assert term.match_fields[0].values == [nodes["x-cpu"]]
        # its counts in the extender's /metrics
        assert ext.metric("gpupack_dra_allocator_claims_allocated_total") >= 1
        assert ext.metric("gpupack_dra_allocator_pods_ungated_total") >= 2
    finally:
        ext.proc.terminate()
        ext.proc.wait(10)
        env.start_allocator()
    for n in ("x-gpu", "x-cpu"):
        env.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
    realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")


def test_node_only_pins_the_node_and_the_scheduler_allocates_the_gpu_there(env: Env) -> None:
    """The node-only option (a measurement): gpupack writes the pin, kube-scheduler's in-tree
    allocator allocates each claim on the pinned node, within capacity."""
    env.stop_allocator()
    env.start_allocator(node_only=True)
    try:
        names = [f"node-only-{i}" for i in range(3)]
        for n in names:  # all at once: each placement counts the ones pinned before it (not yet allocated)
            env.core.create_namespaced_pod(NS, _pod(env, n, "share-online"))
        nodes = _bound(env, names)
        for n in names:
            assert (env.pod(n).metadata.annotations or {}).get("gpupack.io/dra-pinned-node") == nodes[n]
        claims = env.claims()
        assert len(claims) == 3
        for c in claims:
            assert placed_node(c) == nodes[c["metadata"]["ownerReferences"][0]["name"]]
        _check_devices(env)  # no memory/SM overfill
        for n in names:
            env.core.delete_namespaced_pod(n, NS, grace_period_seconds=0)
        realk8s.until(lambda: not env.claims(), 60, "claims of deleted pods gone")
    finally:
        env.stop_allocator()
        env.start_allocator()
