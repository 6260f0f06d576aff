"""The admission webhook's app behind its real listener (extender/serve/guarded.py's webhook_limits, TLS),
in a process of its own, for tests that measure its memory (/proc/<pid>/status) and probes:
`python tests/webhook_listener.py CERT KEY` prints the port, then serves until SIGTERM. The cluster
view is marked synced with no nodes (the reviews need no cluster).

`python tests/webhook_listener.py probe PORT SECONDS` probes its /readyz as the kubelet does (a
new TLS connection each time, every 50 ms) from a process of its own, and prints the seconds each
probe took as one JSON list."""

from __future__ import annotations

import json
import socket
import ssl
import sys
import time

from extender.main import SWITCH_INTERVAL_S
from extender.serve.app import WEBHOOK_MAX_BODY, create_webhook_app, probes_of
from extender.serve.guarded import GuardedServer, tls_context, webhook_limits
from extender.serve.webhook import WebhookConfig
from extender.state.metrics import Metrics
from extender.state.view import ClusterView


def probe(port: int, seconds: float) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    took: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30)) as s:
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        if not answer.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"/readyz answered {answer[:100]!r}")
        took.append(time.monotonic() - t0)
        time.sleep(0.05)
    print(json.dumps(took), flush=True)


def main() -> None:
    if sys.argv[1] == "probe":
        probe(int(sys.argv[2]), float(sys.argv[3]))
        return
    cert, key = sys.argv[1], sys.argv[2]
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as extender/main.py's webhook role
    view = ClusterView()
    view.synced.set()
    app = create_webhook_app(
        WebhookConfig(set_scheduler_name=True, namespace="gpupack-system"), view, Metrics()
    )
    server = GuardedServer()
    lst = server.add(app, "127.0.0.1", 0, webhook_limits(WEBHOOK_MAX_BODY), tls_context(cert, key), "webhook",
                     probes=probes_of(app))  # fmt: skip
    print(lst.port, flush=True)
    server.run()


if __name__ == "__main__":
    main()
