"""deploy/'s RBAC checked with real ServiceAccount tokens against the real kube-apiserver.

The RBAC manifests of the scheduler pod (kube-scheduler, the `gpupack certs` init step and the
token minter as gpupack-scheduler; the gpupack extender sidecar with its webhook as
gpupack-extender, with the token the real minter requests for it) and of the device plugin are
applied as shipped (moved into a namespace of this test), and each component runs as the real
program with its ServiceAccount's token, through a FaultProxy that records what it asks for, while
a GPU pod goes the whole way: admitted by the webhook, scheduled by kube-scheduler through the
extender, bound, and its GPU handed over by the device plugin's Allocate; then a preemption. Then:

- every request each component made is allowed for its ServiceAccount (no 403 anywhere);
- every permission of every gpupack Role/ClusterRole was needed by some request of the component
  it is for (an excess permission fails), and every binding to a built-in role was needed;
- a few things each account must never be able to do are refused.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import deploy_objects
import grpc
import pytest
import rbac_usage
import requests
import yaml
from faultproxy import FaultProxy
from kubernetes import client, config
from processes import ExtenderProcess, free_port
from realk8s import ControlPlane, kubeconfig_dict, running_ready_status, until

from deviceplugin.api import api_pb2, api_pb2_grpc
from gpupack import certs
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, ANN_INVENTORY, decode_assignment

REPO = Path(__file__).resolve().parents[2]
SCHED_SA, EXT_SA, DP_SA = "gpupack-scheduler", "gpupack-extender", "gpupack-device-plugin"
RBAC_FILES = ("scheduler/rbac.yaml", "deviceplugin/rbac.yaml")
# Which component each gpupack role is for (the manifests say so in their comments): its rules
# must all be needed by THAT component's requests.
ROLE_OWNER = {
    "gpupack-scheduler-leader-election": "kube-scheduler",
    "gpupack-extender": "extender",
    "gpupack-extender-lease": "extender",
    "gpupack-extender-preemption": "extender",
    "gpupack-extender-token": "token",
    "gpupack-webhook-certs": "certs",
    "gpupack-webhook-cabundle": "certs",
    "gpupack-device-plugin": "device-plugin",
}


def _rules(api: client.ApiClient, kind: str, name: str, namespace: str, shipped: list[dict]) -> list[dict]:
    """A role's rules: from the manifests when gpupack ships it, else the server's built-in one."""
    for o in shipped:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o["rules"]
    rbac = client.RbacAuthorizationV1Api(api)
    role = (
        rbac.read_cluster_role(name) if kind == "ClusterRole" else rbac.read_namespaced_role(name, namespace)
    )
    return [{"apiGroups": r.api_groups or [], "resources": r.resources or [], "verbs": r.verbs,
             "resourceNames": r.resource_names or []} for r in role.rules if r.resources]  # fmt: skip


def _bound_roles(objs: list[dict], sa_ns: str, sa: str) -> list[tuple[str, str, str]]:
    """(kind, name, namespace of a Role) of every role the manifests bind to that ServiceAccount."""
    out = []
    for o in objs:
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding") and any(
            s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == sa_ns
            for s in o["subjects"]
        ):
            ref = o["roleRef"]
            out.append(
                (
                    ref["kind"],
                    ref["name"],
                    o["metadata"].get("namespace", "") if ref["kind"] == "Role" else "",
                )
            )
    return out


def _can(cluster: ControlPlane, user: str, *args: str) -> str:
    out = cluster.kubectl("auth", "can-i", f"--as={user}", *args, check=False)
    return out.strip().splitlines()[0]  # then maybe a warning (a cluster-scoped resource given a namespace)


class Flow:
    """The components of one installation, each as its ServiceAccount through its own proxy.

    The proxies speak HTTPS: Go clients send a kubeconfig's credentials only over TLS."""

    def __init__(self, cluster: ControlPlane, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        sfx = deploy_objects.suffix()
        self.ns, self.work, self.node = f"rbac-{sfx}", f"rbacw-{sfx}", f"rbac-n-{sfx}"
        ca, ca_key = certs.new_ca(1)
        cert, key = certs.issue(ca, ca_key, ["127.0.0.1"], 1)
        self.ca = tmp / "proxy-ca.crt"
        self.ca.write_bytes(ca)
        (tmp / "proxy.crt").write_bytes(cert)
        (tmp / "proxy.key").write_bytes(key)
        tls = (str(tmp / "proxy.crt"), str(tmp / "proxy.key"))
        self.proxies = {c: FaultProxy(cluster.url, tls=tls).start()
                        for c in ("certs", "token", "extender", "kube-scheduler", "device-plugin")}  # fmt: skip
        self.procs: list[Any] = []

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for p in self.proxies.values():
            p.stop()

    def kubeconfig(self, component: str, sa: str, node: str = "") -> Path:
        """With `node`: the token of a pod of that ServiceAccount running on that node, as a
        DaemonSet pod's projected token is (bound to the pod: it names the pod)."""
        tok = self.cluster.service_account_token(self.ns, sa) if not node else self.pod_token(sa, node)
        path = self.tmp / f"{component}.kubeconfig"
        path.write_text(json.dumps(kubeconfig_dict(self.proxies[component].url, tok, self.ca)))
        return path

    def pod_token(self, sa: str, node: str) -> str:
        core = self.cluster.core
        pod = core.create_namespaced_pod(self.ns, {"metadata": {"name": f"{sa}-pod"}, "spec": {
            "nodeName": node, "serviceAccountName": sa, "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})  # fmt: skip
        return core.create_namespaced_service_account_token(sa, self.ns, {"spec": {"expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name,
                               "uid": pod.metadata.uid}}}).status.token  # fmt: skip


class _DevicePlugin:
    """`gpupack device-plugin` with the DaemonSet's flags, over the tests' fake NVML, as a process."""

    def __init__(self, kubeconfig: Path, node: str, log: Path) -> None:
        self.dir = tempfile.mkdtemp(prefix="dp")  # unix socket paths are short
        self.metrics_port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "deviceplugin"), str(REPO)]))
        shipped = deploy_objects.container_args("deviceplugin/daemonset.yaml", "device-plugin", "gpupack-system",
                                                {"NODE_NAME": node},
                                                drop=("--kubelet-dir", "--metrics-port"))  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpupack", "device-plugin", *shipped, "--node-name", node, "--kubelet-dir",
             self.dir, "--metrics-port", str(self.metrics_port), "--kubeconfig", str(kubeconfig),
             "--nvml-module", "fake_nvml", "--nvml-config",
             json.dumps({"gpus": 1, "model": "NVIDIA L4", "memory_mib": 23034, "sm_count": 58}),
             "--probe-interval", "0.5"],
            cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self.log = log
        self.socket = os.path.join(self.dir, "gpupack.sock")

    def allocate_one(self) -> dict[str, str]:
        """What the kubelet does at admission: the device list, then Allocate for one container."""
        with grpc.insecure_channel(f"unix://{self.socket}") as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            stream = stub.ListAndWatch(api_pb2.Empty())
            devices = next(stream).devices
            stream.cancel()
            req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(
                devices_ids=[devices[0].ID])])  # fmt: skip
            return dict(stub.Allocate(req, timeout=30).container_responses[0].envs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


@pytest.fixture
def flow(cluster: ControlPlane, tmp_path: Path):
    f = Flow(cluster, tmp_path)
    yield f
    f.stop()
    deploy_objects.drop_policies(cluster)


def test_each_component_runs_with_exactly_its_rbac(flow: Flow, cluster: ControlPlane):
    ns, tmp = flow.ns, flow.tmp
    cluster.ensure_namespace(ns, {"gpupack.io/webhook": "skip"})
    shipped = deploy_objects.remap(
        [o for f in RBAC_FILES for o in deploy_objects.load(f)]
        + deploy_objects.load("scheduler/serviceaccount.yaml") + deploy_objects.load("deviceplugin/serviceaccount.yaml"),
        ns,
    )  # fmt: skip
    deploy_objects.apply(cluster, shipped)
    # and the admission policies that narrow what the accounts may write (issue 11): every write of
    # the flow below must pass them (in the policy API version this server serves)
    deploy_objects.apply(
        cluster,
        cluster.for_this_server(deploy_objects.remap(deploy_objects.load("webhook/policies.yaml"), ns)),
    )
    webhook_port = free_port()
    hooks = deploy_objects.remap(deploy_objects.load("webhook/webhooks.yaml"), ns)
    for cfg in hooks:
        for hook in cfg["webhooks"]:
            hook["clientConfig"] = {
                "url": f"https://localhost:{webhook_port}{hook['clientConfig']['service']['path']}"
            }
    deploy_objects.apply(cluster, hooks)
    cluster.make_node(flow.node, extended={"gpupack.io/gpu": "16"})

    # 1. the init step: Secret + caBundles (and, on a later start, a renewal)
    kc = flow.kubeconfig("certs", SCHED_SA)
    kube = certs.Kube(config.new_client_from_config(str(kc)))
    tls = tmp / "tls"
    certs.ensure(kube, ns, "gpupack-webhook-tls", "localhost", ["gpupack"], ["gpupack"], tls, 3650, 365,
                 dt.timedelta(days=30))  # fmt: skip
    renewed = certs.ensure(kube, ns, "gpupack-webhook-tls", "localhost", ["gpupack"], ["gpupack"], tls, 3650, 365,
                           dt.timedelta(days=366))  # fmt: skip
    assert (tls / "tls.crt").read_bytes() == renewed.cert

    # 1b. the token minter (as the pod's account) mints the extender's token, bound to a Secret a
    #     stand-in of the scheduler pod owns; the extender reads it through a kubeconfig's tokenFile
    sched_pod = cluster.core.create_namespaced_pod(ns, {"metadata": {"name": "gpupack-scheduler-0"}, "spec": {
        "nodeName": flow.node, "serviceAccountName": SCHED_SA, "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})  # fmt: skip
    minted = tmp / "extender-token"
    mint = subprocess.run(
        [sys.executable, "-m", "gpupack.token", "--once", *deploy_objects.container_args(
            "scheduler/deployment.yaml", "extender-token", ns, {}, drop=("--out-dir",)),
         "--namespace", ns, "--pod-name", sched_pod.metadata.name, "--pod-uid", sched_pod.metadata.uid,
         "--out-dir", str(minted), "--kubeconfig", str(flow.kubeconfig("token", SCHED_SA))],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert mint.returncode == 0, mint.stderr
    ext_kc = tmp / "extender.kubeconfig"
    kc = kubeconfig_dict(flow.proxies["extender"].url, "", flow.ca)
    kc["users"][0]["user"] = {"tokenFile": str(minted / "token")}
    ext_kc.write_text(json.dumps(kc))

    # 2. the device plugin starts before gpupack's webhook: on 1.28-1.29 the API server refuses its
    #    inventory until the plugin-node webhook answers (it fails closed), and the plugin retries
    dp = _DevicePlugin(
        flow.kubeconfig("device-plugin", DP_SA, node=flow.node), flow.node, tmp / "device-plugin.log"
    )
    flow.procs.append(dp)

    # 3. the extender sidecar with its webhook, and kube-scheduler with the shipped configuration
    # the sidecar's own flags as shipped; kube-scheduler (here, on this host) names itself by host name
    shipped_args = deploy_objects.container_args(
        "scheduler/deployment.yaml",
        "extender",
        ns,
        {"POD_NAMESPACE": ns, "POD_NAME": socket.gethostname()},
        drop=("--port", "--metrics-port", "--webhook-port", "--tls-cert", "--tls-key", "--kubeconfig"),
    )
    with deploy_objects.pod_namespace(ns):
        ext = ExtenderProcess(ext_kc, tmp / "extender.log", "--metrics-port",
                              str(free_port()), "--webhook-port", str(webhook_port), "--tls-cert", str(tls / "tls.crt"), "--tls-key", str(tls / "tls.key"),
                              *shipped_args)  # fmt: skip
    flow.procs.append(ext)
    ext.wait_ready(60)
    until(lambda: _https_ok(f"https://localhost:{webhook_port}/readyz", tls / "ca.crt"), 60, "the webhook")
    # the device plugin's inventory, published once every check it needs answers
    until(lambda: ANN_INVENTORY in (cluster.core.read_node(flow.node).metadata.annotations or {}), 60,
          f"the device plugin's inventory on the node; log: {dp.log}")  # fmt: skip
    cm = next(
        o
        for o in deploy_objects.remap(deploy_objects.load("scheduler/config.yaml"), ns)
        if o["kind"] == "ConfigMap"
    )
    sched_cfg = yaml.safe_load(cm["data"]["config.yaml"])
    sched_cfg["extenders"][0]["urlPrefix"] = ext.url
    assert sched_cfg["leaderElection"]["resourceNamespace"] == ns  # moved with everything else
    sched_kc = flow.kubeconfig("kube-scheduler", SCHED_SA)
    secure = free_port()
    sched = cluster.start_scheduler(
        sched_cfg, name="gpupack-scheduler", kubeconfig=sched_kc, leader_election=sched_cfg["leaderElection"],
        # in a pod these come from the in-cluster config: the delegated authn/authz of its port
        extra_args=["--secure-port", str(secure), "--bind-address", "127.0.0.1",
                    "--authentication-kubeconfig", str(sched_kc), "--authorization-kubeconfig", str(sched_kc)],
    )  # fmt: skip
    flow.procs.append(sched)

    # 4. a GPU pod: the webhook completes it, kube-scheduler + extender place and bind it, the
    #    device plugin serves its Allocate. Its first Binding gets no answer: the extender fences it
    #    (a PATCH with its resourceVersion precondition) and kube-scheduler's retry binds it.
    #    Its namespace is created while the extender's namespace watch is away (cut, its next
    #    request held), so the extender reads that namespace once (its watch has the others).
    flow.proxies["extender"].delay(r"^/api/v1/namespaces$", 15, method="GET")
    # cut only once the watch is open: before, the cut could find none to cut
    until(
        lambda: "/api/v1/namespaces" in flow.proxies["extender"].open_watches(),
        30,
        "the namespace watch open",
    )
    assert flow.proxies["extender"].cut_watches() >= 1
    cluster.ensure_namespace(flow.work, {"gpupack.io/class": "offline"})
    flow.proxies["extender"].fail_next("POST", rf"/namespaces/{flow.work}/pods/p/binding$", 503)
    cluster.core.create_namespaced_pod(flow.work, {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "a", "image": "registry.invalid/x:1", "resources": {"limits": {"gpupack.io/gpu-mem": "1024"}}}]}})  # fmt: skip
    pod = until(lambda: _bound(cluster, flow.work, "p"), 60, f"the pod bound (logs: {sched.log}, {ext.log})")
    assert pod.spec.node_name == flow.node and pod.spec.scheduler_name == "gpupack-scheduler"
    assert flow.proxies["extender"].count("PATCH", rf"/namespaces/{flow.work}/pods/p$") == 1  # the fence
    assert pod.metadata.annotations[ANN_HANDOFF] == "pending"
    # the namespace's class label is the pod's default
    assert decode_assignment(pod.metadata.annotations[ANN_ASSIGNMENT]).pod_class == "offline"
    assert flow.proxies["extender"].count("GET", rf"^/api/v1/namespaces/{flow.work}$") == 1
    env = dp.allocate_one()
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    until(lambda: cluster.core.read_namespaced_pod("p", flow.work).metadata.annotations[ANN_HANDOFF] == "done",
          30, "handoff done")  # fmt: skip
    # the pod goes; a bind for it that comes late (no filter of it left to reuse) reads the pod
    # itself and answers that it is gone
    uid = pod.metadata.uid
    cluster.core.delete_namespaced_pod("p", flow.work, grace_period_seconds=0)
    until(lambda: not cluster.core.list_namespaced_pod(flow.work, field_selector="metadata.name=p").items, 30,
          "p deleted")  # fmt: skip
    late = ext.post("bind", {"PodName": "p", "PodNamespace": flow.work, "PodUID": uid, "Node": flow.node})
    assert late.status_code == 404 and "not found" in late.text, late.text
    assert flow.proxies["extender"].count("GET", rf"/namespaces/{flow.work}/pods/p$") >= 1
    # 5. a preemption (issue 26) whose only choice breaks a budget: the controller holds the GPU
    #    (Node patch), reads the budgets, is refused by the Eviction API and nominates the node for
    #    the preemptor; it deletes nothing (issue 31: no delete right), and evicts once the budget
    #    allows it; kube-scheduler then binds the preemptor there
    _preemption(cluster, flow, dp)
    # a Prometheus scrape of the plugin (it reads its node's pods for the per-pod series)
    assert requests.get(f"http://127.0.0.1:{dp.metrics_port}/metrics", timeout=10).status_code == 200
    # kube-scheduler's port authenticates (TokenReview) and authorizes (SubjectAccessReview) a
    # scrape through the API server; a scraper outside system:masters, which it would wave through
    deploy_objects.apply(cluster, [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{ns}-scrape"},
         "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": f"{ns}-scrape"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{ns}-scrape"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": flow.work}]},
    ])  # fmt: skip
    scraper = cluster.service_account_token(flow.work, "prometheus")
    r = requests.get(f"https://127.0.0.1:{secure}/metrics", headers={"Authorization": f"Bearer {scraper}"},
                     verify=False, timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text[:300]
    scraped = flow.proxies["kube-scheduler"]
    assert scraped.count("POST", "/tokenreviews$") and scraped.count("POST", "/subjectaccessreviews$")
    # the leader keeps renewing its Lease
    until(lambda: flow.proxies["kube-scheduler"].count("PUT", rf"/namespaces/{ns}/leases/gpupack-scheduler$"), 30,
          "a Lease renewal")  # fmt: skip

    # --- what they asked for, against what the manifests grant
    api = cluster.api_client()
    seen = {c: rbac_usage.seen_by(p) for c, p in flow.proxies.items()}
    for component, sa in (("certs", SCHED_SA), ("token", SCHED_SA), ("extender", EXT_SA),
                          ("kube-scheduler", SCHED_SA), ("device-plugin", DP_SA)):  # fmt: skip
        refused = rbac_usage.denied(api, f"system:serviceaccount:{ns}:{sa}", seen[component])
        assert refused == [], f"{component} was refused: {refused}"
    roles = [o for o in shipped if o["kind"] in ("Role", "ClusterRole")]
    assert {o["metadata"]["name"] for o in roles} == set(ROLE_OWNER), (
        "a new role: say which component it is for"
    )
    excess = {}
    for o in roles:
        name = o["metadata"]["name"]
        left = rbac_usage.unused(o["rules"], seen[ROLE_OWNER[name]], o["metadata"].get("namespace", ""))
        if left:
            excess[name] = left
    assert excess == {}, f"permissions no request needed: {excess}"
    # a binding to a built-in role must grant something the component needed and nothing else does
    for sa, components in ((SCHED_SA, ("certs", "token", "kube-scheduler")), (EXT_SA, ("extender",)),
                           (DP_SA, ("device-plugin",))):  # fmt: skip
        bound = {b: _rules(api, b[0], b[1], b[2], shipped) for b in _bound_roles(shipped, ns, sa)}
        used = set().union(*(seen[c] for c in components))
        for b, rules in bound.items():
            others = [(r, o[2]) for o, rs in bound.items() if o != b for r in rs]
            only = [a for a in used if any(rbac_usage.covers(r, a, b[2]) for r in rules)
                    and not any(rbac_usage.covers(r, a, n) for r, n in others)]  # fmt: skip
            assert only, (
                f"{sa}: binding to {b[0]} {b[1]} grants nothing its components needed that others do not"
            )


def _preemption(cluster: ControlPlane, flow: Flow, dp: _DevicePlugin) -> None:
    sch = client.SchedulingV1Api(cluster.api_client())
    low, high = f"{flow.work}-low", f"{flow.work}-high"
    for name, value in ((low, 10), (high, 1000)):
        sch.create_priority_class({"metadata": {"name": name}, "value": value})
    core, w = cluster.core, flow.work
    core.create_namespaced_pod(w, {"metadata": {"name": "v", "labels": {"app": "v"}}, "spec": {
        "priorityClassName": low, "terminationGracePeriodSeconds": 0, "containers": [
            {"name": "a", "image": "registry.invalid/x:1", "resources": {"limits": {"gpupack.io/gpu-mem": "1024"}}}]}})  # fmt: skip
    until(lambda: _bound(cluster, w, "v"), 60, "the victim bound")
    dp.allocate_one()
    until(
        lambda: core.read_namespaced_pod("v", w).metadata.annotations[ANN_HANDOFF] == "done",
        30,
        "v handed off",
    )
    # Running and Ready, as its kubelet would report it (the Eviction API lets a Pending pod go
    # whatever its budget says)
    core.patch_namespaced_pod_status("v", w, running_ready_status(core.read_namespaced_pod("v", w)))
    pol = client.PolicyV1Api(cluster.api_client())
    pol.create_namespaced_pod_disruption_budget(w, {"metadata": {"name": "keep-v"}, "spec": {
        "minAvailable": 1, "selector": {"matchLabels": {"app": "v"}}}})  # fmt: skip

    def computed() -> bool:
        st = pol.read_namespaced_pod_disruption_budget("keep-v", w).status
        return bool(st and st.observed_generation and st.current_healthy == 1 and st.disruptions_allowed == 0)

    until(computed, 30, "the budget computed")
    core.create_namespaced_pod(w, {"metadata": {"name": "hi", "labels": {"gpupack.io/class": "online"}}, "spec": {
        "priorityClassName": high, "containers": [
            {"name": "a", "image": "registry.invalid/x:1", "resources": {"limits": {"gpupack.io/gpu": "1"}}}]}})  # fmt: skip
    px = flow.proxies["extender"]
    # refused by the budget, tried again on the next pass, never deleted
    until(lambda: px.count("POST", rf"/namespaces/{w}/pods/v/eviction$") >= 2, 60, "the eviction retried")
    assert core.read_namespaced_pod("v", w).metadata.deletion_timestamp is None
    pol.delete_namespaced_pod_disruption_budget("keep-v", w)
    until(
        lambda: not core.list_namespaced_pod(w, field_selector="metadata.name=v").items, 60, "the victim gone"
    )
    until(lambda: _bound(cluster, w, "hi"), 60, "the preemptor bound")
    assert px.count("DELETE", rf"/namespaces/{w}/pods/v$") == 0
    # the nomination comes after the evictions (as kube-scheduler's): a victim that goes at once can
    # let kube-scheduler bind the preemptor first (v1.36 requeues it that fast)
    until(lambda: px.count("PATCH", rf"/namespaces/{w}/pods/hi/status$") >= 1, 30, "the nomination written")
    assert px.count("PATCH", rf"/nodes/{flow.node}$") >= 1
    until(lambda: px.count("PATCH", rf"/nodes/{flow.node}$") >= 2, 30, "the hold released")
    for name in (low, high):
        sch.delete_priority_class(name)


def test_what_the_accounts_must_never_do(cluster: ControlPlane):
    ns = f"rbac-{deploy_objects.suffix()}"
    cluster.ensure_namespace(ns)
    deploy_objects.apply(cluster, deploy_objects.remap(
        [o for f in RBAC_FILES for o in deploy_objects.load(f)]
        + deploy_objects.load("scheduler/serviceaccount.yaml") + deploy_objects.load("deviceplugin/serviceaccount.yaml"),
        ns))  # fmt: skip
    sched, dp = f"system:serviceaccount:{ns}:{SCHED_SA}", f"system:serviceaccount:{ns}:{DP_SA}"
    ext = f"system:serviceaccount:{ns}:{EXT_SA}"
    for user, args in [
        # the extender (issue 31): no pod delete, no Secret, no webhook configuration, no token
        (ext, ("delete", "pods", "-n", "default")),
        (ext, ("delete", "pods", "-n", ns)),
        (ext, ("get", "secrets/gpupack-webhook-tls", "-n", ns)),
        (ext, ("create", "secrets", "-n", ns)),
        (ext, ("update", "mutatingwebhookconfigurations/gpupack")),
        (ext, ("update", "validatingwebhookconfigurations/gpupack")),
        (ext, ("create", "serviceaccounts/gpupack-extender", "--subresource=token", "-n", ns)),
        (ext, ("update", "leases/gpupack-scheduler", "-n", ns)),
        (ext, ("update", "pods", "-n", "default")),
        # the pod's account mints the extender's tokens only
        (sched, ("create", "serviceaccounts/gpupack-device-plugin", "--subresource=token", "-n", ns)),
        (sched, ("create", "serviceaccounts/gpupack-scheduler", "--subresource=token", "-n", ns)),
        (sched, ("create", "serviceaccounts/gpupack-extender", "--subresource=token", "-n", "default")),
        (sched, ("patch", "pods", "-n", "default")),
        (sched, ("patch", "nodes")),
        # the scheduler pod: its own Secret and webhook configurations only, no workload changes
        (sched, ("get", "secrets/other", "-n", ns)),
        (sched, ("list", "secrets", "-n", ns)),
        (sched, ("get", "secrets/gpupack-webhook-tls", "-n", "kube-system")),
        (sched, ("update", "mutatingwebhookconfigurations/other")),
        (sched, ("update", "validatingwebhookconfigurations/other")),
        (sched, ("create", "mutatingwebhookconfigurations")),
        (sched, ("create", "pods")),
        (sched, ("update", "leases/kube-controller-manager", "-n", "kube-system")),
        # the extender's patch nodes is granted for preemption's holds, and narrowed to them (and the
        # scale-down mark) by gpupack-scheduler-node-scope (tests/security/test_admission_state.py)
        (ext, ("update", "nodes")),
        (ext, ("patch", "nodes", "--subresource=status")),
        (ext, ("delete", "nodes")),
        (sched, ("update", "nodes")),
        (sched, ("delete", "nodes")),
        (sched, ("create", "clusterrolebindings")),
        # the device plugin: its node's annotations and its pods' annotations, nothing more
        (dp, ("create", "pods", "--subresource=binding", "-n", ns)),
        (dp, ("delete", "pods", "-n", ns)),
        (dp, ("update", "nodes")),
        (dp, ("patch", "nodes", "--subresource=status")),
        (dp, ("delete", "nodes")),
        (dp, ("get", "secrets", "-n", ns)),
        (dp, ("create", "pods", "--subresource=eviction", "-n", ns)),
    ]:
        assert _can(cluster, user, *args) == "no", f"{user} can {' '.join(args)}"
    # and the checks can say yes: what they need is granted
    assert _can(cluster, sched, "update", "secrets/gpupack-webhook-tls", "-n", ns) == "yes"
    assert _can(cluster, sched, "create", "pods", "--subresource=binding", "-n", "default") == "yes"
    assert (
        _can(cluster, sched, "create", "serviceaccounts/gpupack-extender", "--subresource=token", "-n", ns)
        == "yes"
    )
    assert _can(cluster, ext, "create", "pods", "--subresource=eviction", "-n", "default") == "yes"
    assert _can(cluster, ext, "get", "leases/gpupack-scheduler", "-n", ns) == "yes"
    assert _can(cluster, dp, "patch", "nodes") == "yes"


def _https_ok(url: str, ca: Path) -> bool:
    try:
        return requests.get(url, verify=str(ca), timeout=2).ok
    except requests.RequestException:
        return False


def _bound(cluster: ControlPlane, ns: str, name: str) -> Any:
    p = cluster.core.read_namespaced_pod(name, ns)
    return p if p.spec.node_name else None
