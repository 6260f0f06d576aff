"""The kubelets of a benchmark's fake nodes, with gpupack's device plugin ending each GPU handoff
(tests/realk8s.py KubeletEmulator with tests/extender/ext_helpers.py DevicePluginEmulator as its
admit hook), either in the benchmark's process ("thread") or in processes of their own ("procs",
issue 29). In the benchmark's process the stand-in shares one GIL with the watch that observes the
pods and with whatever else the benchmark does, and admitted pods seconds late at a burst's rate;
in its own processes each one serves the nodes whose name hashes to it, with its own watch, API
clients and GIL."""

from __future__ import annotations

import multiprocessing
import queue
import sys
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = ("thread", "procs")


class _Cluster:
    """What KubeletEmulator and DevicePluginEmulator need of a ControlPlane, in another process."""

    def __init__(self, url: str, ca_file: str, token: str) -> None:
        self.url, self.ca_file, self.token = url, ca_file, token

    def new_api_client(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = self.ca_file
        cfg.api_key = {"authorization": f"Bearer {self.token}"}
        return client.ApiClient(cfg)


def shard_of(node: str, shards: int) -> int:
    """Which of `shards` processes serves `node` (the same in every process: not Python's hash)."""
    return zlib.crc32(node.encode()) % shards


def _serve(
    cluster: _Cluster, namespace: str | None, admit_delay: float, concurrency: int, shard: int, shards: int,
    ready: Any, stop: Any, results: Any,
) -> None:  # fmt: skip
    for p in (ROOT, ROOT / "tests", ROOT / "tests" / "extender"):
        sys.path.insert(0, str(p))
    import realk8s
    from ext_helpers import DevicePluginEmulator

    plugin = DevicePluginEmulator(cluster, static_inventory=True)
    kubelet = realk8s.KubeletEmulator(cluster, namespace, admit_delay=admit_delay, on_admit=plugin,
                                      nodes=lambda n: shard_of(n, shards) == shard,
                                      concurrency=concurrency)  # fmt: skip
    # The client builds its pod models (pydantic) on first use: seconds of CPU under the import
    # lock on a busy machine, which would otherwise fall inside the first admissions of the burst.
    kubelet.core.list_pod_for_all_namespaces(limit=1)
    with kubelet:
        kubelet.watching.wait()
        ready.put(shard)
        stop.wait()
    results.put(kubelet.errors + plugin.errors)


class ProcessStandIn:
    """`procs` processes, each the kubelets and device plugin of its share of the nodes."""

    def __init__(
        self, cp: Any, namespace: str | None, admit_delay: float, procs: int = 2, concurrency: int = 0
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # the caller has threads: no fork
        self._stop = ctx.Event()
        self._ready: Any = ctx.Queue()
        self._results: Any = ctx.Queue()
        cluster = _Cluster(cp.url, str(cp.ca_file), cp.token)
        self._procs = [
            ctx.Process(
                target=_serve,
                daemon=True,
                args=(
                    cluster,
                    namespace,
                    admit_delay,
                    concurrency,
                    i,
                    procs,
                    self._ready,
                    self._stop,
                    self._results,
                ),
            )  # fmt: skip
            for i in range(procs)
        ]
        self._errors: list[str] = []

    def __enter__(self) -> ProcessStandIn:
        for p in self._procs:
            p.start()
        for _ in self._procs:  # each has listed the pods and opened its watch
            self._ready.get(timeout=120)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for _ in self._procs:
            try:
                self._errors += self._results.get(timeout=30)
            except queue.Empty:
                self._errors.append("a kubelet stand-in process did not report")
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    def errors(self) -> list[str]:
        return list(self._errors)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]


class ThreadStandIn:
    """The stand-in in the caller's process (as every test runs it)."""

    def __init__(self, cp: Any, namespace: str | None, admit_delay: float, concurrency: int = 0) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        sys.path.insert(0, str(ROOT / "tests" / "extender"))
        import realk8s
        from ext_helpers import DevicePluginEmulator

        self.plugin = DevicePluginEmulator(cp, static_inventory=True)
        self.kubelet = realk8s.KubeletEmulator(
            cp, namespace, admit_delay=admit_delay, on_admit=self.plugin, concurrency=concurrency
        )

    def __enter__(self) -> ThreadStandIn:
        self.kubelet.start()
        self.kubelet.watching.wait(120)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kubelet.stop()

    def errors(self) -> list[str]:
        return self.kubelet.errors + self.plugin.errors

    def pids(self) -> list[int]:
        return []  # the caller's own


def start_stand_in(
    kind: str, cp: Any, namespace: str | None = None, admit_delay: float = 0.0, procs: int = 2,
    concurrency: int = 0,
) -> ProcessStandIn | ThreadStandIn:  # fmt: skip
    """The kubelet stand-in `kind` (one of STAND_INS), to use as a context manager; `concurrency`:
    admissions in flight at once in each process (0: realk8s.ADMIT_CONCURRENCY)."""
    if kind == "procs":
        return ProcessStandIn(cp, namespace, admit_delay, procs, concurrency)
    if kind == "thread":
        return ThreadStandIn(cp, namespace, admit_delay, concurrency)
    raise ValueError(f"stand-in {kind!r}: one of {', '.join(STAND_INS)}")
