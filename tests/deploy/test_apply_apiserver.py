"""deploy/ as the real kube-apiserver sees it: `kubectl apply --server-side -k` is accepted.

On a server that serves ValidatingAdmissionPolicy as admissionregistration.k8s.io/v1 (v1.30 on; the
suite runs on v1.36) that is `kubectl apply -k deploy/` itself; on one that serves only v1beta1
(v1.28-1.29 with the gate on) it is the command the operator guide gives for those versions, which
renders deploy/ and moves the two policy kinds to v1beta1.

The offline checks (tests/deploy/test_deploy_manifests.py) validate against JSON schemas; only the
real server runs its own validation, defaulting, CEL compilation of the webhooks' matchConditions,
RBAC escalation checks and server-side apply field ownership.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import deploy_objects
import realk8s
import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NS = "gpupack-system"


# docs/operator-guide.md, "Kubernetes versions": the install on a server that serves the policies
# only as v1beta1. Kustomize writes apiVersion right above kind, so the pair is matched together.
V1BETA1_POLICIES = (
    r"sed -E '/^apiVersion: admissionregistration\.k8s\.io\/v1$/{N;"
    r"s#/v1\nkind: (ValidatingAdmissionPolicy(Binding)?)$#/v1beta1\nkind: \1#}'"
)


def _apply(cluster, where: Path) -> str:
    """stdout of a server-side apply; fails on an error and on any warning the server sends back
    (deprecated APIs, Pod Security violations, unknown fields dropped) but the device plugin's."""
    kubectl = f"{shlex.quote(str(realk8s.binary('kubectl', cluster.assets)))} --kubeconfig {shlex.quote(str(cluster.kubeconfig))}"
    apply = f"{kubectl} apply --server-side --field-manager=gpupack-test"
    if cluster.policy_api() == "admissionregistration.k8s.io/v1":
        cmd = f"{apply} -k {shlex.quote(str(where))}"
    else:
        cmd = f"set -o pipefail; {kubectl} kustomize {shlex.quote(str(where))} | {V1BETA1_POLICIES} | {apply} -f -"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    warnings = [w for w in r.stderr.splitlines() if "warning" in w.lower()]
    # the device plugin alone needs hostPath and root (the namespace enforces "privileged" for it)
    expected = 'restricted volume type "hostPath"), runAsNonRoot != true (container "device-plugin"'
    assert all(expected in w and "seccompProfile" not in w for w in warnings), r.stderr
    return r.stdout


def _rendered(cluster, where: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(where))) if d]


def test_kustomizations_are_accepted_by_the_real_apiserver(cluster):
    base = _rendered(cluster, DEPLOY)
    # Applied for real (a server dry run of a namespaced object needs its namespace to exist). The
    # webhooks send every gpupack pod to a Service with no endpoints (failurePolicy Fail), so they
    # are removed before anything else runs (cluster.reset() would remove them too).
    out = _apply(cluster, DEPLOY)
    applied = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert len(applied) == len(base), out
    adm = client.AdmissionregistrationV1Api(cluster.api_client())
    try:
        # every object is there as written, in the namespace it names
        for o in base:
            ns = o["metadata"].get("namespace")
            args = ["get", o["kind"], o["metadata"]["name"], "-o", "json"] + (["-n", ns] if ns else [])
            got = yaml.safe_load(cluster.kubectl(*args))
            assert got["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpupack", o["kind"]
        # the server compiled the CEL matchConditions and kept them
        m = adm.read_mutating_webhook_configuration("gpupack")
        assert m.webhooks[0].match_conditions and m.webhooks[0].failure_policy == "Fail"
        # a second apply (an upgrade) changes nothing and conflicts with nothing
        again = _apply(cluster, DEPLOY)
        assert "conflict" not in again.lower()
        # the defrag folder applies on its own on top of the base, as its comment promises
        _apply(cluster, DEPLOY / "defrag")
        assert (
            cluster.kubectl("get", "cronjob", "-n", NS, "-o", "name").strip()
            == "cronjob.batch/gpupack-defrag"
        )
    finally:
        adm.delete_mutating_webhook_configuration("gpupack")
        adm.delete_validating_webhook_configuration("gpupack")
        deploy_objects.drop_policies(cluster)
    examples = _rendered(cluster, DEPLOY / "examples")
    out = _apply(cluster, DEPLOY / "examples")
    assert len([line for line in out.splitlines() if line.strip()]) == len(examples), out
    dep = yaml.safe_load(cluster.kubectl("get", "deployment", "llm-7b", "-n", "gpupack-demo", "-o", "json"))
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert {"gpupack.io/gpu-mem", "gpupack.io/gpu-sm"} <= set(limits)
