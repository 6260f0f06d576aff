"""Issue 31 item 2, the device plugin's port: its metrics/health listener (open to the network for
Prometheus and the kubelet's probes) is served by gpupack/guarded.py with a budget of its own. The
real plugin process runs on a node of the real control plane (its /metrics lists the node's pods);
8, 100 and 1,000 idle connections (connected, nothing sent) or trickling ones (a byte of a request
head a second) are opened to the port, and a scrape is served no more than 1 s slower than the same
scrape without the crowd (measured first, in the same run: this machine's CPUs are shared)."""

from __future__ import annotations

import time

import pytest
import realk8s
import requests
from dp_node import DP
from slow_clients import Crowd, crowd_fixture  # noqa: F401  (the `crowd` fixture)

DELAY_S = 1.0

HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n"


def _start(dp: DP) -> str:
    port = realk8s.free_port()
    dp.start_plugin(None, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(url + "/healthz", timeout=2).ok
        except requests.RequestException:
            return False

    realk8s.until(up, 60, f"the plugin's metrics port {port}\n{dp.plugin_log()}")
    return url


def _scrape(url: str) -> float:
    """The slowest of three scrapes, each on a new connection (as Prometheus after a restart)."""
    worst = 0.0
    for _ in range(3):
        t0 = time.monotonic()
        r = requests.get(url + "/metrics", timeout=10)
        r.raise_for_status()
        assert "gpupack_gpu_memory_bytes" in r.text
        worst = max(worst, time.monotonic() - t0)
    return worst


@pytest.mark.parametrize("n", [8, 100, 1000])
@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
def test_idle_and_trickling_connections_do_not_delay_a_scrape(
    dp: DP, crowd: list[Crowd], n: int, trickle: bool
) -> None:
    url = _start(dp)
    base = _scrape(url)
    crowd.append(Crowd([int(url.rsplit(":", 1)[1])], n, trickle, HEAD))
    # the crowd taken in: a probe is answered only after the server accepted every connection
    # before it (the test is about a crowd that stays, not the burst that opened it)
    requests.get(url + "/healthz", timeout=30).raise_for_status()
    loaded = _scrape(url)
    print(f"plugin metrics n={n} trickle={trickle} base={base:.3f}s crowd={loaded:.3f}s")
    assert loaded - base < DELAY_S, (base, loaded)
    assert dp.procs[-1].poll() is None, dp.plugin_log()


def test_past_the_budget_the_longest_waiting_connection_goes(dp: DP, crowd: list[Crowd]) -> None:
    """1,024 connections is the port's budget: a crowd past it (1,100) closes the connections
    that waited longest, and a scrape still gets through at once."""
    url = _start(dp)
    cr = Crowd([int(url.rsplit(":", 1)[1])], 1100, trickle=False)
    crowd.append(cr)
    requests.get(url + "/healthz", timeout=30).raise_for_status()

    def closed() -> int:
        n = 0
        for s in cr.socks[:200]:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    n += 1
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    assert realk8s.until(lambda: closed() > 0, 30, "the oldest idle connections closed")
    t0 = time.monotonic()
    requests.get(url + "/metrics", timeout=10).raise_for_status()
    assert time.monotonic() - t0 < DELAY_S
