"""Against the real API server (and the real kube-scheduler v1.28.7): the extender's view of each
node's CPU and memory follows every pod assigned there, gpupack's or not, and with
`--filter-keep-best 1` kube-scheduler binds each GPU pod on the node, and the extender gives it the
GPUs, that the simulator's schedule() picks for the same cluster state; a CPU-only pod of the profile
too (on the node only: it gets no GPUs, no assignment and no handoff)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import realk8s
from ext_helpers import (
    H100_MIB,
    annotations,
    bind_body,
    container,
    create_pod,
    get_pod,
    gpu_node,
    inventory,
    pod_obj,
)
from kubernetes import client
from processes import ExtenderProcess

from extender.api.kube import Kube, api_client
from extender.api.wire import parse_bind_args
from extender.state.sync import Sync
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    LABEL_GPU_COUNT,
    LABEL_GPU_MODEL,
    LABEL_GPU_NODE,
    LABEL_MANAGED,
    RES_GPU,
    SLOTS_PER_GPU,
    decode_assignment,
)
from gpupack.core.fgd import Shape, Workload, workload_to_json
from gpupack.core.model import Node
from gpupack.core.policies import Policy, get_policy, schedule

until = realk8s.until
MODEL = "NVIDIA-H100-80GB-HBM3"


def plain_pod(name: str, node: str | None, cpu: str, mem: str, init: tuple[str, str] | None = None) -> dict:
    """A pod of no concern to gpupack, with CPU/memory requests (and an init container)."""
    spec: dict[str, Any] = {
        "containers": [
            {"name": "a", "image": "registry.invalid/x:1", "resources": {"requests": {"cpu": cpu, "memory": mem}}},
            {"name": "b", "image": "registry.invalid/x:1", "resources": {"limits": {"cpu": "250m", "memory": "256Mi"}}},
        ]
    }  # fmt: skip
    if node:
        spec["nodeName"] = node
    if init:
        spec["initContainers"] = [
            {"name": "i", "image": "registry.invalid/x:1",
             "resources": {"requests": {"cpu": init[0], "memory": init[1]}}}
        ]  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def create_plain(core: client.CoreV1Api, pod: dict, ns: str) -> None:
    """Create a pod as given, nodeName included (ext_helpers.create_pod drops it)."""
    core.create_namespaced_pod(ns, pod)


def host(node: Node) -> tuple[int, int, int, int]:
    return node.cpu_milli, node.ram_mib, node.cpu_used, node.ram_used


def delete_now(core: client.CoreV1Api, ns: str, name: str) -> None:
    core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_the_listed_cluster_is_out_of_the_collectors_reach_before_the_first_verb(
    cluster: realk8s.ControlPlane, sfx: str, tmp_path: Path
) -> None:
    # a full collection walks every tracked object: the nodes listed at start must not be among
    # them (Sync(freeze_heap=True), as the extender runs it), and no verb is answered before
    node = f"frozen-{sfx}"
    gpu_node(cluster, node, n=2)
    view = ClusterView(track_host=True)
    sync = Sync(view, Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc")))), 30, freeze_heap=True)
    sync.start()
    try:
        assert sync.wait_ready(20)
        listed = view.state.nodes[node]
        assert not any(o is listed for o in gc.get_objects()), "the listed node is still collectable"
    finally:
        sync.close()
        gc.unfreeze()  # the rest of this test process as before


def test_node_cpu_and_memory_from_real_pods(
    cluster: realk8s.ControlPlane, ns: str, sfx: str, tmp_path: Path
) -> None:
    node = f"hostres-{sfx}"
    gpu_node(cluster, node, n=2)  # 64 CPUs, 512Gi (realk8s.make_node)
    core = cluster.core
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc"))))
    view = ClusterView(track_host=True)
    sync = Sync(view, kube, watch_timeout_s=30)
    # one pod assigned before the extender lists, one after: the list and the watch both count
    create_plain(core, plain_pod("early", node, "1500m", "1Gi"), ns)
    sync.start()
    try:
        assert sync.wait_ready(20)
        n = view.state.nodes[node]
        assert host(n)[:2] == (64000, 512 * 1024)
        until(lambda: n.cpu_used == 1750, 10, "the listed pod charged (1500m + 250m from the limit)")
        assert n.ram_used == 1024 + 256
        # an init container larger than the app containers sets the pod's request
        create_plain(core, plain_pod("init", node, "1", "1Gi", init=("6", "3Gi")), ns)
        until(lambda: n.cpu_used == 1750 + 6000, 10, "the init container's CPU charged")
        assert n.ram_used == 1280 + 3072
        # a pod of another node, and one not assigned yet, count nowhere here
        create_plain(core, plain_pod("waiting", None, "4", "4Gi"), ns)
        # a gpupack pod bound by the extender: charged from its bind on, once
        ext = Extender(view, get_policy("gpupack"), kube)
        g = pod_obj("gpu", [container("c", gpu=1, mem=1000, sm=20)], namespace=ns)
        g["spec"]["containers"][0]["resources"]["requests"].update(cpu="2", memory="2Gi")
        g["spec"]["schedulerName"] = "nobody"  # no scheduler here: this test binds it itself
        g = create_pod(core, g, ns)
        assert ext.bind(parse_bind_args(bind_body(g, node))) == {"Error": ""}
        assert n.cpu_used == 7750 + 2000  # at once: assumed before either watch shows it
        until(
            lambda: view.host.pods.get(f"{ns}/gpu", (None, ""))[1] == node,
            10,
            "the watch shows the bound pod",
        )
        until(lambda: not view.pods[f"{ns}/gpu"].assumed, 10, "the labelled watch confirms it")
        assert (n.cpu_used, n.ram_used) == (9750, 4352 + 2048)  # still once
        # a pod that ends (Succeeded) and a pod deleted give their share back
        early = get_pod(core, ns, "early")
        early["status"]["phase"] = "Succeeded"
        core.replace_namespaced_pod_status("early", ns, early)
        until(lambda: n.cpu_used == 8000, 10, "the Succeeded pod's share freed")
        delete_now(core, ns, "init")
        until(lambda: n.cpu_used == 2000, 10, "the deleted pod's share freed")
        delete_now(core, ns, "gpu")
        until(lambda: (n.cpu_used, n.ram_used) == (0, 0), 10, "the gpupack pod's share freed")
        assert f"{ns}/gpu" not in view.pods and not view.host.pods.get(f"{ns}/waiting")
    finally:
        sync.close()


WORKLOAD = Workload.of(
    [Shape(4000, 1, 300)] * 6
    + [Shape(8000, 1, 1000)] * 3
    + [Shape(24000, 2, 1000)] * 2
    + [Shape(2000, 1, 500)] * 4
)


def mirror(core: client.CoreV1Api) -> ClusterView:
    """The cluster as the extender sees it, from fresh lists (nodes in the API's order, as its first
    list gave them)."""
    view = ClusterView(track_host=True)
    view.replace_nodes(json.loads(core.list_node(_preload_content=False).data)["items"])
    pods = json.loads(core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
    # what the extender's one pod watch selects: every pod with a node that has not ended
    view.replace_assigned_pages(
        [
            [
                p
                for p in pods
                if p["spec"].get("nodeName") and p["status"].get("phase") not in ("Succeeded", "Failed")
            ]
        ]
    )
    return view


def probe_request(view: ClusterView, policy: Policy, body: dict[str, Any], uid: str) -> Any:
    """`body` (a pod not created yet) as the extender's request, the uid given."""
    return Extender(view, policy, None).pod_request({**body, "metadata": {**body["metadata"], "uid": uid}})


def test_kube_scheduler_binds_where_schedule_picks(
    cluster: realk8s.ControlPlane, ns: str, sfx: str, tmp_path: Path, kubelet: Any
) -> None:
    core = cluster.core
    # nodes that differ in GPUs and CPU, one with most of its CPU taken by a pod of nobody's; "f" has
    # CPU to spare beyond its GPUs' needs (the policy keeps the rest of a node's CPU for its free GPUs)
    shapes = {"a": ("16", 8), "b": ("96", 8), "c": ("32", 4), "d": ("64", 8), "e": ("48", 2), "f": ("192", 2)}
    for k, (cpu, n) in shapes.items():
        name = f"kb-{k}-{sfx}"
        labels = {LABEL_GPU_NODE: "true", LABEL_GPU_MODEL: MODEL, LABEL_GPU_COUNT: str(n)}
        cluster.make_node(name, cpu=cpu, extended={RES_GPU: str(SLOTS_PER_GPU * n)}, labels=labels,
                          annotations={ANN_INVENTORY: inventory(name, n, H100_MIB, MODEL).to_json()})  # fmt: skip
    create_plain(core, plain_pod("hog", f"kb-d-{sfx}", "56", "8Gi"), ns)
    wl = tmp_path / "workload.json"
    wl.write_text(json.dumps(workload_to_json(WORKLOAD)))
    kc = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    flags = ("--filter-keep-best", "1", "--workload-file", str(wl), "--policy-seed", "5")
    ext = ExtenderProcess(kc, tmp_path / "extender.log", *flags)
    proc = None
    try:
        ext.wait_ready()
        proc = cluster.start_scheduler(realk8s.gpupack_scheduler_config(ext.url), name="kb-scheduler")
        sim = get_policy("gpupack", seed=5, workload=WORKLOAD)
        asks = [(1, 300, "4"), (1, None, "8"), (2, None, "24"), (1, 500, "2"), (1, 300, "4"), (1, None, "8"),
                (2, None, "24"), (1, 300, "12"), (1, 700, "4"), (1, None, "30")]  # fmt: skip
        chosen = []
        for i, (gpus, sm, cpu) in enumerate(asks):
            c = container(
                "c", gpu=gpus, mem=None if sm is None else 8000, sm=None if sm is None else sm // 10
            )
            c["resources"]["requests"]["cpu"] = cpu
            body = pod_obj(f"p{i}", [c], namespace=ns)
            view = mirror(core)
            req = probe_request(view, sim, body, f"probe-{i}")
            want = schedule(view.state.clone(), req, sim, commit=False)
            assert want.node is not None and want.fit is not None, (i, want.failures)
            create_pod(core, body, ns)

            def done(name: str = f"p{i}") -> dict | None:
                p = get_pod(core, ns, name)
                return (
                    p
                    if p["spec"].get("nodeName") and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE
                    else None
                )

            try:
                pod = until(done, 30, f"pod p{i} bound, its handoff done", interval=0.1)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{proc.tail(3000)}\n{ext.tail()}") from None
            assert pod["spec"]["nodeName"] == want.node, (i, pod["spec"]["nodeName"], want.node)
            a = decode_assignment(annotations(pod)[ANN_ASSIGNMENT])
            gpus_of = view.state.nodes[want.node].gpus
            want_uuids = {gpus_of[s.gpu_index].uuid for s in want.fit.placement.containers["c"]}
            assert {s.uuid for s in a.containers["c"]} == want_uuids, (i, a, want.fit)
            chosen.append(want.node)
            ext.wait_no_pending_handoffs()  # its watch sees the handoff end before the next pod's filter
        # the policy spread over several nodes and used the CPU-rich ones: not a first-node-always pick
        assert len(set(chosen)) >= 2, chosen

        # A CPU-only pod of the profile is the policy's too: bound where schedule() picks, by the
        # extender (no assignment, no handoff: it never meets the device plugin) ...
        c = container("c")
        c["resources"]["requests"].update(cpu="20", memory="4Gi")
        body = pod_obj("cpu-only", [c], namespace=ns)
        view = mirror(core)
        req = probe_request(view, sim, body, "probe-c")
        assert not req.needs_gpu
        want = schedule(view.state.clone(), req, sim, commit=False)
        assert want.node is not None, want.failures
        create_pod(core, body, ns)
        pod = until(lambda: (p := get_pod(core, ns, "cpu-only"))["spec"].get("nodeName") and p, 30,
                    "the CPU-only pod bound", interval=0.1)  # fmt: skip
        assert pod["spec"]["nodeName"] == want.node, (pod["spec"]["nodeName"], want.node)
        assert not {ANN_ASSIGNMENT, ANN_HANDOFF} & set(annotations(pod)), annotations(pod)
        assert LABEL_MANAGED not in (pod["metadata"].get("labels") or {})
        # the extender counts a bind after the API server took the Binding
        until(lambda: ext.metric("gpupack_extender_binds_total ") == 11.0, 10, "bound by the extender")
        # ... and a GPU pod sent right after to a node where one was just bound is not held up by it
        # (the policy put the one above where no GPU was left free: here both go to a node with room,
        # and CPU to spare beyond its free GPUs' needs, which the policy keeps from CPU-only pods)
        small = container("c")
        small["resources"]["requests"].update(cpu="1", memory="1Gi")
        body = pod_obj("cpu-pinned", [small], namespace=ns)
        view = mirror(core)
        small_req = probe_request(view, sim, body, "probe-s")
        free = min(
            n
            for n, nd in view.state.nodes.items()
            if n.startswith("kb-") and any(g.empty for g in nd.gpus) and sim.refuses(nd, small_req) is None
        )
        pin = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [free]}]}]}}}  # fmt: skip
        body["spec"]["affinity"] = pin
        g = container("c", gpu=1, mem=8000, sm=30)
        after = pod_obj("after", [g], namespace=ns)
        after["spec"]["affinity"] = pin
        t0 = time.monotonic()
        create_pod(core, body, ns)
        create_pod(core, after, ns)
        try:
            pod = until(lambda: (p := get_pod(core, ns, "after"))["spec"].get("nodeName")
                        and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE and p, 30,
                        "the GPU pod bound next to it, its handoff done", interval=0.1)  # fmt: skip
        except AssertionError as e:
            p = get_pod(core, ns, "after")
            raise AssertionError(
                f"{e}\n{p['spec'].get('nodeName')} {p['status']}\n{proc.tail(3000)}\n{ext.tail()}"
            ) from None
        assert pod["spec"]["nodeName"] == free and time.monotonic() - t0 < 4.0
        pinned = get_pod(core, ns, "cpu-pinned")
        assert pinned["spec"].get("nodeName") == free, pinned["status"]
    finally:
        if proc is not None:
            proc.stop()
        ext.stop()
