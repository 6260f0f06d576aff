"""The openb replay of benchmarks/replay_realk8s.py through DRA with gpupack choosing node and GPU
(`replay_realk8s.py --mode dra-gpupack`): the DRA allocator of `gpupack extender --dra-allocate`
(extender/controllers/dra) allocates each GPU pod's claim, an unmodified kube-scheduler v1.36 honours
the allocation and binds. CPU-only pods are gated too and pinned to the node gpupack's policy picks
(`--dra-place-pods`), as the device-plugin replay's extender places them; `--dra-cpu-pods-by-scheduler`
leaves them to kube-scheduler's own scores instead.

Everything else is benchmarks/replay_dra.py's (the same nodes, ResourceSlices, DeviceClass, claims,
pods and arrival order, one pod at a time, the consumed-capacity check after the run), except: a GPU
pod carries the scheduling gate `gpupack.io/dra-allocate` (what deploy/dra's admission policy adds),
and the allocator runs in this process with the policy the device-plugin replay's extender gets
(the same `gpupack extender` flags: --policy, --policy-seed, --workload-file). A pod the allocator
cannot place stays gated with its reason: that is this mode's "unschedulable" (pod and claim are
deleted, as the simulator drops the pod).

`node_only` (`replay_realk8s.py --mode dra-node`): gpupack chooses only the node (the allocator's
node-only option: the pod is pinned there and ungated, its claim left unallocated), kube-scheduler's
in-tree allocator chooses the GPU on that node.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import replay_dra as rd
from kubernetes import client
from replay_dra import dra, realk8s

from extender.controllers.dra.claims import GATE
from extender.controllers.dra.controller import DraAllocator
from extender.main import build_parser, make_policy
from gpupack.simulate.openb import NodeList, PodList
from gpupack.simulate.replay import Curve, ReplayResult

NAMESPACE = "replay-dra-gpupack"


def submit_one(
    core: client.CoreV1Api, res: client.ResourceV1Api, alloc: DraAllocator, namespace: str,
    pod: dict[str, Any], spec: dict[str, Any] | None, timeout: float, place_pods: bool = True,
) -> tuple[str, dict[str, Any] | None] | None:  # fmt: skip
    name = pod["metadata"]["name"]
    if spec is not None:
        res.create_namespaced_resource_claim(namespace, dra.claim(name, namespace, spec))
    if spec is not None or place_pods:
        pod["spec"]["schedulingGates"] = [{"name": GATE}]
    uid = core.create_namespaced_pod(namespace, pod).metadata.uid
    deadline = time.monotonic() + timeout
    delay = 0.005
    while time.monotonic() < deadline:
        p = core.read_namespaced_pod(name, namespace)
        if p.spec.node_name:
            if spec is None:
                return p.spec.node_name, None
            raw = res.read_namespaced_resource_claim(name, namespace, _preload_content=False)
            return p.spec.node_name, json.loads(raw.data)
        r = alloc.retry.get(uid)
        if rd._unschedulable(p) or (p.spec.scheduling_gates and r is not None and r.reason):
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            if spec is not None:
                res.delete_namespaced_resource_claim(name, namespace)
            return None
        time.sleep(delay)
        delay = min(0.05, delay * 1.5)
    raise TimeoutError(f"pod {name}: neither bound nor refused after {timeout:g}s")


def replay_on_cluster(
    cp: realk8s.ControlPlane, sl: NodeList, sub: PodList, order: np.ndarray, extender_flags: list[str],
    pod_timeout: float = 60.0, progress: bool = False, namespace: str = NAMESPACE, place_pods: bool = True,
    node_only: bool = False,
) -> tuple[ReplayResult, dict[str, Any]]:  # fmt: skip
    index = {n: i for i, n in enumerate(sl.names)}
    info: dict[str, Any] = {
        "allocator_flags": extender_flags,
        "place_pods": place_pods,
        "node_only": node_only,
    }
    sched, alloc = None, None
    try:
        cp.ensure_namespace(namespace)
        t0 = time.monotonic()
        rd.ensure_device_class(cp)
        slices = rd.make_nodes(cp, sl)
        sched = cp.start_scheduler(rd.scheduler_config(), name=rd.SCHEDULER)
        policy = make_policy(build_parser().parse_args(extender_flags))
        alloc = DraAllocator(cp.new_api_client(), policy, {dra.DEVICE_CLASS: "online"}, place_pods=place_pods,
                             node_only=node_only)  # fmt: skip
        alloc.start()
        alloc.store.wait_synced(60)
        info["setup_s"] = round(time.monotonic() - t0, 1)
        api = cp.new_api_client()
        core, res = client.CoreV1Api(api), client.ResourceV1Api(api)
        curve = Curve(sl.gpu_capacity)
        arrived = allocated = placed = failed = 0
        decisions: list[tuple[int, tuple[int, ...]]] = []
        t1 = time.monotonic()
        for step, p in enumerate(order):
            p = int(p)
            req = int(sub.num_gpu[p] * sub.gpu_milli[p])
            arrived += req
            spec = rd.claim_spec(sub, p)
            name = f"p{step:05d}"
            body = rd.pod_body(sub, p, name, namespace, name if spec else None)
            out = submit_one(core, res, alloc, namespace, body, spec, pod_timeout, place_pods)
            if out is None:
                decisions.append((-1, ()))
                failed += req
            else:
                node, claim_obj = out
                gpus: tuple[int, ...] = ()
                if claim_obj is not None:
                    rs = dra.results(claim_obj)
                    assert rs, f"pod {name} bound to {node} with its claim unallocated"
                    gpus = tuple(sorted(dra.device_index(r["device"]) for r in rs))
                    allocated += dra.allocated_milli(claim_obj)
                decisions.append((index[node], gpus))
                placed += 1
            curve.add(arrived, allocated)
            if progress and step % 100 == 0:
                print(
                    f"  {'dra-node' if node_only else 'dra-gpupack'}: {step}/{len(order)} pods, {time.monotonic() - t1:.0f}s",
                    file=sys.stderr,
                )
        info["replay_s"] = round(time.monotonic() - t1, 1)
        claims = rd.list_json(res.list_namespaced_resource_claim, namespace)
        info["devices_in_use"] = dra.check_capacity(slices, claims)
        info["claims_allocated"] = sum(1 for c in claims if dra.results(c))
        info["shared_devices"] = rd._shared_devices(claims)
        info["allocator"] = {"allocated": alloc.counts.allocated, "refused": alloc.counts.refused,
                             "conflicts": alloc.counts.conflicts, "passes": alloc.counts.passes}  # fmt: skip
        mode = "dra-node" if node_only else "dra-gpupack"
        return ReplayResult(mode, 0, curve.values(), len(order), placed, failed, decisions), info
    finally:
        if alloc is not None:
            alloc.stop()
        if sched is not None:
            sched.stop()


def run(
    sl: NodeList, sub: PodList, order: np.ndarray, workdir: Path, extender_flags: list[str],
    pod_timeout: float, progress: bool, place_pods: bool = True, node_only: bool = False,
) -> tuple[ReplayResult, dict[str, Any]]:  # fmt: skip
    cp = realk8s.ControlPlane(workdir / ("k8s-dra-node" if node_only else "k8s-dra-gpupack")).start()
    try:
        why = rd.dra_unsupported(cp)
        if why:
            raise SystemExit(f"DRA replay impossible with {cp.assets}: {why}")
        return replay_on_cluster(
            cp,
            sl,
            sub,
            order,
            extender_flags,
            pod_timeout,
            progress,
            place_pods=place_pods,
            node_only=node_only,
        )
    finally:
        cp.stop()
