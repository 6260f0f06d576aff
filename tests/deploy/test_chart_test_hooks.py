"""The `helm test` pods' checks, run: the chart's own scripts (rendered by the real Helm) against a
local server, since no kubelet runs the pods in these tests.

The webhook check passes against a server presenting a certificate gpupack.certs issued for the
webhook Service's name, and fails against one another CA signed or one issued for another name.
Only what cannot run here is changed in the script: the Service's address (resolved to 127.0.0.1),
its port, the CA file's path and the retries.
"""

from __future__ import annotations

import http.server
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from chart_objects import (
    helm_assets,  # noqa: F401 (a fixture, used by pytestmark)
    render,
)

from gpupack import certs

pytestmark = pytest.mark.usefixtures("helm_assets")
NS = "ops"


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok" if self.path == "/readyz" else b"no"
        self.send_response(200 if self.path == "/readyz" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(tls: tuple[Path, Path] | None) -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(tls[0]), str(tls[1]))
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, str]:
    objs = render("helm", "--kube-version", "1.32.4", home=tmp_path_factory.mktemp("helm"), namespace=NS)
    return {
        o["metadata"]["name"]: o["spec"]["containers"][0]["args"][0]
        for o in objs
        if o["kind"] == "Pod" and (o["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"
    }


def _run(script: str, host: str, port: int, ca: Path | None = None) -> subprocess.CompletedProcess[str]:
    # the Service's DNS name resolves to this machine's server; everything else is the chart's
    resolve = (
        "import socket\n_gai = socket.getaddrinfo\n"
        f"socket.getaddrinfo = lambda h, *a, **k: _gai('127.0.0.1' if h == {host!r} else h, *a, **k)\n"
    )
    script = script.replace(f"{host}:{443 if ca else 9090}/", f"{host}:{port}/")
    assert "range(30)" in script and "time.sleep(2)" in script  # one try here, at once
    script = script.replace("range(30)", "range(1)").replace("time.sleep(2)", "time.sleep(0)")
    if ca is not None:
        script = script.replace('"/ca/ca.crt"', repr(str(ca)))
    return subprocess.run(
        [sys.executable, "-c", resolve + script], capture_output=True, text=True, timeout=60
    )


def _bundle(tmp: Path, names: list[str]) -> tuple[Path, Path, Path]:
    """(CA file, serving cert, key) as gpupack.certs makes them."""
    ca_cert, ca_key = certs.new_ca(days=10)
    cert, key = certs.issue(ca_cert, ca_key, names, days=5)
    tmp.mkdir(parents=True, exist_ok=True)
    for name, data in (("ca.crt", ca_cert), ("tls.crt", cert), ("tls.key", key)):
        (tmp / name).write_bytes(data)
    return tmp / "ca.crt", tmp / "tls.crt", tmp / "tls.key"


def test_the_extender_check_passes_when_the_extender_answers(scripts):
    host = f"gpupack-scheduler-metrics.{NS}.svc"
    for port in _serve(None):
        r = _run(scripts["gpupack-test-extender"], host, port)
        assert r.returncode == 0 and " 200 ok" in r.stdout, r.stdout + r.stderr
    # nobody listening: the check fails
    r = _run(scripts["gpupack-test-extender"], host, port)
    assert r.returncode == 1, r.stdout + r.stderr


def test_the_webhook_check_trusts_the_webhook_ca_for_the_services_name_only(scripts, tmp_path):
    host = f"gpupack-webhook.{NS}.svc"
    ca, cert, key = _bundle(tmp_path / "ours", certs.dns_names("gpupack-webhook", NS))
    for port in _serve((cert, key)):
        r = _run(scripts["gpupack-test-webhook"], host, port, ca)
        assert r.returncode == 0 and " 200 ok" in r.stdout, r.stdout + r.stderr
    # a certificate another CA signed, and one for another Service, are refused
    other_ca, _, _ = _bundle(tmp_path / "other", certs.dns_names("gpupack-webhook", NS))
    _, wrong_cert, wrong_key = _bundle(tmp_path / "wrong", certs.dns_names("someone-else", NS))
    for tls, trust in (((cert, key), other_ca), ((wrong_cert, wrong_key), ca)):
        for port in _serve(tls):
            r = _run(scripts["gpupack-test-webhook"], host, port, trust)
            assert r.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in r.stdout, r.stdout + r.stderr
