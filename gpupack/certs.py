"""Admission-webhook certificates without cert-manager.

`python -m gpupack.certs` runs as an init container of the scheduler pod. It makes sure that

1. the Secret (type kubernetes.io/tls) holds a self-signed CA and a serving certificate for the
   webhook Service's DNS names that is valid for a while yet: an existing pair is reused; a
   serving certificate near expiry (or for other names) is re-issued from the SAME CA, so
   replicas still running with the old certificate stay trusted; a missing or unreadable Secret
   gets a new CA;
2. every webhook of the named Mutating/ValidatingWebhookConfigurations trusts that CA
   (`clientConfig.caBundle`);
3. the serving certificate and key are written to --out-dir for the webhook server to load.

Two replicas starting at once both try to create the Secret; the loser gets 409 and uses the
winner's. Updates carry the resourceVersion they read, so a concurrent writer is never
overwritten silently.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpupack import logs

PROG = "gpupack.certs"
log = logging.getLogger(PROG)
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"


class CertError(Exception):
    """A problem the operator has to fix; the message says what."""


@dataclass(frozen=True)
class Bundle:
    ca_cert: bytes  # PEM
    ca_key: bytes
    cert: bytes
    key: bytes

    def secret_data(self) -> dict[str, str]:
        raw = {CA_CERT: self.ca_cert, CA_KEY: self.ca_key, TLS_CERT: self.cert, TLS_KEY: self.key}
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}


def dns_names(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_ca(days: int, now: dt.datetime | None = None) -> tuple[bytes, bytes]:
    now = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupack-webhook-ca")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(
    ca_cert_pem: bytes, ca_key_pem: bytes, names: list[str], days: int, now: dt.datetime | None = None
) -> tuple[bytes, bytes]:
    """A serving certificate for `names`, signed by the CA."""
    now = now or _now()
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        # never outlive the CA that vouches for it
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def needs_new_ca(
    ca_cert_pem: bytes, ca_key_pem: bytes, renew_before: dt.timedelta, now: dt.datetime | None = None
) -> str:
    """Why the CA cannot be kept ("" when it can)."""
    now = now or _now()
    try:
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
        key = serialization.load_pem_private_key(ca_key_pem, password=None)
    except (ValueError, TypeError) as e:
        return f"CA unreadable ({e})"
    if key.public_key().public_bytes(  # type: ignore[union-attr]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != ca.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        return "CA key does not match CA certificate"
    if ca.not_valid_after_utc - now < renew_before:
        return f"CA expires {ca.not_valid_after_utc.isoformat()}"
    return ""


def needs_new_cert(
    bundle: Bundle, names: list[str], renew_before: dt.timedelta, now: dt.datetime | None = None
) -> str:
    """Why the serving certificate cannot be kept ("" when it can)."""
    now = now or _now()
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert)
        key = serialization.load_pem_private_key(bundle.key, password=None)
        ca = x509.load_pem_x509_certificate(bundle.ca_cert)
    except (ValueError, TypeError) as e:
        return f"serving certificate unreadable ({e})"
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != cert.public_key().public_bytes(  # type: ignore[union-attr]
        serialization.Encoding.DER, spki
    ):
        return "serving key does not match serving certificate"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as e:  # InvalidSignature is not a ValueError
        return f"serving certificate not signed by the CA ({type(e).__name__})"
    try:
        have = set(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName
            )
        )
    except x509.ExtensionNotFound:
        have = set()
    missing = [n for n in names if n not in have]
    if missing:
        return f"serving certificate lacks names {missing}"
    if cert.not_valid_after_utc - now < renew_before:
        return f"serving certificate expires {cert.not_valid_after_utc.isoformat()}"
    return ""


def _decode_secret(secret: dict[str, Any]) -> Bundle | None:
    data = secret.get("data") or {}
    try:
        return Bundle(
            *(base64.b64decode(data[k], validate=True) for k in (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY))
        )
    except (KeyError, ValueError, TypeError):
        return None


def plan(
    existing: Bundle | None,
    names: list[str],
    ca_days: int,
    cert_days: int,
    renew_before: dt.timedelta,
    now: dt.datetime | None = None,
) -> tuple[Bundle, str]:
    """The bundle to store and why it changed ("" = keep `existing` as it is)."""
    now = now or _now()
    if existing is not None:
        why_ca = needs_new_ca(existing.ca_cert, existing.ca_key, renew_before, now)
        if not why_ca:
            why = needs_new_cert(existing, names, renew_before, now)
            if not why:
                return existing, ""
            cert, key = issue(existing.ca_cert, existing.ca_key, names, cert_days, now)
            return Bundle(existing.ca_cert, existing.ca_key, cert, key), why
    else:
        why_ca = "no certificate stored yet"
    ca_cert, ca_key = new_ca(ca_days, now)
    cert, key = issue(ca_cert, ca_key, names, cert_days, now)
    return Bundle(ca_cert, ca_key, cert, key), why_ca


# --- Kubernetes side ----------------------------------------------------------------------------
class Kube:
    """Raw JSON requests over an ApiClient (gpupack.kubeclient.request_json): an init container that
    makes four requests has no use for the typed API classes."""

    def __init__(self, api_client: Any) -> None:
        self.c = api_client

    def request(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        from gpupack.kubeclient import request_json

        try:
            return request_json(self.c, method, path, body, timeout_s=30)
        except ValueError as e:
            raise CertError(str(e)) from e


def ensure_secret(
    kube: Kube,
    namespace: str,
    name: str,
    names: list[str],
    ca_days: int,
    cert_days: int,
    renew_before: dt.timedelta,
    report: Callable[[str], Any] = log.info,
) -> Bundle:
    from kubernetes.client.exceptions import ApiException

    path = f"/api/v1/namespaces/{namespace}/secrets"
    for _attempt in range(5):
        try:
            secret: dict[str, Any] | None = kube.request("GET", f"{path}/{name}")
        except ApiException as e:
            if e.status != 404:
                raise CertError(f"cannot read Secret {namespace}/{name}: {e.status} {e.reason}") from e
            secret = None
        existing = _decode_secret(secret) if secret is not None else None
        bundle, why = plan(existing, names, ca_days, cert_days, renew_before)
        if not why:
            return bundle
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "gpupack"},
            },
            "type": "kubernetes.io/tls",
            "data": bundle.secret_data(),
        }
        try:
            if secret is None:
                kube.request("POST", path, body)
            else:
                # carry what we read: a concurrent writer makes this a 409, never a silent overwrite
                body["metadata"]["resourceVersion"] = secret["metadata"]["resourceVersion"]
                kube.request("PUT", f"{path}/{name}", body)
        except ApiException as e:
            if e.status == 409:  # another replica wrote first: use what it wrote
                continue
            raise CertError(f"cannot write Secret {namespace}/{name}: {e.status} {e.reason}") from e
        report(f"wrote Secret {namespace}/{name}: {why}")
        return bundle
    raise CertError(f"Secret {namespace}/{name} kept changing under us; giving up after 5 tries")


def inject_ca_bundle(
    kube: Kube, kind: str, name: str, ca_pem: bytes, report: Callable[[str], Any] = log.info
) -> bool:
    """Set caBundle on every webhook of one configuration; True when something changed."""
    from kubernetes.client.exceptions import ApiException

    what = f"{kind.capitalize()}WebhookConfiguration {name}"
    path = f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{name}"
    want = base64.b64encode(ca_pem).decode()
    for _attempt in range(5):
        try:
            cfg = kube.request("GET", path)
        except ApiException as e:
            raise CertError(f"cannot read {what}: {e.status} {e.reason}") from e
        webhooks = cfg.get("webhooks") or []
        if not webhooks:
            raise CertError(f"{what} has no webhooks")
        stale = [w for w in webhooks if (w.get("clientConfig") or {}).get("caBundle") != want]
        if not stale:
            return False
        for w in stale:
            w.setdefault("clientConfig", {})["caBundle"] = want
        try:
            kube.request("PUT", path, cfg)  # carries the resourceVersion we read
        except ApiException as e:
            if e.status == 409:
                continue
            raise CertError(f"cannot update {what}: {e.status} {e.reason}") from e
        report(f"set caBundle on {what} ({len(stale)} webhook(s))")
        return True
    raise CertError(f"{what} kept changing; giving up after 5 tries")


def ensure(
    kube: Kube,
    namespace: str,
    secret: str,
    service: str,
    mutating: list[str],
    validating: list[str],
    out_dir: Path | None,
    ca_days: int,
    cert_days: int,
    renew_before: dt.timedelta,
) -> Bundle:
    """The whole job: Secret, caBundles, files. Raises CertError or ApiException."""
    bundle = ensure_secret(
        kube, namespace, secret, dns_names(service, namespace), ca_days, cert_days, renew_before
    )
    for name in mutating:
        inject_ca_bundle(kube, "mutating", name, bundle.ca_cert)
    for name in validating:
        inject_ca_bundle(kube, "validating", name, bundle.ca_cert)
    if out_dir is not None:
        write_files(bundle, out_dir)
    return bundle


def write_files(bundle: Bundle, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for fname, content, mode in (
        (TLS_CERT, bundle.cert, 0o644),
        (TLS_KEY, bundle.key, 0o600),
        (CA_CERT, bundle.ca_cert, 0o644),
    ):
        tmp = out_dir / f".{fname}.tmp"
        tmp.write_bytes(content)
        tmp.chmod(mode)
        tmp.replace(out_dir / fname)


def _default_namespace() -> str:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip()
    except OSError:
        return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Create/renew the admission webhook's certificates "
        "and inject the CA into the webhook configurations.",
    )
    p.add_argument(
        "--namespace",
        default=_default_namespace(),
        help="namespace of Secret and Service "
        "(default $POD_NAMESPACE, then the pod's service account namespace)",
    )
    p.add_argument("--secret", default="gpupack-webhook-tls", help="Secret holding CA and serving cert")
    p.add_argument(
        "--service", default="gpupack-webhook", help="Service the API server calls the webhook through"
    )
    p.add_argument(
        "--mutating-webhook-configuration",
        action="append",
        default=[],
        metavar="NAME",
        help="inject the CA into this MutatingWebhookConfiguration (repeatable)",
    )
    p.add_argument(
        "--validating-webhook-configuration",
        action="append",
        default=[],
        metavar="NAME",
        help="inject the CA into this ValidatingWebhookConfiguration (repeatable)",
    )
    p.add_argument("--out-dir", default="", help="write tls.crt, tls.key, ca.crt here")
    p.add_argument("--ca-days", type=int, default=3650, help="validity of a new CA (days)")
    p.add_argument("--cert-days", type=int, default=365, help="validity of a new serving certificate (days)")
    p.add_argument(
        "--renew-before-days",
        type=int,
        default=30,
        help="re-issue a certificate that expires within this many days",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    logs.add_log_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(args)
    if not args.namespace:
        print(f"{PROG}: --namespace is required outside a pod", file=sys.stderr)
        return 2
    if not (0 < args.renew_before_days < args.cert_days <= args.ca_days):
        print(f"{PROG}: need 0 < --renew-before-days < --cert-days <= --ca-days", file=sys.stderr)
        return 2
    import urllib3
    from kubernetes.client.exceptions import ApiException

    from gpupack.kubeclient import KubeConfigError, api_client

    try:
        kube = Kube(api_client(args.kubeconfig))
    except KubeConfigError as e:
        print(f"{PROG}: no Kubernetes credentials: {e}", file=sys.stderr)
        return 1
    try:
        ensure(
            kube,
            args.namespace,
            args.secret,
            args.service,
            args.mutating_webhook_configuration,
            args.validating_webhook_configuration,
            Path(args.out_dir) if args.out_dir else None,
            args.ca_days,
            args.cert_days,
            dt.timedelta(days=args.renew_before_days),
        )
    except CertError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except (OSError, urllib3.exceptions.HTTPError) as e:  # API server unreachable, disk full
        print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except ApiException as e:
        print(f"{PROG}: Kubernetes API error {e.status} {e.reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
