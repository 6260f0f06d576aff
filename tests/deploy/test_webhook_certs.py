"""gpupack.certs against the real kube-apiserver: the webhook's certificates, created and renewed
with no cert-manager, and the caBundle written into the real webhook configurations."""

from __future__ import annotations

import base64
import datetime as dt
import subprocess
import sys
import threading
from pathlib import Path

import deploy_objects
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from faultproxy import FaultProxy
from kubernetes import client, config
from processes import error_lines
from realk8s import until

from gpupack import certs

REPO = Path(__file__).resolve().parents[2]
SECRET = "gpupack-webhook-tls"
SECRETS = r"/api/v1/namespaces/[^/]+/secrets"
WEBHOOKS = r"/apis/admissionregistration\.k8s\.io/v1/(mutating|validating)webhookconfigurations"


@pytest.fixture
def ns(cluster) -> str:
    """A namespace holding the Secret, and the shipped webhook configurations pointing into it.

    The configurations are the real ones (failurePolicy Fail, a Service with no endpoints); no
    test here creates a GPU pod while they exist, and cluster.reset() removes them."""
    name = f"certs-{deploy_objects.suffix()}"
    cluster.ensure_namespace(name)
    deploy_objects.apply(cluster, deploy_objects.remap(deploy_objects.load("webhook/webhooks.yaml"), name))
    return name


def run_cli(cluster, tmp_path: Path, ns: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "gpupack", "certs", f"--kubeconfig={cluster.kubeconfig}", f"--namespace={ns}",
            "--mutating-webhook-configuration=gpupack", "--validating-webhook-configuration=gpupack",
            f"--out-dir={tmp_path / 'tls'}", *extra]  # fmt: skip
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)


def ensure(kubeconfig: Path, ns: str, out: Path, service: str = "gpupack-webhook") -> certs.Bundle:
    """The same job as the CLI, in-process (each CLI start pays seconds of imports)."""
    kube = certs.Kube(config.new_client_from_config(str(kubeconfig)))
    return certs.ensure(
        kube, ns, SECRET, service, ["gpupack"], ["gpupack"], out, 3650, 365, dt.timedelta(days=30)
    )


# mutate.pods, validate.pods, state.pods and plugin-node (deploy/webhook/webhooks.yaml)
HOOKS = 4


def secret_bundle(cluster, ns: str) -> certs.Bundle:
    s = cluster.core.read_namespaced_secret(SECRET, ns)
    assert s.type == "kubernetes.io/tls"
    return certs.Bundle(*(base64.b64decode(s.data[k]) for k in ("ca.crt", "ca.key", "tls.crt", "tls.key")))


def ca_bundles(cluster) -> list[bytes]:
    """The caBundle of every webhook, in order: the mutating one, then the validating ones."""
    adm = client.AdmissionregistrationV1Api(cluster.api_client())
    hooks = adm.read_mutating_webhook_configuration("gpupack").webhooks
    hooks += adm.read_validating_webhook_configuration("gpupack").webhooks
    assert len(hooks) == HOOKS
    return [base64.b64decode(h.client_config.ca_bundle or "") for h in hooks]


def test_first_run_creates_secret_injects_ca_and_writes_files(cluster, ns, tmp_path):
    r = run_cli(cluster, tmp_path, ns)
    assert r.returncode == 0, r.stderr
    b = secret_bundle(cluster, ns)
    assert ca_bundles(cluster) == [b.ca_cert] * HOOKS
    # the files the webhook server loads are the Secret's serving pair
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == b.cert
    assert (tmp_path / "tls" / "tls.key").read_bytes() == b.key
    assert (tmp_path / "tls" / "tls.key").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate(b.cert)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(b.ca_cert))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"gpupack-webhook.{ns}.svc" in sans.get_values_for_type(x509.DNSName)
    assert certs.needs_new_cert(b, certs.dns_names("gpupack-webhook", ns), dt.timedelta(days=30)) == ""


def test_second_run_writes_nothing(cluster, ns, tmp_path):
    ensure(cluster.kubeconfig, ns, tmp_path / "tls")
    with FaultProxy(cluster.url) as fp:
        kc = cluster.write_kubeconfig(tmp_path / "kc", server=fp.url)
        ensure(kc, ns, tmp_path / "tls")
        writes = [(r.method, r.path) for r in fp.requests if r.method != "GET"]
        assert writes == []
        assert fp.count("GET", SECRETS) == 1 and fp.count("GET", WEBHOOKS) == 2


def test_new_service_name_reissues_from_same_ca_and_keeps_ca_bundle(cluster, ns, tmp_path):
    ensure(cluster.kubeconfig, ns, tmp_path / "tls")
    before = secret_bundle(cluster, ns)
    ensure(cluster.kubeconfig, ns, tmp_path / "tls", service="gpupack-webhook-v2")
    after = secret_bundle(cluster, ns)
    assert after.ca_cert == before.ca_cert and after.cert != before.cert
    assert ca_bundles(cluster) == [before.ca_cert] * HOOKS
    sans = x509.load_pem_x509_certificate(after.cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert f"gpupack-webhook-v2.{ns}.svc" in sans.value.get_values_for_type(x509.DNSName)


def test_corrupt_secret_gets_a_new_ca_and_the_webhooks_follow(cluster, ns, tmp_path):
    ensure(cluster.kubeconfig, ns, tmp_path / "tls")
    old = secret_bundle(cluster, ns)
    cluster.core.patch_namespaced_secret(
        SECRET, ns, {"data": {"ca.crt": base64.b64encode(b"not a cert").decode()}}
    )
    ensure(cluster.kubeconfig, ns, tmp_path / "tls")
    new = secret_bundle(cluster, ns)
    assert new.ca_cert != old.ca_cert
    assert ca_bundles(cluster) == [new.ca_cert] * HOOKS


def test_losing_the_create_race_uses_the_winners_secret(cluster, ns, tmp_path):
    """Another replica creates the Secret between our read (404) and our create (409 AlreadyExists)."""
    winner, _ = certs.plan(None, certs.dns_names("gpupack-webhook", ns), 3650, 365, dt.timedelta(days=30))
    with FaultProxy(cluster.url) as fp:
        fp.delay(SECRETS + "$", 2.0, method="POST")
        kc = cluster.write_kubeconfig(tmp_path / "kc", server=fp.url)
        got: list[certs.Bundle] = []
        t = threading.Thread(target=lambda: got.append(ensure(kc, ns, tmp_path / "tls")))
        t.start()
        until(lambda: fp.count("POST", SECRETS + "$") == 1, 30, "our create to be in flight")
        cluster.core.create_namespaced_secret(
            ns, {"metadata": {"name": SECRET}, "type": "kubernetes.io/tls", "data": winner.secret_data()}
        )
        t.join(60)
        assert got == [winner]
    assert secret_bundle(cluster, ns) == winner
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == winner.cert
    assert ca_bundles(cluster) == [winner.ca_cert] * HOOKS


def test_a_concurrent_webhook_edit_is_kept(cluster, ns, tmp_path):
    """The caBundle update carries the resourceVersion it read: an edit made in between turns it
    into a 409 and a re-read, never a silent overwrite of the other writer's change."""
    with FaultProxy(cluster.url) as fp:
        fp.delay(WEBHOOKS + "/gpupack$", 2.0, method="PUT")
        kc = cluster.write_kubeconfig(tmp_path / "kc", server=fp.url)
        t = threading.Thread(target=ensure, args=(kc, ns, tmp_path / "tls"))
        t.start()
        until(
            lambda: fp.count("PUT", r"/mutatingwebhookconfigurations/gpupack$") == 1,
            30,
            "our update in flight",
        )
        adm = client.AdmissionregistrationV1Api(cluster.api_client())
        adm.patch_mutating_webhook_configuration("gpupack", {"metadata": {"labels": {"edited": "yes"}}})
        t.join(60)
        assert fp.count("PUT", r"/mutatingwebhookconfigurations/gpupack$") == 2  # the 409, then the retry
    m = client.AdmissionregistrationV1Api(cluster.api_client()).read_mutating_webhook_configuration("gpupack")
    assert m.metadata.labels["edited"] == "yes"
    assert ca_bundles(cluster) == [secret_bundle(cluster, ns).ca_cert] * HOOKS


def test_missing_webhook_configuration_is_a_one_line_error(cluster, ns, tmp_path):
    r = run_cli(cluster, tmp_path, ns, "--mutating-webhook-configuration=absent")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "MutatingWebhookConfiguration absent: 404" in r.stderr


def test_unreachable_api_server_is_a_one_line_error(cluster, tmp_path):
    kc = cluster.write_kubeconfig(tmp_path / "kc", server="http://127.0.0.1:1")  # nothing listens on port 1
    r = subprocess.run([sys.executable, "-m", "gpupack", "certs", f"--kubeconfig={kc}", "--namespace=x",
                        f"--out-dir={tmp_path / 'tls'}"], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and len(error_lines(r.stderr)) == 1, r.stderr


def test_serving_cert_near_expiry_is_renewed_with_the_same_ca():
    names = certs.dns_names("gpupack-webhook", "gpupack-system")
    b, why = certs.plan(None, names, 3650, 365, dt.timedelta(days=30))
    assert why
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=340)
    renewed, why = certs.plan(b, names, 3650, 365, dt.timedelta(days=30), now=later)
    assert "expires" in why
    assert renewed.ca_cert == b.ca_cert and renewed.cert != b.cert
    assert x509.load_pem_x509_certificate(renewed.cert).not_valid_after_utc > later + dt.timedelta(days=300)
    # a CA near its own expiry is replaced, and the new serving cert chains to the new CA
    much_later = dt.datetime.now(dt.UTC) + dt.timedelta(days=3640)
    fresh, why = certs.plan(b, names, 3650, 365, dt.timedelta(days=30), now=much_later)
    assert "CA expires" in why and fresh.ca_cert != b.ca_cert
    assert certs.needs_new_cert(fresh, names, dt.timedelta(days=30), now=much_later) == ""


def test_key_that_does_not_match_is_replaced():
    names = certs.dns_names("gpupack-webhook", "gpupack-system")
    a, _ = certs.plan(None, names, 3650, 365, dt.timedelta(days=30))
    b, _ = certs.plan(None, names, 3650, 365, dt.timedelta(days=30))
    mixed = certs.Bundle(a.ca_cert, a.ca_key, a.cert, b.key)
    assert "does not match" in certs.needs_new_cert(mixed, names, dt.timedelta(days=30))
    foreign = certs.Bundle(a.ca_cert, a.ca_key, b.cert, b.key)
    assert "not signed by the CA" in certs.needs_new_cert(foreign, names, dt.timedelta(days=30))
    serialization.load_pem_private_key(a.key, password=None)  # PEM PKCS8, loadable by the server
