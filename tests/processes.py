"""The real `gpupack extender` as a child process, for tests and benchmarks.

One launcher so that every test folder and benchmark starts the extender the same way: its verbs on a
free loopback port, talking to an in-test API server through a kubeconfig.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]


# a component's first line on stderr (gpupack/logs.py announce), before any error it reports
VERSION_LINE = re.compile(r"gpupack \S+ \S+ starting")


def error_lines(stderr: str) -> list[str]:
    """`stderr`'s lines less the component's version line: what an error said."""
    return [line for line in stderr.splitlines() if line.strip() and not VERSION_LINE.search(line)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """`pid` and every process it started, and theirs (Linux /proc; only `pid` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # gone meanwhile
                todo.extend(int(c) for c in task.read_text().split())
    return out


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig that points the official client (and `--kubeconfig`) at `url`."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "t", "cluster": {"server": url}}],
                "users": [{"name": "t", "user": {}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
                "current-context": "t",
            }
        )
    )
    return path


class ExtenderProcess:
    """`gpupack extender` on a free loopback port, logging to `log`; `extra` are more flags."""

    def __init__(self, kubeconfig: Path, log: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()  # a fixed port: a restarted extender behind the same URL
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable, "-m", "gpupack", "extender", "--host", "127.0.0.1", "--port", str(self.port),
            "--kubeconfig", str(kubeconfig), "--webhook-port", "0", "--log-level", "warning", *extra,
        ]  # fmt: skip
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.http = requests.Session()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Block until /readyz answers 200; returns the seconds since start."""
        while time.monotonic() - self.t_start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"extender exited: {self.tail()}")
            try:
                if self.http.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - self.t_start
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise AssertionError(f"extender not ready after {timeout:g}s: {self.tail()}")

    def post(self, verb: str, body: Any, timeout: float = 30) -> requests.Response:
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        return self.http.post(
            f"{self.url}/{verb}", data=data, headers={"Content-Type": "application/json"}, timeout=timeout
        )

    def metric(self, line_start: str) -> float:
        """The value of the first /metrics line starting with `line_start` (0 when none does)."""
        for line in self.http.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_no_pending_handoffs(self, timeout: float = 10.0) -> None:
        """Block until the extender's own view holds no pending handoff: a pod's handoff=done is in
        the API server before the extender's watch delivers it, and until then the node stays locked."""
        deadline = time.monotonic() + timeout
        while self.metric("gpupack_cluster_pending_handoffs ") != 0.0:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"extender still sees a pending handoff after {timeout:g}s: {self.tail()}"
                )
            time.sleep(0.05)

    def reserved(self, key_label: str = "index") -> dict[tuple[str, str], tuple[float, float]]:
        """(node, GPU `key_label` — index or uuid) -> (reserved MiB, reserved SM %) from /metrics
        (exported in bytes and as a ratio)."""
        out: dict[tuple[str, str], list[float]] = {}
        scale = (1 / (1 << 20), 100.0)
        for line in self.http.get(self.url + "/metrics", timeout=5).text.splitlines():
            for i, name in enumerate(
                ("gpupack_gpu_reserved_memory_bytes{", "gpupack_gpu_reserved_sm_ratio{")
            ):
                if line.startswith(name):
                    labels = dict(kv.split("=", 1) for kv in line[len(name) : line.index("}")].split(","))
                    key = (labels["node"].strip('"'), labels[key_label].strip('"'))
                    out.setdefault(key, [0.0, 0.0])[i] = round(float(line.rsplit(" ", 1)[1]) * scale[i], 6)
        return {k: (v[0], v[1]) for k, v in out.items()}

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of `pids`; threads started later inherit their creator's CPUs."""
    for pid in pids:
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(tid, cpus)


def give_extender_cpus(ext: ExtenderProcess, n: int) -> dict[str, list[int]]:
    """The extender (and its webhook child) on the last `n` CPUs, everything else this benchmark
    started (the API server, etcd, the client threads) on the others: the extender's own latency,
    binds and watch events included, without the run queue of a client and an API server that a
    deployed extender does not share its CPUs with (a scheduler pod with CPUs of its own)."""
    mine = _ALL_CPUS  # as the benchmark started: a second cluster size finds this process pinned
    if not 0 < n < len(mine):
        raise SystemExit(f"--extender-cpus must be 1..{len(mine) - 1} on this machine ({len(mine)} CPUs)")
    theirs, rest = set(mine[-n:]), set(mine[:-n])
    ext_tree = set(descendants(ext.proc.pid))
    _pin([p for p in descendants(os.getpid()) if p not in ext_tree], rest)
    _pin(sorted(ext_tree), theirs)
    return {"extender": sorted(theirs), "others": sorted(rest)}
