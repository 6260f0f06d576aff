"""Creating many pods fast, from several processes (issue 29): one Python process with the official
client creates under ~90 pods/s on the shared 2-core machine, slower than plain kube-scheduler
binds them, so a benchmark creating from one process measures its creator. Each worker process
has its own client and a few threads; the creation times are taken on the system-wide monotonic
clock (CLOCK_MONOTONIC on Linux), so they compare with the caller's time.monotonic()."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

_api: Any = None  # the worker's CoreV1Api


def _init(url: str, ca_file: str, token: str, threads: int) -> None:
    global _api
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = url
    cfg.ssl_ca_cert = ca_file
    cfg.api_key = {"authorization": f"Bearer {token}"}
    cfg.connection_pool_maxsize = threads
    _api = client.CoreV1Api(client.ApiClient(cfg))


def _ready(_: int) -> bool:
    time.sleep(0.3)  # every worker takes one of these: all have started and built their client
    return _api is not None


def _create(job: tuple[str, list[dict[str, Any]], int, bool]) -> dict[str, Any]:
    """name -> when its creation was answered, or with `uids` the UID the API server gave it."""
    ns, pods, threads, uids = job
    out: dict[str, Any] = {}

    def one(p: dict[str, Any]) -> None:
        name = p["metadata"]["name"]
        for attempt in range(5):
            try:
                resp = _api.create_namespaced_pod(ns, p, _preload_content=False)
                if uids:
                    out[name] = json.loads(resp.data)["metadata"]["uid"]
                else:
                    resp.release_conn()
                    out[name] = time.monotonic()
                return
            except Exception as e:  # a 409 after a lost answer: it was created
                if getattr(e, "status", 0) == 409:
                    if uids:
                        out[name] = _api.read_namespaced_pod(name, ns).metadata.uid
                    else:
                        out[name] = time.monotonic()
                    return
                if attempt == 4:
                    raise
                time.sleep(0.2)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, pods))
    return out


def _annotate(job: tuple[str, list[tuple[str, dict[str, str]]], int]) -> int:
    """Merge `annotations` into each pod `(name, annotations)` of `ns`: how many were written."""
    ns, items, threads = job

    def one(item: tuple[str, dict[str, str]]) -> None:
        name, ann = item
        _api.patch_namespaced_pod(
            name, ns, {"metadata": {"annotations": ann}}, _preload_content=False
        ).release_conn()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, items))
    return len(items)


def _bind(job: tuple[str, list[tuple[str, str, dict[str, str]]], float, float, int]) -> dict[str, float]:
    """Bind pods `(name, node, annotations)` of `ns`, the i-th at `start + i / rate` (monotonic), as a
    scheduler binds a burst: name -> when its Binding was answered."""
    ns, binds, rate, start, threads = job
    out: dict[str, float] = {}

    def one(i: int) -> None:
        name, node, ann = binds[i]
        due = start + i / rate
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "annotations": ann},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
        _api.create_namespaced_pod_binding(name, ns, body, _preload_content=False).release_conn()
        out[name] = time.monotonic()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(binds))))
    return out


def _patch_status(job: tuple[str, list[str], float, float, int]) -> int:
    """Patch the status of pods `names` in `ns` round-robin at `rate` a second until `until`
    (monotonic), as kubelets reporting probes do; the number of patches answered."""
    ns, names, rate, until, threads = job
    done = 0
    lock = threading.Lock()
    start = time.monotonic()

    def worker(w: int) -> None:
        nonlocal done
        i = w
        while True:
            due = start + i / rate
            now = time.monotonic()
            if due >= until:
                return
            if due > now:
                time.sleep(due - now)
            name = names[i % len(names)]
            body = {"status": {"conditions": [{"type": "Ready", "status": "True" if i % 2 else "False"}]}}
            try:
                _api.patch_namespaced_pod_status(name, ns, body, _preload_content=False).release_conn()
                with lock:
                    done += 1
            except Exception:  # a pod gone: its update is not counted
                pass
            i += threads

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return done


class PodCreator:
    """`procs` worker processes, started (and their clients built) before any timing begins."""

    def __init__(self, url: str, ca_file: str, token: str, procs: int = 4, threads: int = 8) -> None:
        self.procs, self.threads = procs, threads
        ctx = multiprocessing.get_context("spawn")  # the caller has threads: no fork
        self.pool = ProcessPoolExecutor(procs, mp_context=ctx, initializer=_init,
                                        initargs=(url, ca_file, token, threads))  # fmt: skip
        assert all(self.pool.map(_ready, range(procs * 2)))

    def create(self, ns: str, pods: list[dict[str, Any]]) -> dict[str, float]:
        """Create `pods` in `ns` as fast as the workers can: name -> when its creation was answered."""
        return self._create(ns, pods, uids=False)

    def create_uids(self, ns: str, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Create `pods` in `ns` as fast as the workers can: name -> the UID the API server gave it."""
        return self._create(ns, pods, uids=True)

    def _create(self, ns: str, pods: list[dict[str, Any]], uids: bool) -> dict[str, Any]:
        chunks = [pods[i :: self.procs] for i in range(self.procs)]
        jobs = [(ns, c, self.threads, uids) for c in chunks if c]
        out: dict[str, Any] = {}
        for part in self.pool.map(_create, jobs):
            out.update(part)
        return out

    def annotate(self, ns: str, items: list[tuple[str, dict[str, str]]]) -> int:
        """Merge annotations into pods `(name, annotations)` of `ns`: how many were written."""
        parts = [items[i :: self.procs] for i in range(self.procs)]
        return sum(self.pool.map(_annotate, [(ns, part, self.threads) for part in parts if part]))

    def bind(self, ns: str, binds: list[tuple[str, str, dict[str, str]]], rate: float) -> dict[str, float]:
        """Bind `(pod, node, annotations)` in `ns` at `rate` a second in all: name -> when each was answered."""
        start = time.monotonic() + 0.2  # every worker has its job by then
        parts = [binds[i :: self.procs] for i in range(self.procs)]
        jobs = [
            (ns, part, rate / self.procs, start + i / rate, self.threads)
            for i, part in enumerate(parts)
            if part
        ]
        out: dict[str, float] = {}
        for part in self.pool.map(_bind, jobs):
            out.update(part)
        return out

    def patch_status(self, ns: str, names: list[str], rate: float, seconds: float) -> int:
        """Status updates of `names` at `rate` a second in all, for `seconds`: how many were made."""
        until = time.monotonic() + seconds
        parts = [names[i :: self.procs] for i in range(self.procs)]
        jobs = [(ns, part, rate / self.procs, until, self.threads) for part in parts if part]
        return sum(self.pool.map(_patch_status, jobs))

    def pids(self) -> list[int]:
        return [p.pid for p in self.pool._processes.values() if p.pid is not None]  # no public list

    def close(self) -> None:
        self.pool.shutdown()
