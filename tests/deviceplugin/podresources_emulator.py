"""The kubelet's PodResources API v1 (`List`) for the device-manager harness, which does not serve it.

What is emulated, exactly: the kubelet's PodResources server (pkg/kubelet/apis/podresources,
`v1PodResourcesServer.List`) answers, for every pod the kubelet knows, each container's devices as
the device manager's `podDevices` holds them (`GetDevices(podUID, containerName)`). The device
manager writes the same `podDevices` to its checkpoint (`kubelet_internal_checkpoint`: PodUID,
ContainerName, ResourceName, DeviceIDs per NUMA node) after every allocation, before the kubelet
calls GetDeviceRunContainerOptions and so PreStartContainer. This emulator answers List from that
checkpoint file in the harness's device-plugin directory, read afresh on each call. The checkpoint
names pods by UID only; their names and namespaces come from the harness's pods files (the pods
the harness admits, as a kubelet's pod manager knows them). A checkpoint entry of a pod in no pods
file is listed under the namespace "" and name "uid:<UID>" (a pod the kubelet knows but gpupack's
API server does not). Only `List` is served; CPUs, memory and DRA are left empty.

    python podresources_emulator.py --socket S --checkpoint-dir DIR --pods-glob 'BASE/pods*.json'

Runs until killed (it is started in the device plugin's process group by tests/deviceplugin/harness.py).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from deviceplugin.api import podresources_pb2, podresources_pb2_grpc  # noqa: E402

CHECKPOINT = "kubelet_internal_checkpoint"


def _pods(pattern: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for f in sorted(glob.glob(pattern)):
        try:
            for p in json.loads(Path(f).read_text()):
                out[str(p["uid"])] = (str(p.get("namespace", "default")), str(p["name"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a pods file being written; the next List reads it again
    return out


def _entries(checkpoint: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(checkpoint.read_text())
    except (OSError, ValueError):
        return []  # no allocation yet (the device manager writes the file atomically)
    return list((data.get("Data") or {}).get("PodDeviceEntries") or [])


def list_response(checkpoint: Path, pods_glob: str) -> podresources_pb2.ListPodResourcesResponse:
    names = _pods(pods_glob)
    by_pod: dict[str, dict[str, list[podresources_pb2.ContainerDevices]]] = {}
    for e in _entries(checkpoint):
        uid, cname, res = str(e.get("PodUID")), str(e.get("ContainerName")), str(e.get("ResourceName"))
        raw = e.get("DeviceIDs") or {}
        per_numa = raw.items() if isinstance(raw, dict) else [("-1", raw)]  # pre-1.20 checkpoints: a list
        for numa, ids in per_numa:
            topo = None
            if str(numa).lstrip("-").isdigit() and int(numa) >= 0:
                topo = podresources_pb2.TopologyInfo(nodes=[podresources_pb2.NUMANode(ID=int(numa))])
            dev = podresources_pb2.ContainerDevices(resource_name=res, device_ids=list(ids), topology=topo)
            by_pod.setdefault(uid, {}).setdefault(cname, []).append(dev)
    out = []
    for uid, containers in by_pod.items():
        ns, name = names.get(uid, ("", f"uid:{uid}"))
        out.append(
            podresources_pb2.PodResources(
                name=name,
                namespace=ns,
                containers=[
                    podresources_pb2.ContainerResources(name=c, devices=devs)
                    for c, devs in containers.items()
                ],
            )
        )
    return podresources_pb2.ListPodResourcesResponse(pod_resources=out)


class Lister(podresources_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, checkpoint: Path, pods_glob: str) -> None:
        self.checkpoint = checkpoint
        self.pods_glob = pods_glob

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        return list_response(self.checkpoint, self.pods_glob)


def serve(socket_path: str, checkpoint_dir: str, pods_glob: str) -> grpc.Server:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)  # left by an emulator that was SIGKILLed
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(
        Lister(Path(checkpoint_dir) / CHECKPOINT, pods_glob), server
    )
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    return server


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--checkpoint-dir", required=True, help="the harness's HARNESS_DIR")
    p.add_argument("--pods-glob", required=True, help="the harness's pods files")
    args = p.parse_args(argv)
    server = serve(args.socket, args.checkpoint_dir, args.pods_glob)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop(0)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
