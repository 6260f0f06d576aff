"""gpupack's admission webhooks registered in the real kube-apiserver and exercised with
real pod creates and updates.

The configurations are deploy/webhook/webhooks.yaml as shipped (rules, namespaceSelector, CEL
matchConditions, failurePolicy), except that clientConfig is a URL to a `gpupack extender`
started here (its HTTPS webhook port) instead of the in-cluster Service; the certificate and the
caBundle are the ones `gpupack certs` writes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deploy_objects
import pytest
import requests
from kubernetes import client
from processes import ExtenderProcess, free_port
from realk8s import ControlPlane, until

from gpupack import certs
from gpupack.contract import ANN_INVENTORY, GPUInfo, NodeInventory

L4_MIB = 24576


class Webhook:
    def __init__(
        self, cp: ControlPlane, url: str, ca: Path, ext: ExtenderProcess, sfx: str, system: str
    ) -> None:
        self.cp, self.url, self.ca, self.ext, self.sfx, self.system = cp, url, ca, ext, sfx, system
        self.core = cp.core

    def admissions(self) -> float:
        """Admission reviews the webhook server answered so far (its own metric)."""
        text = requests.get(self.url + "/metrics", verify=str(self.ca), timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("gpupack_webhook_admission_total{"))  # fmt: skip

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        ns = f"{name}-{self.sfx}"
        self.cp.ensure_namespace(ns, labels)
        return ns

    def create(
        self, ns: str, name: str, containers: list[dict], labels: dict | None = None, **spec: Any
    ) -> Any:
        body = {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": containers, **spec},
        }
        return self.core.create_namespaced_pod(ns, body)

    def denied(self, ns: str, name: str, containers: list[dict], labels: dict | None = None) -> str:
        with pytest.raises(client.ApiException) as e:
            self.create(ns, name, containers, labels)
        assert e.value.status in (400, 422), e.value.body
        return e.value.body


def c(name: str, limits: dict[str, str] | None = None, requests_: dict[str, str] | None = None) -> dict:
    res = {k: v for k, v in (("limits", limits), ("requests", requests_)) if v is not None}
    return {"name": name, "image": "registry.invalid/x:1", **({"resources": res} if res else {})}


@pytest.fixture(scope="module")
def webhook(k8s: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    """The shipped webhook configurations, pointing at a local `gpupack extender`, for this module.

    Module-wide (one extender start instead of one per test); every test uses namespaces of its
    own, and the cluster is reset when the module is done."""
    tmp = tmp_path_factory.mktemp("webhook")
    sfx = deploy_objects.suffix()
    system = f"whsys-{sfx}"
    k8s.ensure_namespace(system, {"gpupack.io/webhook": "skip"})
    k8s.make_node(f"wh-{sfx}", extended={"gpupack.io/gpu": "16"}, annotations={ANN_INVENTORY: NodeInventory(
        gpus=(GPUInfo(uuid=f"GPU-wh-{sfx}", index=0, model="NVIDIA-L4", mem_mib=L4_MIB, sm_count=58),)).to_json()})  # fmt: skip
    port = free_port()
    objs = deploy_objects.remap(deploy_objects.load("webhook/webhooks.yaml"), system)
    for cfg in objs:
        for hook in cfg["webhooks"]:
            hook["clientConfig"] = {
                "url": f"https://localhost:{port}{hook['clientConfig']['service']['path']}"
            }
    deploy_objects.apply(k8s, objs)
    # the serving certificate is for the URL's host, the rest is what the init container does
    kube = certs.Kube(k8s.new_api_client())
    certs.ensure(kube, system, "gpupack-webhook-tls", "localhost", ["gpupack"], ["gpupack"], tmp / "tls",
                 3650, 365, dt.timedelta(days=30))  # fmt: skip
    # the webhook trusts the ServiceAccounts of its own namespace (the Deployment's POD_NAMESPACE)
    with deploy_objects.pod_namespace(system):
        ext = ExtenderProcess(k8s.kubeconfig, tmp / "extender.log", "--webhook-port", str(port),
                              "--metrics-port", str(free_port()),
                              "--tls-cert", str(tmp / "tls" / "tls.crt"), "--tls-key", str(tmp / "tls" / "tls.key"),
                              "--set-scheduler-name")  # fmt: skip
    url = f"https://localhost:{port}"
    try:
        ext.wait_ready(60)

        def ready() -> bool:
            try:
                return requests.get(url + "/readyz", verify=str(tmp / "tls" / "ca.crt"), timeout=2).ok
            except requests.RequestException:
                return False

        until(ready, 60, "the webhook to serve HTTPS with the certificate gpupack certs issued")
        yield Webhook(k8s, url, tmp / "tls" / "ca.crt", ext, sfx, system)
    finally:
        ext.stop()
        # a module may have applied deploy/webhook/policies.yaml (cluster-scoped: reset keeps them);
        # left in force they refuse the next module's writes of gpupack state as the admin
        deploy_objects.drop_policies(k8s)
        k8s.reset()


def test_gpu_mem_only_gets_a_gpu_count_and_the_scheduler_name(webhook):
    ns = webhook.namespace("wh-mutate")
    pod = webhook.create(ns, "p", [c("a", {"gpupack.io/gpu-mem": "1024"}), c("cpu", {"cpu": "1"})],
                         initContainers=[c("i", {"gpupack.io/gpu-sm": "20"})])  # fmt: skip
    a, cpu = pod.spec.containers
    assert a.resources.limits == {"gpupack.io/gpu-mem": "1024", "gpupack.io/gpu": "1"}
    # the API server defaults requests from limits after the patch, as the webhook relies on
    assert a.resources.requests == a.resources.limits
    assert cpu.resources.limits == {"cpu": "1"}
    assert pod.spec.init_containers[0].resources.limits["gpupack.io/gpu"] == "1"
    assert pod.spec.scheduler_name == "gpupack-scheduler"
    # only an init container asks for a GPU: the matchConditions see it too
    pod = webhook.create(
        ns, "init", [c("cpu", {"cpu": "1"})], initContainers=[c("i", {"gpupack.io/gpu-mem": "512"})]
    )
    assert pod.spec.init_containers[0].resources.limits["gpupack.io/gpu"] == "1"
    assert pod.spec.scheduler_name == "gpupack-scheduler"
    # a pod that already names its GPUs and gpupack's scheduler is left as it is
    pod = webhook.create(ns, "q", [c("a", {"gpupack.io/gpu": "2"})], schedulerName="gpupack-scheduler")
    assert pod.spec.containers[0].resources.limits == {"gpupack.io/gpu": "2"}


def test_gpu_pods_not_placed_by_gpupack_are_refused_with_what_to_do(webhook):
    """Only gpupack's scheduler writes the assignment the device plugin serves: a GPU pod on a
    preset node or under another scheduler would get no GPU (or, before, any GPU)."""
    ns = webhook.namespace("wh-place")
    with pytest.raises(client.ApiException) as e:
        webhook.create(ns, "other", [c("a", {"gpupack.io/gpu": "2"})], schedulerName="my-scheduler")
    assert "spec.schedulerName is 'my-scheduler'" in e.value.body
    assert "must set schedulerName: gpupack-scheduler" in e.value.body
    with pytest.raises(client.ApiException) as e:
        webhook.create(ns, "pinned", [c("a", {"gpupack.io/gpu-mem": "1024"})], nodeName=f"wh-{webhook.sfx}")
    assert f"spec.nodeName is preset ('wh-{webhook.sfx}')" in e.value.body
    assert "remove spec.nodeName and use a nodeSelector or node affinity" in e.value.body
    assert webhook.core.list_namespaced_pod(ns).items == []
    # pods without gpupack resources keep whatever scheduler and node they name
    assert (
        webhook.create(ns, "cpu", [c("a")], nodeName=f"wh-{webhook.sfx}").spec.node_name
        == f"wh-{webhook.sfx}"
    )


def test_gpupack_state_is_written_by_gpupack_only_without_a_policy_api(webhook):
    """The `state.pods.gpupack.io` webhook (for clusters without ValidatingAdmissionPolicy): a
    tenant, or anyone but gpupack's accounts, can neither forge gpupack's annotations and managed
    label at create nor change or strip them later, on GPU pods and any other pod alike."""
    ns = webhook.namespace("wh-state")
    tenant = client.CoreV1Api(webhook.cp.new_api_client(webhook.cp.service_account_token(ns, "app")))
    client.RbacAuthorizationV1Api(webhook.cp.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "app-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "app", "namespace": ns}]})  # fmt: skip
    forged = {"metadata": {"name": "f", "labels": {"gpupack.io/managed": "true"},
                           "annotations": {"gpupack.io/assignment": "{}", "gpupack.io/handoff": "pending"}},
              "spec": {"containers": [c("a")], "schedulerName": "nobody"}}  # fmt: skip
    with pytest.raises(client.ApiException) as e:
        tenant.create_namespaced_pod(ns, forged)
    assert 'admission webhook \\"state.pods.gpupack.io\\" denied the request' in e.value.body
    assert "gpupack.io/assignment, gpupack.io/handoff, label gpupack.io/managed may be set" in e.value.body
    tenant.create_namespaced_pod(ns, {"metadata": {"name": "p"}, "spec": {"containers": [c("a")]}})
    sched = client.CoreV1Api(
        webhook.cp.new_api_client(webhook.cp.service_account_token(webhook.system, "gpupack-extender"))
    )
    client.RbacAuthorizationV1Api(webhook.cp.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "sched-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "gpupack-extender", "namespace": webhook.system}]})  # fmt: skip
    before = webhook.admissions()
    sched.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"gpupack.io/managed": "true"},
                                                      "annotations": {"gpupack.io/handoff": "pending"}}})  # fmt: skip
    for meta in ({"labels": {"gpupack.io/managed": None}}, {"annotations": {"gpupack.io/handoff": "done"}}):
        with pytest.raises(client.ApiException) as e:
            tenant.patch_namespaced_pod("p", ns, {"metadata": meta})
        assert "may be set, changed or removed by gpupack only" in e.value.body, meta
    # the tenant's own edits never reach the webhook; the extender's never do either
    tenant.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"team": "a"}}})
    assert webhook.admissions() == before + 2
    sched.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"gpupack.io/managed": None}}})
    assert webhook.admissions() == before + 2


def test_a_binding_cannot_carry_gpupack_state_without_a_policy_api(webhook):
    """The API server copies a Binding's annotations onto the pod: `state.pods.gpupack.io` sees
    pods/binding too, and only the extender's Bindings may carry gpupack's state."""
    ns = webhook.namespace("wh-bind")
    rbac = client.RbacAuthorizationV1Api(webhook.cp.api_client())
    rbac.create_namespaced_role(ns, {"metadata": {"name": "binder"}, "rules": [
        {"apiGroups": [""], "resources": ["pods", "pods/binding", "bindings"], "verbs": ["create", "get"]}]})  # fmt: skip
    for sa_ns, sa in ((ns, "app"), (webhook.system, "gpupack-extender")):
        rbac.create_namespaced_role_binding(ns, {
            "metadata": {"name": f"binder-{sa}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "binder"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_ns}]})  # fmt: skip
    tenant = client.CoreV1Api(webhook.cp.new_api_client(webhook.cp.service_account_token(ns, "app")))
    sched = client.CoreV1Api(
        webhook.cp.new_api_client(webhook.cp.service_account_token(webhook.system, "gpupack-extender"))
    )
    node = f"wh-{webhook.sfx}"

    def bind(api: client.CoreV1Api, pod: str, anns: dict[str, str], door: str = "pods/binding") -> None:
        body = {"metadata": {"name": pod, "annotations": anns}, "target": {"kind": "Node", "name": node}}
        if door == "bindings":  # the answers are a Status, which the client cannot read: raw
            api.create_namespaced_binding(ns, body, _preload_content=False)
        else:
            api.create_namespaced_pod_binding(pod, ns, body, _preload_content=False)

    for name in ("f", "ok", "ext"):
        tenant.create_namespaced_pod(ns, {"metadata": {"name": name}, "spec": {"containers": [c("a")]}})
    for door in ("pods/binding", "bindings"):
        with pytest.raises(client.ApiException) as e:
            bind(tenant, "f", {"gpupack.io/assignment": "{}", "gpupack.io/handoff": "pending"}, door)
        assert 'admission webhook \\"state.pods.gpupack.io\\" denied the request' in e.value.body
        assert "gpupack.io/assignment, gpupack.io/handoff may be set" in e.value.body
    assert not webhook.core.read_namespaced_pod("f", ns).spec.node_name
    bind(tenant, "ok", {"gpupack.io/gpu-models": "NVIDIA-L4"}, "bindings")
    bind(sched, "ext", {"gpupack.io/handoff": "pending"})
    assert webhook.core.read_namespaced_pod("ext", ns).metadata.annotations["gpupack.io/handoff"] == "pending"


def test_bad_requests_are_refused_with_a_readable_message(webhook):
    ns = webhook.namespace("wh-deny")
    body = webhook.denied(ns, "sm", [c("a", {"gpupack.io/gpu-mem": "1024", "gpupack.io/gpu-sm": "150"})])
    assert 'admission webhook \\"validate.pods.gpupack.io\\" denied the request' in body
    assert "container 'a': gpupack.io/gpu-sm must be a whole percent in 1..100; got 150" in body
    body = webhook.denied(ns, "big", [c("a", {"gpupack.io/gpu-mem": "30000"})])
    # the API server canonicalises 30000 to "30k" before the webhook sees it; the message must not
    assert "at most the largest GPU in the cluster; got 30000 MiB" in body and str(L4_MIB) not in body
    body = webhook.denied(
        ns, "cls", [c("a", {"gpupack.io/gpu-mem": "1024"})], labels={"gpupack.io/class": "batch"}
    )
    assert "label gpupack.io/class must be one of online, offline; got 'batch'" in body
    # requests != limits: refused by the mutating webhook already, since the API server validates
    # the pod (with a message that names no resource) before the validating webhook would see it
    body = webhook.denied(ns, "neq", [c("a", {"gpupack.io/gpu-mem": "1024"}, {"gpupack.io/gpu-mem": "2048"})])
    assert 'admission webhook \\"mutate.pods.gpupack.io\\" denied the request' in body
    assert (
        "container 'a': requests must equal limits for gpupack.io/gpu-mem; requests=2048 limits=1024" in body
    )
    body = webhook.denied(ns, "req", [c("a", None, {"gpupack.io/gpu-sm": "10"})])
    assert (
        "container 'a': gpupack.io/gpu-sm must be set in limits (requests must equal limits); requests=10"
        in body
    )
    assert webhook.core.list_namespaced_pod(ns).items == []


def test_namespace_class_default_is_left_to_the_namespace(webhook):
    """A pod without the class label in a namespace labelled offline is admitted without a label:
    the namespace's default stays the one source of its class (the extender reads it at
    scheduling), and a pod's own label still overrides it."""
    ns = webhook.namespace("wh-offline", {"gpupack.io/class": "offline"})
    pod = webhook.create(ns, "p", [c("a", {"gpupack.io/gpu-mem": "1024"})])
    assert "gpupack.io/class" not in (pod.metadata.labels or {})
    assert pod.spec.containers[0].resources.limits["gpupack.io/gpu"] == "1"
    pod = webhook.create(
        ns, "q", [c("a", {"gpupack.io/gpu-mem": "1024"})], labels={"gpupack.io/class": "online"}
    )
    assert pod.metadata.labels["gpupack.io/class"] == "online"


def test_pods_outside_the_match_conditions_never_reach_the_webhook(webhook):
    ns = webhook.namespace("wh-other")
    skip = webhook.namespace("wh-skip", {"gpupack.io/webhook": "skip"})
    before = webhook.admissions()
    pod = webhook.create(
        ns, "cpu", [c("a", {"cpu": "1", "nvidia.com/gpu": "1"})], schedulerName="default-scheduler"
    )
    assert pod.spec.scheduler_name == "default-scheduler"
    assert "gpupack.io/gpu" not in pod.spec.containers[0].resources.limits
    pod = webhook.create(ns, "bare", [c("a")])
    assert pod.spec.scheduler_name == "default-scheduler"
    # an opted-out namespace gets nothing, not even the checks (the namespaceSelector)
    pod = webhook.create(skip, "sm", [c("a", {"gpupack.io/gpu-mem": "1024", "gpupack.io/gpu-sm": "150"})])
    assert pod.spec.containers[0].resources.limits == {
        "gpupack.io/gpu-mem": "1024",
        "gpupack.io/gpu-sm": "150",
    }
    assert webhook.admissions() == before
    # while a GPU pod costs exactly one mutating and one validating review
    webhook.create(ns, "gpu", [c("a", {"gpupack.io/gpu-mem": "1024"})])
    assert webhook.admissions() == before + 2


def test_pod_updates_do_not_depend_on_the_webhook(webhook):
    """The extender and the device plugin patch GPU pods' annotations at bind and Allocate: those
    updates must never wait on (or fail with) the webhook, and the resources they would have to
    re-check cannot change on a pod anyway."""
    ns = webhook.namespace("wh-update")
    webhook.create(ns, "p", [c("a", {"gpupack.io/gpu-mem": "1024"})])
    # as the extender's account, the writer of gpupack's state
    sched = client.CoreV1Api(
        webhook.cp.new_api_client(webhook.cp.service_account_token(webhook.system, "gpupack-extender"))
    )
    client.RbacAuthorizationV1Api(webhook.cp.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "sched-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "gpupack-extender", "namespace": webhook.system}]})  # fmt: skip
    before = webhook.admissions()
    p = sched.patch_namespaced_pod(
        "p", ns, {"metadata": {"annotations": {"gpupack.io/handoff": "pending"}, "labels": {"x": "y"}}}
    )
    assert p.metadata.annotations["gpupack.io/handoff"] == "pending"
    p.metadata.labels["z"] = "w"
    webhook.core.replace_namespaced_pod("p", ns, p)
    assert webhook.admissions() == before
    with pytest.raises(client.ApiException) as e:
        webhook.core.patch_namespaced_pod(
            "p",
            ns,
            {"spec": {"containers": [{"name": "a", "resources": {"limits": {"gpupack.io/gpu-sm": "150"}}}]}},
        )
    assert e.value.status == 422 and "pod updates may not change fields other than" in e.value.body


def test_the_webhook_port_speaks_only_tls_and_refuses_garbage(webhook):
    assert (
        requests.post(webhook.url + "/validate", data=b"{", verify=str(webhook.ca), timeout=5).status_code
        == 400
    )
    with pytest.raises(requests.RequestException):
        requests.get(webhook.url.replace("https://", "http://") + "/healthz", timeout=2).raise_for_status()
    assert requests.get(webhook.ext.url + "/healthz", timeout=5).status_code == 200


def plugin_pod_token(cp: Any, sys_ns: str, node: str) -> tuple[str, str]:
    """A token of the device plugin's account (its RBAC applied) bound to plugin pod `dp-a` on
    `node`, as a DaemonSet pod's projected token is, and its node claim: that node where the server
    sets one (v1.30 on), else ""."""
    deploy_objects.apply(cp, deploy_objects.remap(deploy_objects.load("deviceplugin/serviceaccount.yaml")
                                                  + deploy_objects.load("deviceplugin/rbac.yaml"), sys_ns))  # fmt: skip
    plugin = cp.core.create_namespaced_pod(sys_ns, {"metadata": {"name": "dp-a"}, "spec": {
        "nodeName": node, "serviceAccountName": "gpupack-device-plugin", "containers": [c("p")]}})  # fmt: skip
    tok: str = cp.core.create_namespaced_service_account_token("gpupack-device-plugin", sys_ns, {"spec": {
        "expirationSeconds": 3600, "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "dp-a",
                                                      "uid": plugin.metadata.uid}}}).status.token  # fmt: skip
    claim = cp.token_node_claim(tok)
    assert claim in ("", node), claim
    return tok, claim


def test_the_device_plugin_touches_only_its_own_node_with_its_pods_token(webhook):
    """A real token bound to a plugin pod on node A may patch a pod on A and node A, not a pod on B
    nor node B, whichever of gpupack's two mechanisms acts on this server. Where the server puts
    the node in a pod-bound token (`authentication.kubernetes.io/node-name`, v1.30 on), the
    plugin-node webhook skips the request and the admission policy pins the plugin by that claim
    alone; where the token names only its pod (v1.28-1.29), the webhook finds that pod's node."""
    cp, sys_ns, sfx = webhook.cp, webhook.system, webhook.sfx
    node_a, node_b = f"wh-{sfx}", f"whb-{sfx}"
    cp.make_node(node_b, extended={"gpupack.io/gpu": "16"})
    tok, claim = plugin_pod_token(cp, sys_ns, node_a)
    dp = client.CoreV1Api(cp.new_api_client(tok))
    ns = webhook.namespace("wh-plugin")
    for name, node in (("on-a", node_a), ("on-b", node_b)):
        cp.core.create_namespaced_pod(
            ns, {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": [c("a")]}}
        )
    if claim:
        policies = deploy_objects.remap(deploy_objects.load("webhook/policies.yaml"), sys_ns)
        deploy_objects.apply(cp, cp.for_this_server(policies))

        def enforced() -> bool:  # a dry run goes through admission and changes nothing
            try:
                dp.patch_node(node_b, {"metadata": {"labels": {"gpupack.io/gpu-model": "x"}}}, dry_run="All")
            except client.ApiException as e:
                return e.status == 403 and "may touch only its own node" in e.body
            return False

        until(enforced, 30, "the device plugin's admission policy to be enforced")
    try:
        before = webhook.admissions()
        dp.patch_namespaced_pod("on-a", ns, {"metadata": {"annotations": {"gpupack.io/handoff": "done"}}})
        dp.patch_node(node_a, {"metadata": {"labels": {"gpupack.io/gpu-model": "NVIDIA-L4"}}})
        with pytest.raises(client.ApiException) as e:
            dp.patch_namespaced_pod("on-b", ns, {"metadata": {"annotations": {"gpupack.io/handoff": "done"}}})
        assert e.value.status == 403, e.value.body
        # the policy names the token's node (the API server authenticated it); the webhook does not
        on_a = f"gpupack device plugin on node {node_a}: " if claim else "gpupack device plugin: "
        assert on_a + "may touch only its own node and the pods on it" in e.value.body
        with pytest.raises(client.ApiException) as e:
            dp.patch_node(node_b, {"metadata": {"labels": {"gpupack.io/gpu-model": "NVIDIA-L4"}}})
        assert e.value.status == 403, e.value.body
        if claim:  # the policy alone: the webhook was never asked
            assert f"gpupack device plugin on node {node_a}: may touch only its own node" in e.value.body
            assert webhook.admissions() == before
        else:
            assert f"not node {node_b}" in e.value.body
            assert webhook.admissions() == before + 4
        assert "gpupack.io/handoff" not in (
            cp.core.read_namespaced_pod("on-b", ns).metadata.annotations or {}
        )
    finally:
        if claim:  # the policies only: this module's webhooks stay (drop_policies removes them too)
            for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                cp.kubectl("delete", kind, *deploy_objects.POLICIES, "--ignore-not-found")
            until(lambda: not enforced(), 30, "the device plugin's admission policy to be dropped")
    # a token bound to no pod names no node: refused, not guessed
    loose = client.CoreV1Api(cp.new_api_client(cp.service_account_token(sys_ns, "gpupack-device-plugin")))
    with pytest.raises(client.ApiException) as e:
        loose.patch_node(node_a, {"metadata": {"labels": {"gpupack.io/gpu-model": "x"}}})
    assert "names neither its pod nor its node" in e.value.body


def test_the_webhook_tells_a_stranger_nothing_it_did_not_send(webhook):
    """Issue 31 item 8: anyone who reaches the webhook port can post a review with any userInfo.
    A review in the device plugin's name, naming a real plugin pod, a missing one, or its own
    node, is refused in the same words, never with the pod's node, its existence or an API error;
    a too-large gpu-mem is refused without the largest GPU's size."""
    cp, sys_ns, sfx = webhook.cp, webhook.system, webhook.sfx
    node = f"wh-{sfx}"
    cp.ensure_namespace(sys_ns)
    real = cp.core.create_namespaced_pod(sys_ns, {"metadata": {"name": "dp-s"}, "spec": {
        "nodeName": node, "containers": [c("p")]}})  # fmt: skip

    def ask(pod: str, uid: str, target: str) -> dict:
        extra = {
            "authentication.kubernetes.io/pod-name": [pod],
            "authentication.kubernetes.io/pod-uid": [uid],
        }
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "r", "kind": {"kind": "Node"}, "operation": "UPDATE",
            "userInfo": {"username": f"system:serviceaccount:{sys_ns}:gpupack-device-plugin", "extra": extra},
            "object": {"metadata": {"name": target}}, "oldObject": {"metadata": {"name": target}}}}  # fmt: skip
        out = requests.post(webhook.url + "/validate", json=review, verify=str(webhook.ca), timeout=5)
        assert out.status_code == 200, out.text
        return out.json()["response"]

    answers = [ask("dp-s", "guessed", "x"), ask("dp-s", "guessed", node), ask("no-such-pod", "guessed", "x")]
    assert all(not a["allowed"] for a in answers)
    assert {a["status"]["message"].replace(node, "x") for a in answers} == {
        "gpupack: gpupack device plugin: may touch only its own node and the pods on it, not node x"
    }
    # with the pod's UID (which only its own token carries) its own node is allowed
    assert ask("dp-s", real.metadata.uid, node)["allowed"]
    pod = {"metadata": {"name": "big", "namespace": "t"}, "spec": {"schedulerName": "gpupack-scheduler",
           "containers": [c("a", {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "999999"})]}}  # fmt: skip
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "r", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod}}  # fmt: skip
    out = requests.post(webhook.url + "/validate", json=review, verify=str(webhook.ca), timeout=5).json()
    assert not out["response"]["allowed"] and str(L4_MIB) not in out["response"]["status"]["message"]
