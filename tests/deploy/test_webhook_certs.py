"""gpupack.certs: the webhook's certificates, created and renewed with no cert-manager."""

from __future__ import annotations

import base64
import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from certs_apiserver import CertsAPIServer, kubeconfig_for
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpupack import certs

REPO = Path(__file__).resolve().parents[2]
NS = "gpupack-system"


def webhook_config(name: str = "gpupack") -> dict:
    hook = {
        "name": "pods.gpupack.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "clientConfig": {"service": {"name": "gpupack-webhook", "namespace": NS, "path": "/mutate", "port": 443}},
    }
    return {"metadata": {"name": name}, "webhooks": [hook, {**hook, "name": "other.gpupack.io"}]}


@pytest.fixture
def api(tmp_path: Path):
    server = CertsAPIServer().start()
    server.put("mutating", "", webhook_config())
    (tmp_path / "kubeconfig").write_text(server.kubeconfig())
    yield server
    server.stop()


def run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "gpupack.certs", f"--kubeconfig={tmp_path / 'kubeconfig'}", f"--namespace={NS}",
            "--mutating-webhook-configuration=gpupack", f"--out-dir={tmp_path / 'tls'}", *extra]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)


def ensure(api: CertsAPIServer, tmp_path: Path, service: str = "gpupack-webhook") -> certs.Bundle:
    """The same job as the CLI, in-process (each CLI start pays seconds of imports)."""
    from kubernetes.client import ApiClient, Configuration

    kube = certs.Kube(ApiClient(Configuration(host=api.url)))
    return certs.ensure(kube, NS, "gpupack-webhook-tls", service, ["gpupack"], [], tmp_path / "tls",
                        3650, 365, dt.timedelta(days=30))


def secret_bundle(api: CertsAPIServer) -> certs.Bundle:
    s = api.get("secrets", NS, "gpupack-webhook-tls")
    assert s is not None and s["type"] == "kubernetes.io/tls"
    d = s["data"]
    return certs.Bundle(*(base64.b64decode(d[k]) for k in ("ca.crt", "ca.key", "tls.crt", "tls.key")))


def ca_bundles(api: CertsAPIServer) -> list[bytes]:
    cfg = api.get("mutating", "", "gpupack")
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in cfg["webhooks"]]


def test_first_run_creates_secret_injects_ca_and_writes_files(api, tmp_path):
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    b = secret_bundle(api)
    assert ca_bundles(api) == [b.ca_cert, b.ca_cert]
    # the files the webhook server loads are the Secret's serving pair
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == b.cert
    assert (tmp_path / "tls" / "tls.key").read_bytes() == b.key
    assert (tmp_path / "tls" / "tls.key").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate(b.cert)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(b.ca_cert))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gpupack-webhook.gpupack-system.svc" in sans.get_values_for_type(x509.DNSName)
    assert certs.needs_new_cert(b, certs.dns_names("gpupack-webhook", NS), dt.timedelta(days=30)) == ""


def test_second_run_changes_nothing(api, tmp_path):
    ensure(api, tmp_path)
    writes = list(api.writes)
    rv = api.get("secrets", NS, "gpupack-webhook-tls")["metadata"]["resourceVersion"]
    ensure(api, tmp_path)
    assert api.writes == writes
    assert api.get("secrets", NS, "gpupack-webhook-tls")["metadata"]["resourceVersion"] == rv


def test_new_service_name_reissues_from_same_ca_and_keeps_ca_bundle(api, tmp_path):
    ensure(api, tmp_path)
    before = secret_bundle(api)
    ensure(api, tmp_path, service="gpupack-webhook-v2")
    after = secret_bundle(api)
    assert after.ca_cert == before.ca_cert and after.cert != before.cert
    assert ca_bundles(api) == [before.ca_cert, before.ca_cert]
    sans = x509.load_pem_x509_certificate(after.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "gpupack-webhook-v2.gpupack-system.svc" in sans.value.get_values_for_type(x509.DNSName)


def test_corrupt_secret_gets_a_new_ca_and_the_webhook_follows(api, tmp_path):
    ensure(api, tmp_path)
    old = secret_bundle(api)
    s = api.get("secrets", NS, "gpupack-webhook-tls")
    s["data"]["ca.crt"] = base64.b64encode(b"not a certificate").decode()
    api.put("secrets", NS, s)
    ensure(api, tmp_path)
    new = secret_bundle(api)
    assert new.ca_cert != old.ca_cert
    assert ca_bundles(api) == [new.ca_cert, new.ca_cert]


def test_losing_the_create_race_uses_the_winners_secret(api, tmp_path):
    winner, _ = certs.plan(None, certs.dns_names("gpupack-webhook", NS), 3650, 365, dt.timedelta(days=30))

    def other_replica() -> None:
        api.put("secrets", NS, {"metadata": {"name": "gpupack-webhook-tls"}, "type": "kubernetes.io/tls",
                                "data": winner.secret_data()})

    api.before_secret_create = other_replica
    assert ensure(api, tmp_path) == winner
    assert secret_bundle(api) == winner
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == winner.cert
    assert ca_bundles(api) == [winner.ca_cert, winner.ca_cert]


def test_missing_webhook_configuration_is_a_one_line_error(api, tmp_path):
    r = run(tmp_path, "--mutating-webhook-configuration=absent")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "MutatingWebhookConfiguration absent: 404" in r.stderr


def test_unreachable_api_server_is_a_one_line_error(tmp_path):
    (tmp_path / "kubeconfig").write_text(kubeconfig_for("http://127.0.0.1:1"))  # nothing listens on port 1
    r = run(tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_serving_cert_near_expiry_is_renewed_with_the_same_ca():
    names = certs.dns_names("gpupack-webhook", NS)
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
    names = certs.dns_names("gpupack-webhook", NS)
    a, _ = certs.plan(None, names, 3650, 365, dt.timedelta(days=30))
    b, _ = certs.plan(None, names, 3650, 365, dt.timedelta(days=30))
    mixed = certs.Bundle(a.ca_cert, a.ca_key, a.cert, b.key)
    assert "does not match" in certs.needs_new_cert(mixed, names, dt.timedelta(days=30))
    foreign = certs.Bundle(a.ca_cert, a.ca_key, b.cert, b.key)
    assert "not signed by the CA" in certs.needs_new_cert(foreign, names, dt.timedelta(days=30))
    serialization.load_pem_private_key(a.key, password=None)  # PEM PKCS8, loadable by the server
