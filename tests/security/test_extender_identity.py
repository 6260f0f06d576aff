"""Issue 31 item 3: the extender under an identity of its own, against the real API server.

The scheduler pod's ServiceAccount (gpupack-scheduler: kube-scheduler's rights) stays the pod's;
the extender gets a token of gpupack-extender that the real minter (`python -m gpupack.token`, as
the pod's account, with deploy/'s RBAC) requests for it, bound to a Secret the pod owns (the API
server binds a token to a pod only for the pod's own account). That token, with
deploy/'s policies in force, is refused what the shared one could do (a kube-system pod's image,
a pod delete, a webhook configuration, a Secret); a replaced token file is picked up by the next
request; and the token dies with the pod. That a real extender with such a token filters, binds,
preempts and writes reservations: tests/deploy/test_rbac_apiserver.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deploy_objects
import pytest
from kubernetes import client
from realk8s import ControlPlane, until

from gpupack import kubeclient

REPO = Path(__file__).resolve().parents[2]
FILES = (
    "scheduler/serviceaccount.yaml",
    "scheduler/rbac.yaml",
    "autoscale/rbac.yaml",
    "webhook/policies.yaml",
)


@dataclass
class Setup:
    cp: ControlPlane
    ns: str  # gpupack-system, moved
    tenant: str
    pod: client.V1Pod  # the scheduler pod the token is bound to (no kubelet runs it)
    sched_kc: Path  # the pod's own account, gpupack-scheduler
    out: Path


def mint(s: Setup, *extra: str, account: str = "gpupack-extender", once: bool = True) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpupack.token", "--service-account", account, "--namespace", s.ns,
           "--pod-name", s.pod.metadata.name, "--pod-uid", s.pod.metadata.uid, "--out-dir", str(s.out),
           "--kubeconfig", str(s.sched_kc), *(["--once"] if once else []), *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def who(cp: ControlPlane, token: str) -> client.V1TokenReviewStatus:
    auth = client.AuthenticationV1Api(cp.api_client())
    return auth.create_token_review({"spec": {"token": token}}).status


@pytest.fixture(scope="module")
def s(k8s: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    sfx = deploy_objects.suffix()
    ns, tenant = f"extid-{sfx}", f"extidt-{sfx}"
    k8s.ensure_namespace(ns)
    k8s.ensure_namespace(tenant)
    shipped = [o for f in FILES for o in deploy_objects.load(f)]
    deploy_objects.apply(k8s, k8s.for_this_server(deploy_objects.remap(shipped, ns)))
    node = f"extid-n-{sfx}"
    k8s.make_node(node)
    pod = k8s.core.create_namespaced_pod(ns, {"metadata": {"name": "gpupack-scheduler-0"}, "spec": {
        "nodeName": node, "serviceAccountName": "gpupack-scheduler", "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})  # fmt: skip
    tmp = tmp_path_factory.mktemp("extid")
    sched_kc = k8s.service_account_kubeconfig(tmp / "sched.kubeconfig", ns, "gpupack-scheduler")
    setup = Setup(k8s, ns, tenant, pod, sched_kc, tmp / "extender")
    p = mint(setup)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    try:
        yield setup
    finally:
        deploy_objects.drop_policies(k8s)
        k8s.reset()


def test_the_minted_token_is_the_extenders_bound_to_the_pods_secret(s: Setup):
    assert {p.name for p in s.out.iterdir()} >= {"token", "ca.crt", "kubeconfig"}
    assert (s.out / "token").stat().st_mode & 0o077 == 0  # the extender's user reads it, nobody else
    st = who(s.cp, (s.out / "token").read_text())
    assert st.authenticated, st.error
    assert st.user.username == f"system:serviceaccount:{s.ns}:gpupack-extender"
    mine = [x for x in s.cp.core.list_namespaced_secret(s.ns).items if x.type == "gpupack.io/token-binding"
            and [(o.kind, o.uid) for o in x.metadata.owner_references] == [("Pod", s.pod.metadata.uid)]]  # fmt: skip
    assert mine and all(not x.data for x in mine)  # an anchor for the token, holding nothing
    # the kubeconfig it wrote is enough for the extender: server, CA, the token by file
    kc = kubeclient.KubeClient(kubeclient.api_client(str(s.out / "kubeconfig")), timeout_s=10)
    assert kc.json(kc.core.list_node, limit=1)["items"]
    # the Lease it follows: allowed (none is there: no kube-scheduler runs here)
    with pytest.raises(kubeclient.ApiException) as e:
        kc.json(kc.coordination.read_namespaced_lease, "gpupack-scheduler", s.ns)
    assert e.value.status == 404


def test_the_pods_account_may_mint_no_other_token(s: Setup):
    for account in ("gpupack-scheduler", "default"):
        p = mint(s, account=account)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 1
        assert f"refused a token of ServiceAccount {s.ns}/{account}" in err
        assert "serviceaccounts/token" in err and "gpupack-extender-token" in err  # what to grant
    # the pod's account may not bind a token to its pod for another account: the API server's rule
    # that made the minter bind to a Secret the pod owns instead
    core = client.CoreV1Api(kubeclient.api_client(str(s.sched_kc)))
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_service_account_token("gpupack-extender", s.ns, {"spec": {"boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": s.pod.metadata.name, "uid": s.pod.metadata.uid}}})  # fmt: skip
    assert e.value.status == 400 and "different serviceaccount" in e.value.body
    # a typo'd flag is told before any request
    p = mint(s, "--expiry-s", "60")
    assert p.communicate(timeout=60)[1].count("at least 600") == 1 and p.returncode == 2


def test_the_extenders_token_is_refused_outside_its_scope(s: Setup):
    """The four writes of issue 31 item 3, with the minted token (RBAC, and the policies behind it)."""
    ext = client.CoreV1Api(kubeclient.api_client(str(s.out / "kubeconfig")))
    admin = s.cp.core

    def refused(fn, *a, **kw) -> str:  # type: ignore[no-untyped-def]
        with pytest.raises(client.ApiException) as e:
            fn(*a, **kw)
        assert e.value.status in (403, 422), e.value.body
        return str(json.loads(e.value.body)["message"])

    s.cp.ensure_namespace("kube-system")
    sys_pod = admin.create_namespaced_pod("kube-system", {"metadata": {"name": f"sys-{s.ns}"},
        "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}).metadata.name  # fmt: skip
    image = {"spec": {"containers": [{"name": "a", "image": "registry.invalid/evil:1"}]}}
    until(
        lambda: _refused_dry(ext.patch_namespaced_pod, sys_pod, "kube-system", image),
        30,
        "the policies enforced",
    )
    assert "may change only a pod's gpupack.io/" in refused(
        ext.patch_namespaced_pod, sys_pod, "kube-system", image
    )
    # pod delete: RBAC outside gpupack's namespace; inside it (the autoscale Role), the policy
    assert "cannot delete resource" in refused(ext.delete_namespaced_pod, sys_pod, "kube-system")
    tenant_pod = admin.create_namespaced_pod(s.tenant, {"metadata": {"name": "t"},
        "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}).metadata.name  # fmt: skip
    assert "cannot delete resource" in refused(ext.delete_namespaced_pod, tenant_pod, s.tenant)
    until(lambda: _refused_dry(ext.delete_namespaced_pod, s.pod.metadata.name, s.ns), 30, "the delete scope")
    assert "may delete only gpupack's autoscale placeholders" in refused(
        ext.delete_namespaced_pod, s.pod.metadata.name, s.ns
    )
    # webhook configurations and Secrets: not at all (the certificate step's, as gpupack-scheduler)
    reg = client.AdmissionregistrationV1Api(ext.api_client)
    body = {"metadata": {"name": "gpupack"}, "webhooks": []}
    assert "cannot update resource" in refused(reg.replace_mutating_webhook_configuration, "gpupack", body)
    assert "cannot update resource" in refused(reg.replace_validating_webhook_configuration, "gpupack", body)
    assert "cannot get resource" in refused(ext.read_namespaced_secret, "gpupack-webhook-tls", s.ns)
    assert "cannot list resource" in refused(ext.list_namespaced_secret, s.ns)
    # nothing changed
    p = admin.read_namespaced_pod(sys_pod, "kube-system")
    assert p.spec.containers[0].image == "registry.invalid/x:1" and p.metadata.deletion_timestamp is None
    assert admin.read_namespaced_pod(s.pod.metadata.name, s.ns).metadata.deletion_timestamp is None
    for name, ns in ((sys_pod, "kube-system"), (tenant_pod, s.tenant)):
        admin.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def _refused_dry(fn, *a) -> bool:  # type: ignore[no-untyped-def]
    """Whether admission refuses the call already (a dry run writes nothing)."""
    try:
        fn(*a, dry_run="All")
    except client.ApiException as e:
        return e.status in (403, 422) and "cannot" not in e.body  # the policy's word, not RBAC's
    return False


def test_a_replaced_token_is_used_by_the_next_request_and_the_sidecar_stops_on_sigterm(
    s: Setup, tmp_path: Path
):
    out = tmp_path / "ext"
    s2 = Setup(s.cp, s.ns, s.tenant, s.pod, s.sched_kc, out)
    side = mint(s2, once=False)
    try:
        until(lambda: (out / "kubeconfig").exists(), 60, "the sidecar's first token")
        kc = kubeclient.KubeClient(kubeclient.api_client(str(out / "kubeconfig")), timeout_s=10)
        kc.json(kc.core.list_node, limit=1)
        first = (out / "token").read_text()
        # the file replaced (as the minter does, by a rename): the next request carries the new one
        tmp = out / ".t"
        tmp.write_text("not-a-token")
        os.replace(tmp, out / "token")
        with pytest.raises(kubeclient.ApiException) as e:
            kc.json(kc.core.list_node, limit=1)
        assert e.value.status == 401
        tmp.write_text(first)
        os.replace(tmp, out / "token")
        kc.json(kc.core.list_node, limit=1)
        side.send_signal(signal.SIGTERM)
        assert side.wait(15) == 0
    finally:
        if side.poll() is None:
            side.kill()
            side.wait()


def test_the_token_dies_with_its_pod(s: Setup, tmp_path: Path):
    """Its Secret is the pod's: the garbage collector deletes it with the pod, and the token with it."""
    pod = s.cp.core.create_namespaced_pod(s.ns, {"metadata": {"name": "gpupack-scheduler-1"}, "spec": {
        "nodeName": s.pod.spec.node_name, "serviceAccountName": "gpupack-scheduler",
        "automountServiceAccountToken": False, "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})  # fmt: skip
    s2 = Setup(s.cp, s.ns, s.tenant, pod, s.sched_kc, tmp_path / "ext")
    p = mint(s2)
    assert p.communicate(timeout=60) and p.returncode == 0
    token = (s2.out / "token").read_text()
    assert who(s.cp, token).authenticated
    s.cp.core.delete_namespaced_pod(pod.metadata.name, s.ns, grace_period_seconds=0)
    until(lambda: not who(s.cp, token).authenticated, 60, "the token refused once its pod is gone")
