"""gpupack's state cannot be forged, stripped or abused by tenants: deploy/webhook/policies.yaml
(ValidatingAdmissionPolicies) in the real kube-apiserver, exercised with real ServiceAccount
tokens of a tenant, of the extender's account and of the device plugin's account.

Issue 11 "Why": a forged assignment/handoff/managed label made the extender charge GPUs and the
device plugin hand out any GPU; stripping the managed label from one's own running pod freed its
share; the device plugin's `patch pods`/`patch nodes` reached every pod (image included) and node.
"""

from __future__ import annotations

import copy
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import deploy_objects
import pytest
from kubernetes import client
from realk8s import ControlPlane, until

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_GPU_MODELS,
    ANN_HANDOFF,
    ANN_INVENTORY,
    ANN_RESERVATIONS,
    LABEL_CLASS,
    LABEL_GPU_MODEL,
    LABEL_MANAGED,
)

EXT_SA, DP_SA = "gpupack-extender", "gpupack-device-plugin"
FORBIDDEN = "may be set, changed or removed by gpupack only"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def _assignment(uid: str, node: str) -> str:
    share = {"uuid": "GPU-any", "index": 0, "mem_mib": 81559, "sm_pct": 100, "exclusive": True}
    return json.dumps({"v": 1, "pod_uid": uid, "node": node, "class": "online", "containers": {"a": [share]}})


@dataclass
class Setup:
    cp: ControlPlane
    sys_ns: str
    ns: str
    n1: str
    n2: str
    tenant: client.CoreV1Api
    extender: client.CoreV1Api
    plugin: client.CoreV1Api

    def pod(self, api: client.CoreV1Api, name: str, *, node: str = "", anns: dict | None = None,
            labels: dict | None = None) -> Any:  # fmt: skip
        spec: dict[str, Any] = {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}
        if node:
            spec["nodeName"] = node
        body = {"metadata": {"name": name, "annotations": anns or {}, "labels": labels or {}}, "spec": spec}
        return api.create_namespaced_pod(self.ns, body)

    def patch(self, api: client.CoreV1Api, name: str, meta: dict | None = None, **spec: Any) -> Any:
        body: dict[str, Any] = {"metadata": meta or {}}
        if spec:
            body["spec"] = spec
        return api.patch_namespaced_pod(name, self.ns, body)


def refused(fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(client.ApiException) as e:
        fn(*args, **kw)
    assert e.value.status in (403, 422), e.value.body
    return json.loads(e.value.body)["message"]


@pytest.fixture(scope="module")
def s(k8s: ControlPlane) -> Iterator[Setup]:
    sfx = deploy_objects.suffix()
    sys_ns, ns = f"gpsys-{sfx}", f"tenant-{sfx}"
    k8s.ensure_namespace(sys_ns)
    k8s.ensure_namespace(ns)
    shipped = [o for f in ("scheduler/serviceaccount.yaml", "deviceplugin/serviceaccount.yaml", "scheduler/rbac.yaml",
                           "deviceplugin/rbac.yaml", "defrag/serviceaccount.yaml", "defrag/rbac.yaml",
                           "webhook/policies.yaml") for o in deploy_objects.load(f)]  # fmt: skip
    # the policies in the version this server serves (v1, or v1beta1 before 1.30; the fields are the same)
    deploy_objects.apply(k8s, k8s.for_this_server(deploy_objects.remap(shipped, sys_ns)))
    # the tenant may do what the built-in `edit` role allows in its namespace: create and patch pods
    client.RbacAuthorizationV1Api(k8s.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "app", "namespace": ns}]})  # fmt: skip
    n1, n2 = f"sec-a-{sfx}", f"sec-b-{sfx}"
    for n in (n1, n2):
        k8s.make_node(n, extended={"gpupack.io/gpu": "16"})

    def api(namespace: str, sa: str) -> client.CoreV1Api:
        return client.CoreV1Api(k8s.new_api_client(k8s.service_account_token(namespace, sa)))

    setup = Setup(k8s, sys_ns, ns, n1, n2, api(ns, "app"), api(sys_ns, EXT_SA), api(sys_ns, DP_SA))

    def active() -> bool:  # a new policy is enforced once the API server has compiled it
        try:
            setup.pod(setup.tenant, "probe", anns={ANN_HANDOFF: "pending"})
        except client.ApiException as e:
            return e.status in (403, 422) and FORBIDDEN in e.body
        k8s.core.delete_namespaced_pod("probe", ns, grace_period_seconds=0)
        # each policy and binding is compiled on its own: the device plugin's scope too
        try:
            setup.plugin.patch_node(n2, {"spec": {"unschedulable": True}})
        except client.ApiException as e:
            return e.status in (403, 422) and "gpupack device plugin: may change only" in e.body
        k8s.core.patch_node(n2, {"spec": {"unschedulable": None}})
        return False

    def plugin_pods_active() -> bool:
        # the device plugin's scope on pods as well as on nodes: under load the API server was
        # seen enforcing one before the other
        try:
            setup.patch(setup.plugin, "probe-dp", {"labels": {"probe": "x"}})
        except client.ApiException as e:
            return e.status in (403, 422) and "gpupack device plugin: may change only" in e.body
        return False

    until(active, 60, "the ValidatingAdmissionPolicies to be enforced")
    setup.pod(k8s.core, "probe-dp", node=n1)
    until(plugin_pods_active, 60, "the device plugin's policy to be enforced on pods")
    k8s.core.delete_namespaced_pod("probe-dp", ns, grace_period_seconds=0)
    try:
        yield setup
    finally:
        deploy_objects.drop_policies(k8s)
        k8s.reset()


def test_a_forged_lock_or_share_is_refused_at_create(s: Setup):
    # the forged lock: no GPU request, an unserved scheduler, a hand-written pending assignment
    msg = refused(s.tenant.create_namespaced_pod, s.ns, {
        "metadata": {"name": "lock", "labels": {LABEL_MANAGED: "true"},
                     "annotations": {ANN_ASSIGNMENT: _assignment("x", s.n1), ANN_HANDOFF: "pending"}},
        "spec": {"schedulerName": "nobody", "containers": [{"name": "a", "image": "registry.invalid/x:1"}]}})  # fmt: skip
    assert FORBIDDEN in msg and ANN_ASSIGNMENT in msg and f"label {LABEL_MANAGED}" in msg, msg
    # the forged share: preset node, an exclusive assignment of any GPU
    msg = refused(s.pod, s.tenant, "share", node=s.n1, anns={ANN_ASSIGNMENT: _assignment("y", s.n1)})
    assert "remove them from the pod or its template" in msg
    # not even a cluster admin writes gpupack's state by hand (they act as the extender to repair)
    refused(s.pod, client.CoreV1Api(s.cp.api_client()), "admin", anns={ANN_ALLOCATED: "[]"})
    # what tenants do write is theirs: the class label and the GPU-model annotation
    p = s.pod(s.tenant, "ok", anns={ANN_GPU_MODELS: "NVIDIA-L4"}, labels={LABEL_CLASS: "offline"})
    assert p.metadata.annotations[ANN_GPU_MODELS] == "NVIDIA-L4"
    assert {p.metadata.name for p in s.cp.core.list_namespaced_pod(s.ns).items} == {"ok"}


def test_stripping_or_changing_state_of_a_running_pod_is_refused(s: Setup):
    s.pod(s.tenant, "run", node=s.n1)
    uid = s.cp.core.read_namespaced_pod("run", s.ns).metadata.uid
    # the extender writes the state (its ServiceAccount, as at bind)
    s.patch(s.extender, "run", {"labels": {LABEL_MANAGED: "true"},
                                "annotations": {ANN_ASSIGNMENT: _assignment(uid, s.n1), ANN_HANDOFF: "pending"}})  # fmt: skip
    for meta in ({"labels": {LABEL_MANAGED: None}}, {"annotations": {ANN_ASSIGNMENT: None}},
                 {"annotations": {ANN_HANDOFF: "done"}}, {"labels": {LABEL_MANAGED: "false"}},
                 {"annotations": {"gpupack.io/anything": "x"}}):  # fmt: skip
        msg = refused(s.patch, s.tenant, "run", meta)
        assert FORBIDDEN in msg, (meta, msg)
    # a full replace that drops them is refused as well
    p = s.tenant.read_namespaced_pod("run", s.ns)
    p.metadata.labels.pop(LABEL_MANAGED)
    refused(s.tenant.replace_namespaced_pod, "run", s.ns, p)
    # the status subresource carries metadata too
    p = s.cp.core.read_namespaced_pod("run", s.ns)
    p.metadata.annotations.pop(ANN_ASSIGNMENT)
    refused(client.CoreV1Api(s.cp.api_client()).replace_namespaced_pod_status, "run", s.ns, p)
    kept = s.cp.core.read_namespaced_pod("run", s.ns).metadata
    assert kept.labels[LABEL_MANAGED] == "true" and ANN_ASSIGNMENT in kept.annotations
    # the tenant's other edits still go through, and the extender may roll its state back
    assert s.patch(s.tenant, "run", {"labels": {"team": "a"}}).metadata.labels["team"] == "a"
    p = s.patch(s.extender, "run", {"labels": {LABEL_MANAGED: None}, "annotations": {ANN_ASSIGNMENT: None}})
    assert LABEL_MANAGED not in p.metadata.labels and ANN_ASSIGNMENT not in p.metadata.annotations


def test_the_device_plugin_may_change_only_its_two_annotations_and_its_nodes_publication(s: Setup):
    s.pod(s.tenant, "dp", node=s.n1)
    s.patch(s.extender, "dp", {"annotations": {ANN_HANDOFF: "pending"}})
    # what Allocate writes
    p = s.patch(s.plugin, "dp", {"annotations": {ANN_HANDOFF: "done", ANN_ALLOCATED: '["a"]'}})
    assert p.metadata.annotations[ANN_HANDOFF] == "done"
    # RBAC grants `patch pods` cluster-wide; the policy keeps it to those two annotations
    assert "gpupack.io/handoff and gpupack.io/allocated" in refused(
        s.patch, s.plugin, "dp", containers=[{"name": "a", "image": "registry.invalid/evil:1"}]
    )
    refused(s.patch, s.plugin, "dp", {"annotations": {ANN_ASSIGNMENT: _assignment("z", s.n1)}})
    refused(s.patch, s.plugin, "dp", {"labels": {LABEL_MANAGED: "true"}})
    refused(s.patch, s.plugin, "dp", {"labels": {"team": "b"}})
    refused(s.patch, s.plugin, "dp", {"annotations": {"other": "x"}})
    assert s.cp.core.read_namespaced_pod("dp", s.ns).spec.containers[0].image == "registry.invalid/x:1"
    # its Node: what it publishes, nothing else (not the labels that steer other workloads, not
    # defrag's reservations, not the spec)
    s.plugin.patch_node(s.n1, {"metadata": {"labels": {LABEL_GPU_MODEL: "NVIDIA-L4"},
                                            "annotations": {ANN_INVENTORY: "{}"}}})  # fmt: skip
    assert "gpupack.io/ labels and annotations" in refused(
        s.plugin.patch_node, s.n1, {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}
    )
    refused(s.plugin.patch_node, s.n1, {"metadata": {"annotations": {ANN_RESERVATIONS: "{}"}}})
    refused(s.plugin.patch_node, s.n1, {"spec": {"unschedulable": True}})
    refused(s.plugin.patch_node, s.n1, {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}})


def test_with_a_node_claim_the_device_plugin_touches_only_its_own_node(s: Setup):
    """Tokens of pods carry the node name from Kubernetes 1.30 (1.28 carries the pod's name only):
    the policy's claim check, exercised by impersonating the plugin's account with that claim."""
    s.pod(s.tenant, "on-a", node=s.n1)
    s.pod(s.tenant, "on-b", node=s.n2)
    api = client.ApiClient(s.cp.api_client().configuration)
    api.set_default_header("Impersonate-User", f"system:serviceaccount:{s.sys_ns}:{DP_SA}")
    api.set_default_header("Impersonate-Group", "system:serviceaccounts")
    api.set_default_header(f"Impersonate-Extra-{urllib.parse.quote(NODE_CLAIM, safe='')}", s.n1)
    on_a = client.CoreV1Api(api)
    assert (
        s.patch(on_a, "on-a", {"annotations": {ANN_ALLOCATED: "[]"}}).metadata.annotations[ANN_ALLOCATED]
        == "[]"
    )
    msg = refused(s.patch, on_a, "on-b", {"annotations": {ANN_ALLOCATED: "[]"}})
    assert f"on node {s.n1}: may touch only its own node" in msg
    on_a.patch_node(s.n1, {"metadata": {"labels": {LABEL_GPU_MODEL: "NVIDIA-L4"}}})
    refused(on_a.patch_node, s.n2, {"metadata": {"labels": {LABEL_GPU_MODEL: "NVIDIA-L4"}}})


def _bind(
    api: client.CoreV1Api, ns: str, pod: str, node: str, anns: dict[str, str], door: str = "pods/binding"
) -> None:
    body = {"metadata": {"name": pod, "annotations": anns}, "target": {"kind": "Node", "name": node}}
    # the answer is a Status, which the client's Binding model cannot read: take it raw
    if door == "bindings":
        api.create_namespaced_binding(ns, body, _preload_content=False)
    else:
        api.create_namespaced_pod_binding(pod, ns, body, _preload_content=False)


def test_a_binding_cannot_carry_gpupack_state(s: Setup):
    """The API server copies a Binding's annotations onto the pod it binds: pods/binding is the
    same door as a pod update, and the policy covers it (issue 31 item 5)."""
    client.RbacAuthorizationV1Api(s.cp.api_client()).create_namespaced_role(s.ns, {
        "metadata": {"name": "binder"},
        "rules": [{"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]}]})  # fmt: skip
    client.RbacAuthorizationV1Api(s.cp.api_client()).create_namespaced_role_binding(s.ns, {
        "metadata": {"name": "app-binder"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "binder"},
        "subjects": [{"kind": "ServiceAccount", "name": "app", "namespace": s.ns}]})  # fmt: skip
    for name in ("b1", "b2", "b3"):
        s.pod(s.tenant, name)
    uid = s.cp.core.read_namespaced_pod("b1", s.ns).metadata.uid
    forged = {ANN_ASSIGNMENT: _assignment(uid, s.n2), ANN_HANDOFF: "pending"}
    # both doors: the pod's binding subresource (kube-scheduler's) and the namespace's bindings
    for api in (s.tenant, client.CoreV1Api(s.cp.api_client())):
        for door in ("pods/binding", "bindings"):
            msg = refused(_bind, api, s.ns, "b1", s.n1, forged, door)
            assert FORBIDDEN in msg and ANN_ASSIGNMENT in msg, (door, msg)
    p = s.cp.core.read_namespaced_pod("b1", s.ns)
    assert not p.spec.node_name and ANN_ASSIGNMENT not in (p.metadata.annotations or {})
    # a Binding without gpupack state, or one the user-facing key only, binds as before
    _bind(s.tenant, s.ns, "b2", s.n1, {ANN_GPU_MODELS: "NVIDIA-L4"}, "bindings")
    assert s.cp.core.read_namespaced_pod("b2", s.ns).spec.node_name == s.n1
    # the extender's own Binding carries the assignment
    _bind(s.extender, s.ns, "b3", s.n1, {ANN_ASSIGNMENT: _assignment("u", s.n1)})
    assert ANN_ASSIGNMENT in s.cp.core.read_namespaced_pod("b3", s.ns).metadata.annotations


def test_the_schedulers_account_changes_only_gpupack_state_and_scheduling_status(s: Setup):
    """Issue 31 item 3: the extender's token (then shared with kube-scheduler) patched a kube-system
    pod's image, set labels and status.phase, and deleted pods. Its own account (gpupack-extender)
    may write gpupack.io/ annotations, a pod's conditions and nominatedNodeName, nothing else of a
    pod, and delete none."""
    s.cp.ensure_namespace("kube-system")
    # unbound: on v1.36 a bound pod's nominatedNodeName may not be set, by anyone
    body = {"metadata": {"name": f"sys-{s.ns}", "labels": {"tier": "control-plane"}},
            "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}  # fmt: skip
    name = s.cp.core.create_namespaced_pod("kube-system", body).metadata.name
    scope = "may change only a pod's gpupack.io/"
    image = {"spec": {"containers": [{"name": "a", "image": "registry.invalid/evil:1"}]}}
    assert scope in refused(s.extender.patch_namespaced_pod, name, "kube-system", image)
    assert scope in refused(
        s.extender.patch_namespaced_pod, name, "kube-system", {"metadata": {"labels": {"tier": "x"}}}
    )
    assert scope in refused(
        s.extender.patch_namespaced_pod, name, "kube-system", {"metadata": {"annotations": {"a": "b"}}}
    )
    assert scope in refused(
        s.extender.patch_namespaced_pod_status, name, "kube-system", {"status": {"phase": "Failed"}}
    )
    assert "cannot delete resource" in refused(s.extender.delete_namespaced_pod, name, "kube-system")
    refused(s.extender.create_namespaced_pod, s.ns, {  # RBAC, and the policy behind it
        "metadata": {"name": "made"}, "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}})  # fmt: skip
    p = s.cp.core.read_namespaced_pod(name, "kube-system")
    assert p.spec.containers[0].image == "registry.invalid/x:1" and p.metadata.labels == {
        "tier": "control-plane"
    }
    # what the extender and kube-scheduler do write still goes through
    s.extender.patch_namespaced_pod(
        name, "kube-system", {"metadata": {"annotations": {ANN_HANDOFF: "failed"}}}
    )
    s.extender.patch_namespaced_pod_status(name, "kube-system", {"status": {"nominatedNodeName": s.n2,
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}})  # fmt: skip
    assert s.cp.core.read_namespaced_pod(name, "kube-system").status.nominated_node_name == s.n2
    s.cp.core.delete_namespaced_pod(name, "kube-system", grace_period_seconds=0)


def test_defrag_changes_only_reservations_and_its_own_taint(s: Setup):
    """Issue 31 item 4: the defrag account could cordon, NoExecute-taint or rewrite the inventory of
    any node. It may write the reservations annotation and its own NoSchedule taint, nothing else."""
    defrag = client.CoreV1Api(s.cp.new_api_client(s.cp.service_account_token(s.sys_ns, "gpupack-defrag")))
    key = "status-taint.cluster-autoscaler.kubernetes.io/gpupack-defrag"
    scope = "gpupack defrag: may change only a Node's gpupack.io/reservations"
    for body in ({"spec": {"unschedulable": True}},
                 {"spec": {"taints": [{"key": "evil", "effect": "NoExecute"}]}},
                 {"spec": {"taints": [{"key": key, "value": "emptying", "effect": "NoExecute"}]}},
                 {"metadata": {"annotations": {ANN_INVENTORY: "{}"}}},
                 {"metadata": {"labels": {LABEL_GPU_MODEL: "x"}}}):  # fmt: skip
        assert scope in refused(defrag.patch_node, s.n2, body), body
    node = s.cp.core.read_node(s.n2)
    assert not node.spec.unschedulable and not node.spec.taints
    # what defrag writes
    defrag.patch_node(s.n2, {"metadata": {"annotations": {ANN_RESERVATIONS: "{}"}}})
    defrag.patch_node(s.n2, {"spec": {"taints": [{"key": key, "value": "emptying", "effect": "NoSchedule"}]}})
    assert [t.key for t in s.cp.core.read_node(s.n2).spec.taints] == [key]
    defrag.patch_node(s.n2, {"spec": {"taints": None}})


def test_the_schedulers_account_writes_only_holds_and_scale_down_marks_on_nodes(s: Setup):
    """Preemption (issue 26) gave the scheduler's account `patch nodes` for its holds, and
    deploy/autoscale (issue 28) uses it for the autoscaler's scale-down mark: nothing else of a
    Node, whatever RBAC allows (issue 31: no rewritten inventory, no cordon)."""
    node_scope = "may change only a Node's gpupack.io/reservations"
    bad = ({"spec": {"unschedulable": True}}, {"spec": {"taints": [{"key": "evil", "effect": "NoExecute"}]}},
           {"metadata": {"annotations": {ANN_INVENTORY: "{}"}}}, {"metadata": {"labels": {LABEL_GPU_MODEL: "x"}}})  # fmt: skip

    def enforced() -> bool:  # each policy is compiled on its own
        try:
            s.extender.patch_node(s.n2, bad[0])
        except client.ApiException as e:
            return e.status in (403, 422) and node_scope in e.body
        s.cp.core.patch_node(s.n2, {"spec": {"unschedulable": None}})
        return False

    until(enforced, 30, "gpupack-scheduler-node-scope enforced")
    for body in bad:
        assert node_scope in refused(s.extender.patch_node, s.n2, body), body
    node = s.cp.core.read_node(s.n2)
    assert not node.spec.unschedulable and not node.spec.taints
    s.extender.patch_node(s.n2, {"metadata": {"annotations": {ANN_RESERVATIONS: "{}"}}})
    mark = {
        "cluster-autoscaler.kubernetes.io/scale-down-disabled": "true",
        "gpupack.io/scale-down-pinned": "x",
    }
    s.extender.patch_node(s.n2, {"metadata": {"annotations": mark}})
    s.extender.patch_node(s.n2, {"metadata": {"annotations": dict.fromkeys([*mark, ANN_RESERVATIONS])}})


def test_the_schedulers_account_creates_only_autoscale_placeholders(s: Setup):
    """deploy/autoscale lets the scheduler's account create pods in gpupack's namespace for its
    placeholders; the policy admits exactly their shape (no image, token or node of its choosing)."""
    from extender.controllers.autoscale_groups import PLACEHOLDER_IMAGE, placeholder_pod

    rbac = client.RbacAuthorizationV1Api(s.cp.api_client())
    rbac.create_namespaced_role(s.sys_ns, {"metadata": {"name": "placeholders"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete"]}]})  # fmt: skip
    rbac.create_namespaced_role_binding(s.sys_ns, {"metadata": {"name": "placeholders"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "placeholders"},
        "subjects": [{"kind": "ServiceAccount", "name": EXT_SA, "namespace": s.sys_ns}]})  # fmt: skip
    owner = s.cp.core.create_namespaced_config_map(s.sys_ns, {"metadata": {"name": "gpupack-autoscale"}})
    good = placeholder_pod("g1", 64, "gpupack.io/node-group", s.sys_ns,
                           {"name": "gpupack-autoscale", "uid": owner.metadata.uid})  # fmt: skip
    assert good["spec"]["containers"][0]["image"] == PLACEHOLDER_IMAGE
    made = until(lambda: _created(s, good), 30, "RBAC for the placeholder in effect")
    s.extender.delete_namespaced_pod(made, s.sys_ns, grace_period_seconds=0)
    # RBAC's delete covers every pod of the namespace (the scheduler's and the plugin's pods run
    # there); policy gpupack-extender-delete-scope leaves the placeholders only
    other = s.cp.core.create_namespaced_pod(s.sys_ns, {"metadata": {"name": "not-a-placeholder"},
        "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}).metadata.name  # fmt: skip

    def enforced() -> bool:  # a dry run goes through admission and deletes nothing
        try:
            s.extender.delete_namespaced_pod(other, s.sys_ns, dry_run="All")
        except client.ApiException as e:
            return "may delete only gpupack's autoscale placeholders" in e.body
        return False

    until(enforced, 30, "gpupack-extender-delete-scope enforced")
    assert "may delete only gpupack's autoscale placeholders" in refused(
        s.extender.delete_namespaced_pod, other, s.sys_ns
    )
    assert s.cp.core.read_namespaced_pod(other, s.sys_ns).metadata.deletion_timestamp is None
    s.cp.core.delete_namespaced_pod(other, s.sys_ns, grace_period_seconds=0)
    scope = "may not create pods but gpupack's autoscale placeholders"
    evil = copy.deepcopy(good)
    evil["spec"]["containers"][0]["image"] = "registry.invalid/evil:1"
    token = copy.deepcopy(good)
    token["spec"]["automountServiceAccountToken"] = True
    pinned = copy.deepcopy(good)
    pinned["spec"]["nodeName"] = s.n1
    plain = copy.deepcopy(good)
    plain["spec"]["schedulerName"] = "default-scheduler"
    for body in (evil, token, pinned, plain):
        assert scope in refused(s.extender.create_namespaced_pod, s.sys_ns, body), body["spec"]


def _created(s: Setup, body: dict[str, Any]) -> str | None:
    try:
        return s.extender.create_namespaced_pod(s.sys_ns, body).metadata.name
    except client.ApiException as e:
        if e.status == 403 and "cannot create resource" in e.body:  # the RoleBinding not yet seen
            return None
        raise
