"""The Helm chart against the real API server (v1.28.7 or v1.36.2), with both real Helm clients
(v4, which applies server-side, and v3, which patches three-way): rendered and applied server-side
as a dry run; installed; upgraded with changed values (only the objects they change change);
rolled back; uninstalled, leaving no webhook configuration or admission policy that would keep
refusing pods. A misspelt or mistyped value is refused by `helm install` before anything is made.

The chart's pods never run (there is no kubelet for them): the objects must be accepted and
correct. gpupack is one per cluster (fixed cluster-scoped names), so each test installs once, in
a namespace of its own, and the `cluster` fixture clears what is left after it.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import deploy_objects
import pytest
import realhelm
import realk8s
import yaml
from chart_objects import (
    CHART,
    DEPLOY,
    helm,
    helm_assets,  # noqa: F401 (a fixture, used by pytestmark)
    key,
)
from kubernetes import client

# without the Helm binaries: skipped, or failed where CI requires them
pytestmark = pytest.mark.usefixtures("helm_assets")

# what the operator guide has the operator label the namespace with before `helm install`
NS_LABELS = {
    "gpupack.io/webhook": "skip",
    "pod-security.kubernetes.io/enforce": "privileged",
    "pod-security.kubernetes.io/warn": "restricted",
}
POLICY_KINDS = ("validatingadmissionpolicies", "validatingadmissionpolicybindings")


class Helm:
    """One Helm client pointed at the test control plane, its state kept under `home`."""

    def __init__(self, name: str, cluster: realk8s.ControlPlane, home: Path) -> None:
        self.name, self.cluster, self.home = name, cluster, home

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return helm(
            self.name, *args, "--kubeconfig", str(self.cluster.kubeconfig), home=self.home, check=check
        )

    def manifest(self, release: str, namespace: str) -> list[dict[str, Any]]:
        out = self("get", "manifest", release, "-n", namespace).stdout
        return [d for d in yaml.safe_load_all(out) if d]


def _live(
    cluster: realk8s.ControlPlane, objs: list[dict[str, Any]]
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The objects of `objs` that exist, as the API server has them (one `kubectl get -f`)."""
    out = cluster.kubectl(
        "get", "-f", "-", "-o", "json", "--ignore-not-found", input=yaml.safe_dump_all(objs)
    )
    return {key(o): o for o in (json.loads(out)["items"] if out.strip() else [])}


def _one(cluster: realk8s.ControlPlane, objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (o,) = [o for o in objs if o["kind"] == kind]
    return _live(cluster, [o])[key(o)]


def _versions(cluster: realk8s.ControlPlane, objs: list[dict[str, Any]]) -> dict[tuple[str, str, str], str]:
    """Each object's generation where it has one (a status write by a controller does not change
    it), else its resourceVersion (objects nobody but their owner writes)."""
    live = _live(cluster, objs)
    assert set(live) == {key(o) for o in objs}, {key(o) for o in objs} - set(live)
    return {
        k: f"generation {o['metadata']['generation']}"
        if "generation" in o["metadata"]
        else f"rv {o['metadata']['resourceVersion']}"
        for k, o in live.items()
    }


def _server_version(cluster: realk8s.ControlPlane) -> str:
    return str(cluster._get("/version")["gitVersion"])


def _clear_leftovers(cluster: realk8s.ControlPlane) -> None:
    """What `kubectl apply -k deploy/` (other tests) leaves where cluster.reset() does not look: the
    one object gpupack puts in kube-system. Helm would refuse to take it over, as it would from an
    operator who installed with kustomize before (delete it, or `kubectl delete -k deploy/` first)."""
    cluster.kubectl("delete", "rolebinding", "-n", "kube-system", "gpupack-scheduler-authentication-reader",
                    "--ignore-not-found")  # fmt: skip


def _gpu_pod(name: str) -> dict[str, Any]:
    res = {"gpupack.io/gpu-mem": "1024", "gpupack.io/gpu-sm": "10"}
    return {"metadata": {"name": name}, "spec": {"containers": [
        {"name": "a", "image": "registry.invalid/x:1", "resources": {"requests": res, "limits": res}}]}}  # fmt: skip


def _state_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {"gpupack.io/handoff": "pending"}},
            "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}  # fmt: skip


def _refusal(cluster: realk8s.ControlPlane, ns: str, pod: dict[str, Any]) -> str:
    """Why the API server refuses `pod` (a dry run: nothing is made), "" when it admits it."""
    try:
        cluster.core.create_namespaced_pod(ns, pod, dry_run="All")
        return ""
    except client.ApiException as e:
        return f"{e.status} {e.body}"


def _gpupack_admission(cluster: realk8s.ControlPlane) -> list[str]:
    """The webhook configurations and admission policies (and bindings) named gpupack*."""
    names = []
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations", *POLICY_KINDS):
        res = f"{kind}.admissionregistration.k8s.io"
        for line in cluster.kubectl("get", res, "-o", "name").split():
            if line.split("/", 1)[1].startswith("gpupack"):
                names.append(line)
    return names


def test_template_applies_server_side(cluster, tmp_path):
    # `helm template` for this server (its version and admission-policy API) and a server-side dry
    # run of everything, the `helm test` hooks included: the server's own validation, defaulting,
    # CEL compilation and Pod Security checks, with nothing left behind. (Helm 4 renders; Helm 3
    # renders the same objects: tests/deploy/test_chart_matches_deploy.py.)
    ns = f"gpupack-tpl-{deploy_objects.suffix()}"
    cluster.ensure_namespace(ns, NS_LABELS)
    _clear_leftovers(cluster)
    out = Helm("helm", cluster, tmp_path)(
        "template", "gpupack", str(CHART), "-n", ns, "--kube-version", _server_version(cluster),
        "--api-versions", f"{cluster.policy_api()}/ValidatingAdmissionPolicy",
    ).stdout  # fmt: skip
    objs = [d for d in yaml.safe_load_all(out) if d]
    kubectl = shlex.quote(str(realk8s.binary("kubectl", cluster.assets)))
    r = subprocess.run(
        ["bash", "-c", f"{kubectl} --kubeconfig {shlex.quote(str(cluster.kubeconfig))} apply --server-side "
                       "--dry-run=server --field-manager=gpupack-test -f -"],
        input=out, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) == len(objs), r.stdout
    # the server warns of Pod Security "restricted" for the device plugin alone (root, hostPath)
    warnings = [w for w in r.stderr.splitlines() if "warning" in w.lower()]
    assert all('container "device-plugin"' in w and "seccompProfile" not in w for w in warnings), r.stderr
    assert {o["apiVersion"] for o in objs if o["kind"] == "ValidatingAdmissionPolicy"} == {
        cluster.policy_api()
    }


@pytest.mark.parametrize("client_name", realhelm.CLIENTS)
def test_install_refuses_a_misspelt_or_mistyped_value(cluster, client_name, tmp_path):
    h = Helm(client_name, cluster, tmp_path)
    ns = f"gpupack-bad-{deploy_objects.suffix()}"
    cluster.ensure_namespace(ns, NS_LABELS)
    for args, says in (
        (["--set", "imagee.tag=x"], "imagee"),
        (["--set", "defrag.budget.maxEvictions=ten"], "maxEvictions"),
    ):
        r = h("install", "gpupack", str(CHART), "-n", ns, *args, check=False)
        assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, (
            r.stderr
        )
        assert says in r.stderr, r.stderr
    # refused before anything was made: no release, no object
    assert h("list", "-n", ns, "-q").stdout.strip() == ""
    assert _gpupack_admission(cluster) == []


def _upgrade_changes_only_what_changed(
    h: Helm, release: str, ns: str, objs: list[dict[str, Any]], before: dict[tuple[str, str, str], str]
) -> tuple[dict[tuple[str, str, str], str], set[tuple[str, str, str]]]:
    """`helm upgrade` with a new defrag schedule and scheduler profile weight: exactly the three
    objects those values are in change (generation or resourceVersion); (versions, changed)."""
    h("upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values", "--set", "defrag.schedule=0 3 * * *",
      "--set", "scheduler.profile.extender.weight=5")  # fmt: skip
    after = _versions(h.cluster, objs)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {
        ("CronJob", ns, "gpupack-defrag"),
        ("ConfigMap", ns, "gpupack-scheduler-config"),
        ("Deployment", ns, "gpupack-scheduler"),  # its pods roll: kube-scheduler reads the profile at start
    }, changed
    assert _one(h.cluster, objs, "CronJob")["spec"]["schedule"] == "0 3 * * *"
    return after, changed


@pytest.mark.parametrize("client_name", realhelm.CLIENTS)
def test_install_upgrade_rollback_uninstall(cluster, client_name, tmp_path):
    h = Helm(client_name, cluster, tmp_path)
    s = deploy_objects.suffix()
    ns, release, tenants = f"gpupack-chart-{s}", f"gpupack-{s}", f"tenant-{s}"
    _clear_leftovers(cluster)
    cluster.ensure_namespace(ns, NS_LABELS)
    cluster.ensure_namespace(tenants)
    assert _refusal(cluster, tenants, _gpu_pod("before")) == ""  # nothing of gpupack's yet

    # --- install
    out = h("install", release, str(CHART), "-n", ns).stdout
    assert f"is installed in namespace {ns}" in out and "WARNING" not in out, out
    objs = h.manifest(release, ns)
    kinds = {o["kind"] for o in objs}
    assert {
        "Deployment",
        "DaemonSet",
        "CronJob",
        "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
    } <= kinds
    live = _live(cluster, objs)
    assert set(live) == {key(o) for o in objs}, {key(o) for o in objs} - set(live)
    assert {o["metadata"]["labels"]["app.kubernetes.io/instance"] for o in live.values()} == {release}
    # what the chart chose from this server: kube-scheduler at its version, the policies' API
    dep = _one(cluster, objs, "Deployment")
    images = {c["name"]: c["image"] for c in dep["spec"]["template"]["spec"]["containers"]}
    assert images["kube-scheduler"] == f"registry.k8s.io/kube-scheduler:{_server_version(cluster)}"
    assert {o["apiVersion"] for o in objs if o["kind"].startswith("ValidatingAdmissionPolicy")} == {
        cluster.policy_api()
    }
    # in force: a GPU pod waits on the webhook (no endpoints here: refused, failurePolicy Fail) and
    # gpupack's state is gpupack's to write
    assert "gpupack" in _refusal(cluster, tenants, _gpu_pod("gpu"))
    assert "gpupack" in _refusal(cluster, tenants, _state_pod("state"))

    # the scheduler pod's certificate step writes the CA into both webhook configurations, as
    # another field manager; Helm must keep it across upgrade and rollback
    adm = client.AdmissionregistrationV1Api(cluster.api_client())
    ca = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="

    def inject() -> None:
        for read, patch in ((adm.read_mutating_webhook_configuration, adm.patch_mutating_webhook_configuration),
                            (adm.read_validating_webhook_configuration, adm.patch_validating_webhook_configuration)):  # fmt: skip
            hooks = [{"name": w.name, "clientConfig": {"caBundle": ca}} for w in read("gpupack").webhooks]
            patch("gpupack", {"webhooks": hooks}, field_manager="gpupack-certs")

    def cas() -> set[str]:
        hooks = adm.read_mutating_webhook_configuration("gpupack").webhooks
        hooks += adm.read_validating_webhook_configuration("gpupack").webhooks
        return {w.client_config.ca_bundle for w in hooks}

    inject()
    assert cas() == {ca}
    first = _versions(cluster, objs)

    # --- upgrade: a defrag schedule and a scheduler profile knob; nothing else may change
    second, changed = _upgrade_changes_only_what_changed(h, release, ns, objs, first)
    assert cas() == {ca}

    # --- rollback to the install: the same three change back, the CA stays
    h("rollback", release, "1", "-n", ns)
    third = _versions(cluster, objs)
    assert {k for k in second if second[k] != third[k]} == changed
    assert _one(cluster, objs, "CronJob")["spec"]["schedule"] == "30 1 * * *"
    cfg = yaml.safe_load(_one(cluster, objs, "ConfigMap")["data"]["config.yaml"])
    assert cfg["extenders"][0]["weight"] == 10
    assert cas() == {ca}
    history = yaml.safe_load(h("history", release, "-n", ns, "-o", "yaml").stdout)
    assert [r["revision"] for r in history] == [1, 2, 3] and history[-1]["status"] == "deployed"

    # --- uninstall: nothing of the release is left, above all nothing that admits or refuses pods
    h("uninstall", release, "-n", ns, "--wait")
    assert _live(cluster, objs) == {}
    assert _gpupack_admission(cluster) == []
    # the API server stops enforcing a deleted policy a moment later: wait for it, never sleep
    realk8s.until(
        lambda: _refusal(cluster, tenants, _gpu_pod("after")) == "" and _refusal(cluster, tenants, _state_pod("after")) == "",
        timeout=30, what="pods admitted once gpupack is uninstalled",
    )  # fmt: skip
    with contextlib.suppress(client.ApiException):
        cluster.core.delete_namespace(tenants)


def test_helm_takes_over_a_kustomize_install_in_place(cluster, tmp_path):
    # An operator moving from `kubectl apply -k deploy/` to the chart: mark what kustomize made as
    # the release's (the two commands the operator guide gives), then `helm install` adopts it: no
    # object is deleted and made again (same uid), nothing stops admitting or scheduling meanwhile
    ns = deploy_objects.SHIPPED_NS
    objs = [o for o in yaml.safe_load_all(cluster.kubectl("kustomize", str(DEPLOY))) if o]
    objs = [o for o in cluster.for_this_server(objs) if o["kind"] != "Namespace"]
    cluster.ensure_namespace(ns, NS_LABELS)
    _clear_leftovers(cluster)
    text = yaml.safe_dump_all(objs)
    cluster.kubectl("apply", "-f", "-", input=text)  # what `kubectl apply -k deploy/` does
    uids = {k: o["metadata"]["uid"] for k, o in _live(cluster, objs).items()}
    assert len(uids) == len(objs)
    cluster.kubectl("annotate", "-f", "-", "--overwrite", "meta.helm.sh/release-name=gpupack",
                    f"meta.helm.sh/release-namespace={ns}", input=text)  # fmt: skip
    cluster.kubectl("label", "-f", "-", "--overwrite", "app.kubernetes.io/managed-by=Helm", input=text)
    h = Helm("helm", cluster, tmp_path)
    # Helm 4 applies server-side: fields kubectl set (the scheduler configuration's text, the
    # kube-scheduler image the chart picks for this cluster, structs the server filled in) conflict
    # with its apply until it is told to take them over (without, the install fails naming them)
    h("install", "gpupack", str(CHART), "-n", ns, "--force-conflicts")
    after = _live(cluster, h.manifest("gpupack", ns))
    assert {k: o["metadata"]["uid"] for k, o in after.items()} == uids
    h("uninstall", "gpupack", "-n", ns, "--wait")
    assert _live(cluster, objs) == {}
    assert _gpupack_admission(cluster) == []


def test_helm4_upgrades_and_uninstalls_a_helm3_release(cluster, tmp_path):
    # an operator moving to Helm 4 keeps the release Helm 3 installed
    s = deploy_objects.suffix()
    ns, release = f"gpupack-chart-{s}", f"gpupack-{s}"
    _clear_leftovers(cluster)
    cluster.ensure_namespace(ns, NS_LABELS)
    Helm("helm3", cluster, tmp_path)("install", release, str(CHART), "-n", ns)
    h = Helm("helm", cluster, tmp_path)
    objs = h.manifest(release, ns)
    _upgrade_changes_only_what_changed(h, release, ns, objs, _versions(cluster, objs))
    h("uninstall", release, "-n", ns, "--wait")
    assert _live(cluster, objs) == {}
    assert _gpupack_admission(cluster) == []


def test_notes_say_what_the_namespace_lacks(cluster, tmp_path):
    # `helm install --create-namespace` (or a namespace made by hand) lacks the labels gpupack
    # needs: the install's notes say which, with the command that adds them (read from the server)
    ns = f"gpupack-bare-{deploy_objects.suffix()}"
    cluster.ensure_namespace(ns, {"gpupack.io/webhook": "skip"})
    out = Helm("helm", cluster, tmp_path)(
        "install", "gpupack", str(CHART), "-n", ns, "--dry-run=server"
    ).stdout
    notes = out.split("\nNOTES:\n", 1)[1]
    assert (
        f"kubectl label namespace {ns} --overwrite pod-security.kubernetes.io/enforce=privileged "
        "pod-security.kubernetes.io/warn=restricted\n" in notes
    ), notes
