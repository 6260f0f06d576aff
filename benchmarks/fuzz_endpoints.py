"""Fuzz the extender's verbs and the admission webhook over real HTTP(S) (issue 11, "Done when").

The real `gpupack extender` process (verbs on loopback HTTP, webhook on HTTPS with a certificate
from `gpupack certs`, metrics on a port of its own; all served by gpupack/guarded.py) runs against a real control plane (etcd + kube-apiserver
v1.28.7, tests/realk8s.py) with a few GPU nodes, and receives generated bodies: valid-looking
requests with one field mutated into a wrong type, a huge or exponent-laden number
(`gpu-mem: "1e300000"`), a long string, deep nesting, or plain garbage. Every answer must be
below 500 and no request may take 100 ms or more (the figures are printed, and with --json
written as one JSON object).

Then slow and idle clients (issue 31): for each count of --crowd, that many connections are
opened to each port (webhook, metrics, verbs, and the metrics/health port of a real `gpupack
device-plugin` process over the tests' fake NVML, on a node of its own) and left idle, or trickle a byte of a request head
a second; meanwhile a valid request to each port is timed (median and worst of --probes) and
compared with the same requests without the crowd, measured just before in the same run. No
port may be delayed by 1 s or more. Last, each HTTP/1.1 framing case RFC 9112 says to refuse
(FRAMING) is sent to every port, and must be answered 4xx/5xx and its connection closed.

    python benchmarks/fuzz_endpoints.py                 # 12,000 bodies, crowds of 8, 100, 1000
    python benchmarks/fuzz_endpoints.py --bodies 20000 --seed 7 --json
    python benchmarks/fuzz_endpoints.py --bodies 0 --crowd 8,100,1000,5000
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import json
import os
import random
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
import urllib3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import realk8s  # noqa: E402
from processes import ExtenderProcess, free_port  # noqa: E402

from gpupack import certs  # noqa: E402
from gpupack.contract import ANN_INVENTORY, GPUInfo, NodeInventory  # noqa: E402

ENDPOINTS = ("filter", "prioritize", "bind", "mutate", "validate")
NODES = [f"fuzz-{i}" for i in range(4)]


def _pod(rng: random.Random) -> dict[str, Any]:
    return {
        "metadata": {"name": f"p{rng.randrange(1000)}", "namespace": "default", "uid": "u-1",
                     "labels": {"gpupack.io/class": rng.choice(["online", "offline"])}, "annotations": {}},
        "spec": {"schedulerName": "gpupack-scheduler", "containers": [{"name": "a", "image": "x:1", "resources": {
            "limits": {"gpupack.io/gpu-mem": str(rng.choice([1024, 20480, 40000])), "gpupack.io/gpu-sm": "40"}}}]},
    }  # fmt: skip


def _valid(endpoint: str, rng: random.Random) -> dict[str, Any]:
    pod = _pod(rng)
    if endpoint in ("filter", "prioritize"):
        return {"Pod": pod, "NodeNames": rng.sample(NODES, rng.randint(1, len(NODES)))}
    if endpoint == "bind":
        # a pod that does not exist in the cluster: the answer must be an error, not a bind
        return {
            "PodName": pod["metadata"]["name"],
            "PodNamespace": "default",
            "PodUID": "u-1",
            "Node": NODES[0],
        }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": rng.choice(["CREATE", "UPDATE"]), "userInfo": {"username": "system:serviceaccount:t:app"},
        "object": pod, "oldObject": copy.deepcopy(pod)}}  # fmt: skip


# a placeholder replaced, after encoding, by nesting deeper than json.dumps (or a careless decoder)
# can go
DEEP = "\u0001deep\u0001"
DEEP_JSON = "[" * 20_000 + "1" + "]" * 20_000


def _nest(depth: int, leaf: Any) -> Any:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"a": out}
    return out


def _hostile(rng: random.Random) -> Any:
    return rng.choice([
        None, True, -1, 0, 2**63, -(2**63) - 1, 10**300, 1e308, -1e-308, 3.5, "", "x" * rng.choice([300, 70_000]),
        "1e300000", "9" * 5000, "1e-300000", "-0", "NaN", "Infinity", "1Ei", "999999999999Ei", "0x10", "1.5",
        "\u0000\ud7ff\uffff", "🚀" * 100, [], {}, [1, "2", None], {"a": {"b": {"c": [1]}}},
        _nest(rng.choice([50, 500]), 1), DEEP, list(range(rng.choice([10, 10_000]))),
        {f"k{i}": i for i in range(rng.choice([10, 5000]))},
    ])  # fmt: skip


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _mutated(endpoint: str, rng: random.Random) -> bytes:
    """One generated body: mostly a valid request with a field (or a new key) made hostile."""
    roll = rng.random()
    if roll < 0.05:  # not JSON at all, or JSON of the wrong shape
        return rng.choice([b"", b"{", b"\xff\xfe", b"[" * 100_000, b"null", b"1e999999", b'"str"', b"[]",
                           b'{"a":' * 100_000 + b"0" + b"}" * 100_000])  # fmt: skip
    body = _valid(endpoint, rng)
    for _ in range(rng.choice([1, 1, 2, 3])):
        paths = [p for p in _paths(body) if p]
        path = rng.choice(paths)
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.8:
            parent[path[-1]] = _hostile(rng)
        elif isinstance(parent, dict):
            parent[rng.choice(["gpupack.io/gpu", "gpupack.io/gpu-mem", "gpupack.io/gpu-sm", "x" * 1000])] = (
                _hostile(rng)
            )
    return json.dumps(body).replace(json.dumps(DEEP), DEEP_JSON).encode()


class Crowd:
    """`n` connections to each port: idle, or trickling a byte of a request head a second."""

    HEAD = b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"

    def __init__(self, ports: list[int], n: int, trickle: bool) -> None:
        self.socks = [socket.create_connection(("127.0.0.1", p), timeout=10) for p in ports for _ in range(n)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        if trickle:
            self.thread.start()

    def _trickle(self) -> None:
        i = 0
        while not self.stop.wait(1.0):
            for s in self.socks:
                with contextlib.suppress(OSError):  # closed by the server: right for so slow a client
                    s.send(self.HEAD[i % len(self.HEAD) : i % len(self.HEAD) + 1])
            i += 1

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        for s in self.socks:
            s.close()


def crowds(counts: list[int], probes: int, urls: dict[str, str], http: requests.Session,
           rng: random.Random) -> list[dict[str, Any]]:  # fmt: skip
    """Each port's request time with `n` idle or trickling connections to every port, against
    the same without them (measured just before)."""
    bodies = {"filter": json.dumps(_valid("filter", rng)).encode(),
              "validate": json.dumps(_valid("validate", rng)).encode()}  # fmt: skip

    timeout_s = 10.0

    def timed() -> dict[str, tuple[float, float]]:
        out = {}
        for e, url in urls.items():
            ms = []
            for _ in range(probes):
                t0 = time.perf_counter()
                try:
                    if e.endswith("metrics"):
                        r = http.get(url, timeout=timeout_s)
                    else:
                        r = http.post(url, data=bodies[e], headers={"Content-Type": "application/json"},
                                      timeout=timeout_s)  # fmt: skip
                    r.raise_for_status()
                except requests.RequestException:
                    pass  # counted at the time it took: a stall shows as its timeout
                ms.append((time.perf_counter() - t0) * 1000)
            out[e] = (round(statistics.median(ms), 2), round(max(ms), 2))
        return out

    ports = [int(u.split(":")[2].split("/")[0]) for u in urls.values()]
    results = []
    for n in counts:
        for trickle in (False, True):
            base = timed()
            crowd = Crowd(ports, n, trickle)
            try:
                time.sleep(0.5 + n / 1000)  # accepted (a benchmark: the test waits for the accept queue)
                loaded = timed()
            finally:
                crowd.close()
            results.append({"connections_per_port": n, "kind": "trickling" if trickle else "idle",
                            "ports": {e: {"base_p50_ms": base[e][0], "base_max_ms": base[e][1],
                                          "crowd_p50_ms": loaded[e][0], "crowd_max_ms": loaded[e][1],
                                          "delay_max_ms": round(loaded[e][1] - base[e][1], 1)} for e in urls}})  # fmt: skip
    return results


# HTTP/1.1 framing RFC 9112 says to refuse (or that a proxy in front could read differently): each is
# sent on a connection of its own to every port, and must be answered 4xx/5xx and closed
FRAMING = {
    "two Content-Length": b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\nhello",
    "Content_Length": b"POST /validate HTTP/1.1\r\nHost: x\r\nContent_Length: 5\r\n\r\nhello",
    "Transfer_Encoding": b"POST /validate HTTP/1.1\r\nHost: x\r\nTransfer_Encoding: chunked\r\n\r\n0\r\n\r\n",
    "obs-fold": b"POST /validate HTTP/1.1\r\nHost: x\r\nX-A: a\r\n Content-Length: 5\r\n\r\nhello",
    "space before colon": b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length : 5\r\n\r\nhello",
    "bare LF in a value": b"POST /validate HTTP/1.1\r\nHost: x\r\nX-A: a\nContent-Length: 5\r\n\r\nhello",
    "NUL in a value": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "CR in a value": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
    "no Host": b"GET /healthz HTTP/1.1\r\n\r\n",
    "Content-Length: \u00b2": "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
    "5,000-digit length": b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    "Content-Length and chunked": b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
}  # fmt: skip


def framing(ports: dict[str, tuple[int, bool]]) -> dict[str, dict[str, str]]:
    """Each FRAMING case to each port ((port, TLS)): the status it got, and "+open" where the
    connection was not closed within 5 s after it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out: dict[str, dict[str, str]] = {}
    for name, (port, tls) in ports.items():
        out[name] = {}
        for case, data in FRAMING.items():
            s: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=5)
            answer, closed = b"", False
            try:
                if tls:
                    s = ctx.wrap_socket(s)
                s.sendall(data)
                while chunk := s.recv(65536):
                    answer += chunk
                closed = True
            except TimeoutError:  # left open
                closed = False
            except OSError:  # reset after the answer
                closed = True
            finally:
                s.close()
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.") else "none"
            out[name][case] = status + ("" if closed else "+open")
    return out


def run(
    bodies: int, seed: int, workdir: Path, crowd_counts: list[int] | None = None, probes: int = 10
) -> dict[str, Any]:
    rng = random.Random(seed)
    cp = realk8s.ControlPlane(workdir / "k8s").start(controller_manager=False)
    ext = None
    plugin: subprocess.Popen[bytes] | None = None
    try:
        for n in NODES:
            inv = NodeInventory(gpus=tuple(GPUInfo(uuid=f"GPU-{n}-{i}", index=i, model="NVIDIA-H100", mem_mib=81559,
                                                   sm_count=132) for i in range(8)))  # fmt: skip
            cp.make_node(n, extended={"gpupack.io/gpu": "128"}, annotations={ANN_INVENTORY: inv.to_json()})
        kube = certs.Kube(cp.new_api_client())
        cp.ensure_namespace("gpupack-system")
        tls = workdir / "tls"
        with contextlib.redirect_stdout(sys.stderr):  # keep --json's stdout one JSON object
            certs.ensure(kube, "gpupack-system", "gpupack-webhook-tls", "localhost", [], [], tls, 3650, 365,
                         dt.timedelta(days=30))  # fmt: skip
        hook_port, metrics_port = free_port(), free_port()
        # the device plugin's port: the real plugin process, over the tests' fake NVML
        plugin_port = free_port()
        cp.make_node("fuzz-dp")
        plugin = _start_plugin(cp.write_kubeconfig(workdir / "kubeconfig-dp"), plugin_port, workdir)
        ext = ExtenderProcess(cp.write_kubeconfig(workdir / "kubeconfig"), workdir / "extender.log",
                              "--webhook-port", str(hook_port), "--metrics-port", str(metrics_port), "--tls-cert", str(tls / "tls.crt"),
                              "--tls-key", str(tls / "tls.key"), "--set-scheduler-name")  # fmt: skip
        ext.wait_ready(120)
        urls = {e: f"{ext.url}/{e}" for e in ("filter", "prioritize", "bind")}
        urls |= {e: f"https://localhost:{hook_port}/{e}" for e in ("mutate", "validate")}
        http = requests.Session()
        http.trust_env = False  # else $REQUESTS_CA_BUNDLE replaces the session's CA
        http.verify = str(tls / "ca.crt")
        deadline = time.monotonic() + 60
        while True:  # the webhook process comes up next to the verbs
            try:
                if http.get(f"https://localhost:{hook_port}/readyz", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"webhook not ready: {ext.tail()}")
            time.sleep(0.2)
        per: dict[str, dict[str, Any]] = {e: {"n": 0, "status": {}, "ms": []} for e in ENDPOINTS}
        worst: list[tuple[float, str, int, bytes]] = []
        for i in range(bodies):
            e = ENDPOINTS[i % len(ENDPOINTS)]
            data = _mutated(e, rng)
            t0 = time.perf_counter()
            r = http.post(urls[e], data=data, headers={"Content-Type": "application/json"}, timeout=30)
            ms = (time.perf_counter() - t0) * 1000
            st = per[e]
            st["n"] += 1
            st["status"][r.status_code] = st["status"].get(r.status_code, 0) + 1
            st["ms"].append(ms)
            if r.status_code >= 500 or ms >= 100:
                # the verbs report their own handling time: tells a slow answer from a busy machine
                timing = r.headers.get("Server-Timing", "")
                server = float(timing.rsplit("dur=", 1)[1]) if "dur=" in timing else None
                worst.append((ms, e, r.status_code, len(data), data[:200], server))
        out: dict[str, Any] = {"bodies": bodies, "seed": seed, "endpoints": {}}
        for e, st in per.items():
            ms = sorted(st["ms"])
            out["endpoints"][e] = {
                "requests": st["n"], "status": {str(k): v for k, v in sorted(st["status"].items())},
                "p50_ms": round(statistics.median(ms), 2) if ms else 0.0,
                "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2) if ms else 0.0, "max_ms": round(ms[-1], 2) if ms else 0.0,
            }  # fmt: skip
        out["answers_5xx"] = sum(v for st in per.values() for k, v in st["status"].items() if k >= 500)
        out["slower_than_100ms"] = sum(1 for st in per.values() for m in st["ms"] if m >= 100)
        out["max_ms"] = max((v["max_ms"] for v in out["endpoints"].values()), default=0.0)
        _wait_ok(http, f"http://127.0.0.1:{plugin_port}/healthz", workdir / "device-plugin.log")
        out["framing"] = framing({"verbs": (ext.port, False), "webhook": (hook_port, True),
                                  "metrics": (metrics_port, False), "plugin-metrics": (plugin_port, False)})  # fmt: skip
        out["framing_accepted"] = sum(1 for port in out["framing"].values() for v in port.values()
                                      if v[:1] not in ("4", "5") or v.endswith("+open"))  # fmt: skip
        out["crowds"] = crowds(crowd_counts or [], probes, {
            "validate": urls["validate"], "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "filter": urls["filter"], "plugin-metrics": f"http://127.0.0.1:{plugin_port}/metrics"}, http, rng)  # fmt: skip
        out["delayed_1s"] = sum(1 for c in out["crowds"] for v in c["ports"].values()
                                if v["delay_max_ms"] >= 1000)  # fmt: skip
        out["offenders"] = [{"ms": round(m, 1), "server_ms": sv, "endpoint": e, "status": s, "bytes": n,
                             "body": b.decode("utf-8", "replace")}
                            for m, e, s, n, b, sv in sorted(worst, key=lambda w: w[0], reverse=True)[:10]]  # fmt: skip
        return out
    finally:
        if ext is not None:
            ext.stop()
        if plugin is not None:
            plugin.terminate()
            plugin.wait(15)
        cp.stop()


def _start_plugin(kubeconfig: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    kubelet_dir = tempfile.mkdtemp(prefix="fz")  # unix socket paths are short
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "deviceplugin"), str(ROOT)]))
    return subprocess.Popen(
        [sys.executable, "-m", "gpupack", "device-plugin", "--node-name", "fuzz-dp", "--kubelet-dir", kubelet_dir,
         "--kubeconfig", str(kubeconfig), "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
         "--nvml-module", "fake_nvml", "--nvml-config", json.dumps({"gpus": 8})],
        cwd=ROOT, env=env, stdout=(workdir / "device-plugin.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait_ok(http: requests.Session, url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if http.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bodies", type=int, default=12_000, help="generated request bodies (default 12000)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument(
        "--crowd",
        default="8,100,1000",
        help="connections per port, idle then trickling, comma-separated ('' for none; default 8,100,1000)",
    )
    p.add_argument("--probes", type=int, default=10, help="requests timed per port, with and without a crowd")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    urllib3.disable_warnings()
    counts = [int(x) for x in args.crowd.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="gpupack-fuzz-") as tmp:
        out = run(args.bodies, args.seed, Path(tmp), counts, args.probes)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['bodies']} bodies (seed {out['seed']}): {out['answers_5xx']} answers >= 500, "
              f"{out['slower_than_100ms']} slower than 100 ms, slowest {out['max_ms']} ms")  # fmt: skip
        for e, st in out["endpoints"].items():
            print(f"  {e:10s} {st['requests']:6d} requests  p50 {st['p50_ms']:6.2f} ms  p99 {st['p99_ms']:6.2f} ms  "
                  f"max {st['max_ms']:7.2f} ms  status {st['status']}")  # fmt: skip
        for o in out["offenders"]:
            print(f"  offender: {o}")
        for c in out["crowds"]:
            print(f"  {c['connections_per_port']:5d} {c['kind']:9s} connections to each port: " + "  ".join(
                f"{e} {v['base_max_ms']:.1f} -> {v['crowd_max_ms']:.1f} ms (x{v['crowd_max_ms'] / max(v['base_max_ms'], 0.01):.1f})"
                for e, v in c["ports"].items()))  # fmt: skip
        print(f"  framing cases answered other than 4xx/5xx and a close: {out['framing_accepted']} "
              f"(of {len(FRAMING)} on each of {len(out['framing'])} ports)")  # fmt: skip
    ok = (out["answers_5xx"] == 0 and out["slower_than_100ms"] == 0 and out["delayed_1s"] == 0
          and out["framing_accepted"] == 0)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
