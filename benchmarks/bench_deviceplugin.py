"""Device plugin benchmarks: ListAndWatch message size, Allocate latency, plugin memory.

    python benchmarks/bench_deviceplugin.py [--pods 200] [--json]

- ListAndWatch bytes for 1, 8 and 16 H200-class GPUs (143,771 MiB each), next to what one
  device ID per MiB would cost (the approach that overflows the kubelet's 4 MiB gRPC limit).
- Allocate p50/p99: the plugin runs as its own process (`gpupack device-plugin` over the tests'
  fake NVML, 8 GPUs) against a real kube-apiserver + etcd (v1.28.7, started by tests/realk8s.py
  from ../shared/k8s or $GPUPACK_K8S_ASSETS); each pod is annotated and bound as the extender
  does, then Allocate is called over the plugin's unix socket. The latency includes the plugin's
  pod list and annotation PATCH.
- Resident memory (VmRSS) of that plugin process, serving 8 GPUs, after the allocations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_DIR = REPO / "tests" / "deviceplugin"  # the fake NVML is test code, not in the package
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(FAKE_DIR)]

import grpc  # noqa: E402
from fake_nvml import H200_MIB, FakeNvml  # noqa: E402
from kubernetes import client  # noqa: E402

from deviceplugin.api import api_pb2, api_pb2_grpc  # noqa: E402
from deviceplugin.discovery import discover, init_nvml  # noqa: E402
from deviceplugin.health import DeviceState  # noqa: E402
from deviceplugin.server import list_response  # noqa: E402
from gpupack import contract, handoff  # noqa: E402

GRPC_DEFAULT_MAX_RECV = 4 * 1024 * 1024


def listandwatch_sizes() -> dict:
    out = {}
    for n in (1, 8, 16):
        nvml = FakeNvml({"gpus": n, "numa_nodes": 2 if n > 1 else 1})
        init_nvml(nvml)
        msg = list_response(DeviceState(discover(nvml).gpus))
        # One ID per MiB: estimate from the average encoded size of such a device entry.
        sample = (
            api_pb2.ListAndWatchResponse(
                devices=[
                    api_pb2.Device(
                        ID=f"{g.uuid}-{m}",
                        health="Healthy",
                        topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=g.numa_node)]),
                    )
                    for g in discover(nvml).gpus[:1]
                    for m in range(100000, 101000)
                ]
            ).ByteSize()
            / 1000
        )
        per_mib = int(sample * H200_MIB * n)
        out[n] = {
            "devices": len(msg.devices),
            "bytes": msg.ByteSize(),
            "per_mib_devices": H200_MIB * n,
            "per_mib_bytes_est": per_mib,
            "per_mib_over_4MiB": per_mib > GRPC_DEFAULT_MAX_RECV,
        }
    return out


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def allocate_and_memory(pods: int) -> dict:
    import realk8s

    node = "bench-node"
    ns = "bench"
    tmp = tempfile.mkdtemp(prefix="dpb")
    cp = realk8s.ControlPlane(Path(tmp) / "k8s")
    proc = None
    try:
        cp.start(controller_manager=False)
        core = cp.core
        cp.make_node(node)
        cp.ensure_namespace(ns)
        kc = cp.write_kubeconfig(Path(tmp) / "kubeconfig")
        sock = os.path.join(tmp, "gpupack.sock")
        nvml = json.dumps({"gpus": 8, "numa_nodes": 2})
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpupack",
                "device-plugin",
                "--node-name",
                node,
                "--kubelet-dir",
                tmp,
                "--kubeconfig",
                str(kc),
                "--nvml-module",
                "fake_nvml",
                "--nvml-config",
                nvml,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_DIR), str(REPO)])},
        )
        inv = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (inv is None or not os.path.exists(sock)):
            time.sleep(0.1)
            ann = json.loads(core.read_node(node, _preload_content=False).data)["metadata"].get(
                "annotations", {}
            )
            if contract.ANN_INVENTORY in ann:
                inv = contract.decode_inventory(ann[contract.ANN_INVENTORY], node)
        if inv is None:
            raise RuntimeError("device plugin did not start")
        rss_idle = _rss_kib(proc.pid)
        channel = grpc.insecure_channel(f"unix:{sock}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        lat = []
        for i in range(pods):
            name = f"b{i:04d}"
            body = {
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "schedulerName": contract.SCHEDULER_NAME,
                    "containers": [
                        {
                            "name": "c",
                            "image": "x",
                            "resources": {"limits": {contract.RES_GPU: "1", contract.RES_GPU_MEM: "1000"}},
                        }
                    ],
                },
            }
            pod = json.loads(core.create_namespaced_pod(ns, body, _preload_content=False).data)
            g = inv.gpus[i % len(inv.gpus)]
            a = contract.Assignment(
                pod["metadata"]["uid"], node, "online", {"c": (contract.GPUShare(g.uuid, g.index, 1000, 5),)}
            )
            core.patch_namespaced_pod(
                name,
                ns,
                {"metadata": {"annotations": handoff.handoff_annotations_for_bind(a)}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
            core.create_namespaced_pod_binding(
                name,
                ns,
                client.V1Binding(
                    metadata=client.V1ObjectMeta(name=name),
                    target=client.V1ObjectReference(kind="Node", name=node),
                ),
                _preload_content=False,
            )
            t0 = time.perf_counter()
            resp = stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[
                        api_pb2.ContainerAllocateRequest(
                            devices_ids=[f"{g.uuid}::{i % contract.SLOTS_PER_GPU}"]
                        )
                    ]
                ),
                timeout=10,
            )
            lat.append(time.perf_counter() - t0)
            assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == g.uuid
        channel.close()
        rss = _rss_kib(proc.pid)
        lat.sort()
        q = statistics.quantiles(lat, n=100)
        return {
            "pods": pods,
            "allocate_ms_p50": round(q[49] * 1000, 2),
            "allocate_ms_p99": round(q[98] * 1000, 2),
            "allocate_ms_mean": round(statistics.mean(lat) * 1000, 2),
            "pods_on_node_at_end": pods,
            "plugin_rss_mib_idle": round(rss_idle / 1024, 1),
            "plugin_rss_mib_after": round(rss / 1024, 1),
        }
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=200, help="pods to allocate for the latency figures")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = {"listandwatch": listandwatch_sizes(), "allocate": allocate_and_memory(args.pods)}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print("ListAndWatch message (H200-class GPUs, 143,771 MiB each):")
    for n, r in res["listandwatch"].items():
        print(
            f"  {n:>2} GPU(s): {r['devices']:>4} device IDs, {r['bytes']:>6} bytes   "
            f"(one ID per MiB: {r['per_mib_devices']:>9} IDs, ~{r['per_mib_bytes_est'] / 2**20:.1f} MiB"
            f"{', over the 4 MiB gRPC limit' if r['per_mib_over_4MiB'] else ''})"
        )
    a = res["allocate"]
    print(
        f"Allocate latency over {a['pods']} pods (plugin process, real kube-apiserver): "
        f"p50 {a['allocate_ms_p50']} ms, p99 {a['allocate_ms_p99']} ms, mean {a['allocate_ms_mean']} ms"
    )
    print(
        f"Plugin resident memory, 8 GPUs: {a['plugin_rss_mib_idle']} MiB at start, "
        f"{a['plugin_rss_mib_after']} MiB after {a['pods']} allocations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
