"""gpupack allocating DRA claims in a real install: the extender's own ServiceAccount token (as the
shipped Deployment has it), under the shipped admission policies (deploy/webhook/policies.yaml's
gpupack-scheduler-scope and deploy/dra/allocate.yaml's gate-kept policy), against the real API
server. The allocator's own write (extender/controllers/dra/allocator.py Writer.ungate: gate off,
other gates kept, the pin to one node) goes through on a gated pod and nowhere else; the same
spec change on an ungated pod, any other spec change, and a tenant taking the gate off are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import deploy_objects
import pytest
from kubernetes import client
from realk8s import ControlPlane, until

from extender.controllers.dra.allocator import PIN_ANNOTATION, Writer
from extender.controllers.dra.claims import GATE

SCOPE = "may change only a pod's gpupack.io/"
KEPT = "only gpupack's DRA allocator removes the scheduling gate"
OTHER_GATE = "example.com/quota"


def _refused(fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(client.ApiException) as e:
        fn(*args, **kw)
    assert e.value.status in (403, 422), e.value.body
    return str(json.loads(e.value.body)["message"])


class Env:
    def __init__(self, k8s: ControlPlane, sys_ns: str, ns: str) -> None:
        self.k8s, self.sys_ns, self.ns = k8s, sys_ns, ns
        ext_api = k8s.new_api_client(k8s.service_account_token(sys_ns, "gpupack-extender"))
        self.extender, self.writer = client.CoreV1Api(ext_api), Writer(ext_api)
        self.tenant = client.CoreV1Api(k8s.new_api_client(k8s.service_account_token(ns, "app")))

    def pod(self, name: str, gates: list[str], **spec: Any) -> dict[str, Any]:
        body = {"metadata": {"name": name}, "spec": {
            "containers": [{"name": "a", "image": "registry.invalid/x:1"}],
            "schedulingGates": [{"name": g} for g in gates], **spec}}  # fmt: skip
        self.k8s.core.create_namespaced_pod(self.ns, body)
        return self.read(name)

    def read(self, name: str) -> dict[str, Any]:
        r = self.k8s.core.read_namespaced_pod(name, self.ns, _preload_content=False)
        return dict(json.loads(r.data))


@pytest.fixture(scope="module")
def env(k8s: ControlPlane) -> Iterator[Env]:
    sfx = deploy_objects.suffix()
    sys_ns, ns = f"gpsys-dra-{sfx}", f"tenant-dra-{sfx}"
    for n in (sys_ns, ns):
        k8s.ensure_namespace(n)
    # the gate policy is not needed here (pods are made with their gates), and v1.28 serves no
    # MutatingAdmissionPolicy: the gate-kept policy, the allocator's RBAC and the extender's own
    allocate = [o for o in deploy_objects.load("dra/allocate.yaml") if not o["kind"].startswith("Mutating")]
    shipped = [o for f in ("scheduler/serviceaccount.yaml", "scheduler/rbac.yaml", "webhook/policies.yaml")
               for o in deploy_objects.load(f)] + allocate  # fmt: skip
    deploy_objects.apply(k8s, k8s.for_this_server(deploy_objects.remap(shipped, sys_ns)))
    client.RbacAuthorizationV1Api(k8s.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "app", "namespace": ns}]})  # fmt: skip
    e = Env(k8s, sys_ns, ns)

    def enforced() -> bool:  # each policy is compiled on its own: probe both
        e.pod("probe", [GATE])
        try:
            try:
                e.extender.patch_namespaced_pod("probe", ns, {"spec": {"activeDeadlineSeconds": 5}})
                return False
            except client.ApiException as x:
                if SCOPE not in x.body:
                    return False
            try:
                e.tenant.patch_namespaced_pod("probe", ns, {"spec": {"schedulingGates": None}})
                return False
            except client.ApiException as x:
                return KEPT in x.body
        finally:
            k8s.core.delete_namespaced_pod("probe", ns, grace_period_seconds=0)
            until(lambda: not k8s.core.list_namespaced_pod(ns, field_selector="metadata.name=probe").items,
                  30, "the probe pod gone")  # fmt: skip

    try:
        until(enforced, 60, "the scope and gate-kept policies to be enforced")
        yield e
    finally:
        deploy_objects.drop_policies(k8s)
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            k8s.kubectl("delete", kind, "gpupack-dra-allocate-gate-kept", "--ignore-not-found")
        k8s.kubectl("delete", "clusterrolebinding,clusterrole", "gpupack-dra-allocator", "--ignore-not-found")
        for n in (sys_ns, ns):
            k8s.core.delete_namespace(n)


def test_the_extender_ungates_and_pins_a_gated_pod_as_the_allocator_writes(env: Env) -> None:
    # the allocator's patch, other gates kept, pinned beside a pod anti-affinity of the tenant's
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}]}}  # fmt: skip
    pod = env.pod("pin", [GATE, OTHER_GATE], affinity=anti)
    env.writer.ungate(pod, pin="node-a")
    p = env.read("pin")
    assert p["spec"]["schedulingGates"] == [{"name": OTHER_GATE}]
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
    ]
    assert p["spec"]["affinity"]["podAntiAffinity"] == anti["podAntiAffinity"]
    assert p["metadata"]["annotations"][PIN_ANNOTATION] == "node-a"
    # ungating alone, the last gate: the gates list goes
    env.writer.ungate(env.pod("plain", [GATE]))
    assert "schedulingGates" not in env.read("plain")["spec"]


def test_the_same_spec_change_is_refused_without_the_gate_and_nothing_else_rides_along(env: Env) -> None:
    # the pin on a pod that never carried gpupack's gate (another gate: the API server itself
    # lets a gated pod's node affinity be narrowed) is refused, and so is removing another gate
    other = env.pod("other", [OTHER_GATE])
    assert SCOPE in _refused(env.writer.ungate, other, "node-a")
    assert SCOPE in _refused(
        env.extender.patch_namespaced_pod, "other", env.ns, {"spec": {"schedulingGates": None}}
    )
    assert env.read("other")["spec"]["schedulingGates"] == [{"name": OTHER_GATE}]
    # on a pod with the gate: the pin must be one node by name, no other spec field may change
    env.pod("g", [GATE])
    wide = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}
    for spec in ({"schedulingGates": None, "activeDeadlineSeconds": 5},
                 {"schedulingGates": None, "tolerations": [{"key": "k", "operator": "Exists"}]},
                 {"schedulingGates": None, "containers": [{"name": "a", "image": "registry.invalid/evil:1"}]},
                 {"schedulingGates": None, "nodeSelector": {"zone": "a"}},
                 {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": wide}}}):  # fmt: skip
        assert SCOPE in _refused(env.extender.patch_namespaced_pod, "g", env.ns, {"spec": spec}), spec
    p = env.read("g")
    assert p["spec"]["schedulingGates"] == [{"name": GATE}] and "affinity" not in p["spec"]
    assert p["spec"]["containers"][0]["image"] == "registry.invalid/x:1"
    # a pod with a required node affinity of its own is not re-pinned
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": wide}}
    mine = env.pod("mine", [GATE], affinity=own)
    narrow = [
        {
            "op": "add",
            "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
            "/nodeSelectorTerms/0/matchFields",
            "value": [{"key": "metadata.name", "operator": "In", "values": ["n"]}],
        }
    ]
    assert SCOPE in _refused(env.extender.patch_namespaced_pod, "mine", env.ns, narrow)  # fmt: skip
    env.writer.ungate(mine)  # ... but ungated as it is
    assert env.read("mine")["spec"]["affinity"] == own


def test_a_tenant_cannot_take_the_gate_off(env: Env) -> None:
    pod = env.pod("t", [GATE, OTHER_GATE])
    assert KEPT in _refused(env.tenant.patch_namespaced_pod, "t", env.ns, {"spec": {"schedulingGates": None}})
    keep_other = [{"op": "replace", "path": "/spec/schedulingGates", "value": [{"name": OTHER_GATE}]}]
    assert KEPT in _refused(env.tenant.patch_namespaced_pod, "t", env.ns, keep_other)
    assert KEPT in _refused(Writer(env.tenant.api_client).ungate, pod)
    assert env.read("t")["spec"]["schedulingGates"] == [{"name": GATE}, {"name": OTHER_GATE}]
    # the tenant's own gate is the tenant's
    env.tenant.patch_namespaced_pod("t", env.ns, [{"op": "replace", "path": "/spec/schedulingGates",
                                                    "value": [{"name": GATE}]}])  # fmt: skip
    assert env.read("t")["spec"]["schedulingGates"] == [{"name": GATE}]


def test_the_example_is_what_the_dra_component_ships() -> None:
    # deploy/examples/dra-allocate-gate.yaml (applied alone, e.g. by tests/extender/dra) and the
    # component's allocate.yaml are one set of objects
    assert deploy_objects.load("examples/dra-allocate-gate.yaml") == deploy_objects.load("dra/allocate.yaml")
