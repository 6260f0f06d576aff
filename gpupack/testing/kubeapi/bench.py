"""Throughput of the in-test API server at benchmark scale.

    python -m gpupack.testing.kubeapi.bench [--nodes 2000] [--pods 50000] [--http-pods 2000] [--json]

Seeds nodes and pods through the direct helpers, creates and binds pods over HTTP with the
official client, and times the reads benchmarks do: list all pods, list one node's pods by
field selector, and a watch that has to deliver a burst of changes.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from kubernetes import client, watch

from .server import KubeAPIServer


def _pod(name: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.local/model-server:1",
                "resources": {
                    "limits": {
                        "cpu": "2",
                        "memory": "8Gi",
                        "gpupack.io/gpu": "1",
                        "gpupack.io/gpu-mem": "8192",
                    }
                },
            }
        ],
        "schedulerName": "gpupack-scheduler",
    }
    return {"metadata": {"name": name, "namespace": "default", "labels": {"app": name[:6]}}, "spec": spec}


def run(nodes: int, pods: int, http_pods: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with KubeAPIServer(record_requests=False) as server:
        t = time.perf_counter()
        for i in range(nodes):
            server.create(
                "nodes",
                {"metadata": {"name": f"node-{i}"}, "status": {"allocatable": {"gpupack.io/gpu": "128"}}},
            )
        server.create_many("pods", (_pod(f"seed-{i}") for i in range(pods)))
        with server.store.cond:
            for i, pod in enumerate(
                server.store.items(server.registry.store.resources["pods"].resource, "default")
            ):
                if i % 2 == 0:
                    server.registry.bind(
                        "default", pod["metadata"]["name"], {"target": {"name": f"node-{i % nodes}"}}
                    )
        out["direct_create_per_s"] = (nodes + pods) / (time.perf_counter() - t)

        api = server.api_client()
        core = client.CoreV1Api(api)
        t = time.perf_counter()
        for i in range(http_pods):
            core.create_namespaced_pod("default", _pod(f"http-{i}"))
        out["http_create_per_s"] = http_pods / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(http_pods):
            body = {
                "metadata": {"name": f"http-{i}"},
                "target": {"kind": "Node", "name": f"node-{i % nodes}"},
            }
            resp = core.create_namespaced_pod_binding(f"http-{i}", "default", body, _preload_content=False)
            resp.read()
            resp.release_conn()
        out["http_bind_per_s"] = http_pods / (time.perf_counter() - t)

        t = time.perf_counter()
        resp = core.list_pod_for_all_namespaces(_preload_content=False)
        data = resp.data
        out["list_all_pods_served_s"] = time.perf_counter() - t  # until the last byte arrived
        out["list_all_pods_items"] = len(json.loads(data)["items"])
        out["list_all_pods_mib"] = len(data) / 2**20
        t = time.perf_counter()
        for i in range(100):
            core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName=node-{i}", _preload_content=False)
        out["list_node_pods_ms"] = (time.perf_counter() - t) * 1000 / 100

        rv = core.list_node(limit=1).metadata.resource_version
        seen = []
        ready = threading.Event()

        def watcher() -> None:
            ready.set()
            for ev in watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=60):
                seen.append(ev["type"])
                if len(seen) >= min(nodes, 1000):
                    return

        th = threading.Thread(target=watcher)
        th.start()
        ready.wait()
        t = time.perf_counter()
        for i in range(min(nodes, 1000)):
            server.patch("nodes", f"node-{i}", {"metadata": {"annotations": {"gpupack.io/x": str(i)}}})
        th.join()
        out["watch_1000_events_s"] = time.perf_counter() - t
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--pods", type=int, default=50_000)
    parser.add_argument("--http-pods", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = run(args.nodes, args.pods, args.http_pods)
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:24s} {value:12.2f}")


if __name__ == "__main__":
    main()
