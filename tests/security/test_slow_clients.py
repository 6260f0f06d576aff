"""Issue 31 item 2: a few connections cannot stall gpupack's servers. Idle connections (connected,
nothing sent) and trickling ones (a byte at a time) are opened to every listener of a real
extender — the webhook (TLS, registered in the real API server), the metrics port and the verbs
(loopback, kube-scheduler's) — 8, 100 and 1,000 to each; meanwhile a GPU pod is admitted through
the webhook by the API server, a `/filter` is answered and a scrape is served, none more than 1 s
slower than the same calls without the crowd (measured first, in the same run: this machine's
CPUs are shared)."""

from __future__ import annotations

import time

import pytest
import requests
from slow_clients import Crowd, crowd_fixture  # noqa: F401  (the `crowd` fixture)
from test_webhook_apiserver import Webhook, c, webhook  # noqa: F401  (the module's fixture)

from gpupack.contract import SCHEDULER_NAME

DELAY_S = 1.0

HEAD = b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


@pytest.mark.parametrize("n", [8, 100, 1000])
@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
def test_idle_and_trickling_connections_delay_nothing(webhook: Webhook, crowd: list[Crowd], n: int,  # noqa: F811
                                                      trickle: bool) -> None:  # fmt: skip
    ext = webhook.ext
    metrics_port = int(ext.proc.args[ext.proc.args.index("--metrics-port") + 1])
    webhook_port = int(webhook.url.rsplit(":", 1)[1])
    ns = webhook.namespace(f"slow-{n}-{int(trickle)}")
    pod = {"metadata": {"name": "p", "namespace": ns, "uid": "u"}, "spec": {"schedulerName": SCHEDULER_NAME,
           "containers": [c("a", {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "1024"})]}}  # fmt: skip

    def calls(tag: str) -> tuple[float, float, float]:
        """The slowest of three of each: an admission, a verb, a scrape."""
        times = [(_timed(lambda i=i: webhook.create(ns, f"gpu-{tag}-{i}", [c("a", {"gpupack.io/gpu-mem": "1024"})])),
                  _timed(lambda: requests.post(ext.url + "/filter", json={"Pod": pod, "NodeNames": [f"wh-{webhook.sfx}"]},
                                               timeout=10).raise_for_status()),
                  _timed(lambda: requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).raise_for_status()))
                 for i in range(3)]  # fmt: skip
        return tuple(max(t[k] for t in times) for k in range(3))  # type: ignore[return-value]

    base = calls("base")  # this machine's own pace, measured in the same run
    crowd.append(Crowd([webhook_port, metrics_port, ext.port], n, trickle, HEAD))
    # The crowd taken in: one probe through each port is answered only after the server accepted
    # (and set up TLS state for) every connection before it. The test is about a crowd that
    # stays, not about the burst that opened it.
    requests.get(webhook.url + "/healthz", verify=str(webhook.ca), timeout=30).raise_for_status()
    requests.get(f"http://127.0.0.1:{metrics_port}/healthz", timeout=30).raise_for_status()
    requests.get(ext.url + "/healthz", timeout=30).raise_for_status()
    loaded = calls("crowd")
    delays = [round(b - a, 3) for a, b in zip(base, loaded, strict=True)]
    print(f"n={n} trickle={trickle} base={base} crowd={loaded} delays={delays}")
    assert max(delays) < DELAY_S, (base, loaded)
