import base64
import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
import requests
from ext_helpers import container, node_obj, pod_obj
from processes import REPO, free_port

from extender.webhook import WebhookConfig, mutate, review, validate
from extender.wire import WireError


def test_mutate_adds_gpu_count_and_scheduler_name():
    pod = pod_obj("p", [container("a", None, 1000), container("b", 2, 1000), {"name": "c", "image": "i"}],
                  init=[container("i", None, None, 20)])
    pod["spec"]["schedulerName"] = "default-scheduler"
    ops = mutate(pod, WebhookConfig(set_scheduler_name=True))
    assert {"op": "add", "path": "/spec/containers/0/resources/limits/gpupack.io~1gpu", "value": "1"} in ops
    assert {"op": "add", "path": "/spec/initContainers/0/resources/limits/gpupack.io~1gpu", "value": "1"} in ops
    assert not any("/containers/1/" in o["path"] or "/containers/2/" in o["path"] for o in ops)
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "gpupack-scheduler"} in ops
    assert mutate(pod_obj("q", [{"name": "c", "image": "i"}]), WebhookConfig(set_scheduler_name=True)) == []


def test_mutate_creates_missing_limits():
    pod = pod_obj("p", [{"name": "a", "image": "i", "resources": {"requests": {"gpupack.io/gpu-mem": "10"}}}])
    ops = mutate(pod, WebhookConfig())
    assert [o["path"] for o in ops] == ["/spec/containers/0/resources/limits",
                                         "/spec/containers/0/resources/limits/gpupack.io~1gpu"]


@pytest.mark.parametrize(
    "c,needle",
    [
        ({"name": "a", "resources": {"limits": {"gpupack.io/gpu-mem": "100"}, "requests": {"gpupack.io/gpu-mem": "200"}}},
         "requests must equal limits for gpupack.io/gpu-mem; requests=200 limits=100"),
        (container("a", 1, 100, 0), "gpu-sm must be a whole percent in 1..100; got 0"),
        (container("a", 1, 100, 101), "got 101"),
        (container("a", 1, 0), "gpu-mem must be a positive number of MiB; got 0"),
        (container("a", 1, 90000), "at most the largest GPU in the cluster (81559 MiB); got 90000"),
        (container("a", 1, "1.5"), "gpu-mem must be a positive number of MiB"),
    ],
)
def test_validate_names_rule_and_value(c, needle):
    errs = validate(pod_obj("p", [c]), 81559)
    assert any(needle in e for e in errs), errs


def test_validate_class_label_and_accepts_good_pods():
    assert any("must be one of online, offline; got 'batch'" in e
               for e in validate(pod_obj("p", [container("a", 1, 100)], cls="batch"), 0))
    assert validate(pod_obj("p", [container("a", 1, 100, 50)], cls="offline"), 81559) == []
    assert validate(pod_obj("p", [{"name": "a", "image": "i"}], cls="weird"), 0) == []  # not ours


def test_review_shapes():
    pod = pod_obj("p", [container("a", None, 100)])
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod}}
    out = review(body, "mutate", WebhookConfig(), 0)["response"]
    assert out["uid"] == "u1" and out["allowed"] and out["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(out["patch"]))[0]["value"] == "1"
    bad = review(body | {"request": body["request"] | {"object": pod_obj("p", [container("a", 1, 999999)])}},
                 "validate", WebhookConfig(), 1000)["response"]
    assert not bad["allowed"] and "largest GPU" in bad["status"]["message"]
    with pytest.raises(WireError):
        review({"request": {"uid": 3}}, "validate", WebhookConfig(), 0)


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupack-webhook")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    c, k = tmp_path / "tls.crt", tmp_path / "tls.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


def test_webhook_over_tls_next_to_the_extender(kubeapi, kubeconfig, tmp_path):
    kubeapi.create("nodes", node_obj("n1", 1, mem=24576, model="L4"))
    cert, key = _self_signed(tmp_path)
    port, wport = free_port(), free_port()
    log = (tmp_path / "x.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupack", "extender", "--host", "127.0.0.1", "--port", str(port),
         "--webhook-port", str(wport), "--tls-cert", str(cert), "--tls-key", str(key), "--kubeconfig",
         str(kubeconfig), "--set-scheduler-name", "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        url = f"https://localhost:{wport}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/readyz", verify=str(cert), timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.1)
        review_body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                                   "object": pod_obj("p", [container("a", 1, 30000)])}}
        review_body["request"]["object"]["spec"]["schedulerName"] = "default-scheduler"
        r = requests.post(url + "/validate", json=review_body, verify=str(cert), timeout=5)
        resp = r.json()["response"]
        assert not resp["allowed"]
        assert "largest GPU in the cluster (24576 MiB); got 30000" in resp["status"]["message"]
        r = requests.post(url + "/mutate", json=review_body, verify=str(cert), timeout=5)
        ops = json.loads(base64.b64decode(r.json()["response"]["patch"]))
        assert {"op": "replace", "path": "/spec/schedulerName", "value": "gpupack-scheduler"} in ops
        assert requests.post(url + "/validate", data=b"{", verify=str(cert), timeout=5).status_code == 400
        with pytest.raises(requests.RequestException):
            requests.get(f"http://127.0.0.1:{wport}/healthz", timeout=2).raise_for_status()
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(15)
