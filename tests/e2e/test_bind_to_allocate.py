"""End to end over real sockets: kube API (HTTP) <- real extender process (gunicorn) <- scheduler
calls (filter, bind); device plugin (gRPC on a unix socket, FakeNvml) <- test kubelet (serial
admission, Allocate per GPU container). The node inventory comes from the device plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from e2e_helpers import REPO, Extender, Node, until, write_kubeconfig
from kubernetes import client

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    SCHEDULER_NAME,
    Assignment,
    GPUShare,
    decode_allocated,
    decode_assignment,
    decode_inventory,
)
from gpupack.testing.kubeapi import KubeAPIServer

pytestmark = pytest.mark.timeout(120)

NS = "default"
BIND_WAIT_S = 10.0
NODE_A = "node-a"
FINALIZER = "e2e.gpupack.io/kubelet-confirms"
MERGE = "application/merge-patch+json"


@dataclass(frozen=True)
class C:
    """A container's gpupack request; mem None = whole GPUs."""

    name: str
    gpus: int = 1
    mem: int | None = None
    sm: int | None = None


def container(c: C) -> dict[str, Any]:
    limits = {RES_GPU: str(c.gpus)}
    if c.mem is not None:
        limits |= {RES_GPU_MEM: str(c.mem), RES_GPU_SM: str(c.sm)}
    return {
        "name": c.name,
        "image": "registry.invalid/x:1",
        "resources": {"limits": limits, "requests": limits},
    }


def make_pod(
    core: client.CoreV1Api, name: str, containers: list[C], init: Sequence[C] = (), plain: int = 0
) -> None:
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER_NAME,
        "containers": [container(c) for c in containers]
        + [{"name": f"log{i}", "image": "registry.invalid/log:1"} for i in range(plain)],
    }
    if init:
        spec["initContainers"] = [container(c) for c in init]
    core.create_namespaced_pod(NS, {"metadata": {"name": name, "namespace": NS}, "spec": spec})


def read_pod(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    return json.loads(core.read_namespaced_pod(name, NS, _preload_content=False).data)


def annotations(core: client.CoreV1Api, name: str) -> dict[str, str]:
    return read_pod(core, name)["metadata"].get("annotations") or {}


# --- kube-scheduler's side --------------------------------------------------------------------------
def filter_pod(ext: Extender, core: client.CoreV1Api, name: str, nodes: list[str]) -> tuple[list[str], str]:
    out = ext.post("filter", {"Pod": read_pod(core, name), "NodeNames": nodes})
    failed = {**(out.get("FailedNodes") or {}), **(out.get("FailedAndUnresolvableNodes") or {})}
    return list(out.get("NodeNames") or []), out.get("Error") or "; ".join(
        f"{n}: {r}" for n, r in failed.items()
    )


def bind_pod(ext: Extender, core: client.CoreV1Api, name: str, node: str) -> str:
    uid = read_pod(core, name)["metadata"]["uid"]
    return (
        ext.post("bind", {"PodName": name, "PodNamespace": NS, "PodUID": uid, "Node": node}).get("Error")
        or ""
    )


def schedule(ext: Extender, core: client.CoreV1Api, name: str, node: str, rounds: int = 3) -> str:
    """Filter then bind, retrying a failed bind as kube-scheduler does; "" when bound, else why not."""
    why = ""
    for _ in range(rounds):
        ok, why = filter_pod(ext, core, name, [node])
        if not ok:
            return why or "filter rejected the node without a reason"
        why = bind_pod(ext, core, name, node)
        if not why:
            return ""
        time.sleep(0.1)
    return f"bind kept failing: {why}"


# --- the cluster --------------------------------------------------------------------------------
@dataclass
class Cluster:
    api: KubeAPIServer
    core: client.CoreV1Api
    kubeconfig: Any
    tmp: Any
    ext: Extender
    a: Node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("e2e")
    api = KubeAPIServer(bookmark_interval=0.5).start()
    nodes: list[Node] = []
    ext = None
    try:
        core = client.CoreV1Api(api.api_client())
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", api.url)
        # The extender boots (a few seconds) while the device plugins come up.
        ext = Extender(kubeconfig, tmp / "extender-1.log", "--bind-wait-s", str(BIND_WAIT_S))
        nodes.append(Node(core, api.api_client(), NODE_A, gpus=8))
        ext.wait_ready()
        yield Cluster(api, core, kubeconfig, tmp, ext, nodes[0])
    finally:
        if ext is not None:
            ext.stop()
        for n in nodes:
            n.stop()
        api.stop()


# --- scenario A: twenty pods at once on one node --------------------------------------------------
H200_MIB = 143771
SHARES = [(20000, 20), (30000, 30), (60000, 50), (100000, 80), (10000, 10)]


def pods_a() -> dict[str, tuple[list[C], list[C], int]]:
    """name -> (init containers, containers, plain containers). SM asked for (> 800%) exceeds the
    node's 8 GPUs, so some pods cannot fit whatever the order."""
    pods: dict[str, tuple[list[C], list[C], int]] = {
        "a-whole": ([], [C("main")], 0),
        "a-multi": ([C("warmup", 1, 10000, 20)], [C("server", 1, 30000, 30), C("sidecar", 1, 8000, 10)], 1),
        "a-two-gpu": ([], [C("main", 2, 40000, 40)], 0),
    }
    for i in range(17):
        mem, sm = SHARES[i % len(SHARES)]
        pods[f"a-{i:02d}-{mem // 1000}g-{sm}pct"] = ([], [C("main", 1, mem, sm)], 0)
    return pods


@dataclass
class ScenarioA:
    pods: dict[str, tuple[list[C], list[C], int]]
    outcome: dict[str, str]  # name -> "" when bound, else the reason it was not
    seconds: float


@pytest.fixture(scope="module")
def scenario_a(cluster: Cluster) -> ScenarioA:
    core, ext, node = cluster.core, cluster.ext, cluster.a
    node.admit()
    pods = pods_a()
    for name, (init, cs, plain) in pods.items():
        make_pod(core, name, cs, init, plain)
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(pods)) as pool:
        outcome = dict(zip(pods, pool.map(lambda n: schedule(ext, core, n, NODE_A), pods), strict=True))
    bound = [n for n, why in outcome.items() if not why]
    until(
        lambda: all(annotations(core, n).get(ANN_HANDOFF) == HANDOFF_DONE for n in bound),
        20,
        f"handoff=done on every bound pod: {[(n, annotations(core, n).get(ANN_HANDOFF)) for n in bound]}",
    )
    return ScenarioA(pods, outcome, time.monotonic() - t0)


def charge(a: Assignment, init_names: set[str]) -> dict[str, tuple[int, int, bool]]:
    """Per GPU what a pod holds: app containers add up, an init container runs before them."""
    app: dict[str, list] = defaultdict(lambda: [0, 0, False])
    peak: dict[str, list] = defaultdict(lambda: [0, 0, False])
    for cname, shares in a.containers.items():
        for s in shares:
            acc = peak if cname in init_names else app
            if cname in init_names:
                acc[s.uuid][0], acc[s.uuid][1] = max(acc[s.uuid][0], s.mem_mib), max(acc[s.uuid][1], s.sm_pct)
            else:
                acc[s.uuid][0] += s.mem_mib
                acc[s.uuid][1] += s.sm_pct
            acc[s.uuid][2] |= s.exclusive
    return {
        u: (max(app[u][0], peak[u][0]), max(app[u][1], peak[u][1]), app[u][2] or peak[u][2])
        for u in set(app) | set(peak)
    }


def check_env(where: str, want: C, shares: tuple[GPUShare, ...], env: dict[str, str]) -> None:
    uuids = [s.uuid for s in shares]
    assert len(set(uuids)) == want.gpus, f"{where}: assigned {uuids}, asked for {want.gpus} GPUs"
    assert env.get("NVIDIA_VISIBLE_DEVICES") == ",".join(uuids), f"{where}: env {env} vs assignment {uuids}"
    if want.mem is None:
        assert all(s.exclusive for s in shares), f"{where}: whole GPU not exclusive: {shares}"
        limits = sorted(k for k in env if k.startswith(("CUDA_DEVICE_", "CUDA_MPS_")))
        assert not limits, f"{where}: a whole GPU got limits {limits}"
        return
    for i, s in enumerate(shares):
        assert (s.mem_mib, s.sm_pct, s.exclusive) == (want.mem, want.sm, False), (
            f"{where}: share {s} vs {want}"
        )
        assert env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{i}") == f"{want.mem}m", f"{where}: env {env}"
    assert env.get("CUDA_DEVICE_SM_LIMIT") == str(want.sm), f"{where}: env {env}"
    assert f"CUDA_DEVICE_MEMORY_LIMIT_{want.gpus}" not in env, f"{where}: env {env}"


def test_twenty_pods_at_once_get_exactly_their_assigned_gpus(cluster: Cluster, scenario_a: ScenarioA) -> None:
    core, kubelet = cluster.core, cluster.a.kubelet
    inv = decode_inventory(cluster.a.read()["metadata"]["annotations"][ANN_INVENTORY], NODE_A)
    gpus = {g.uuid: g for g in inv.gpus}
    assert len(gpus) == 8 and {g.mem_mib for g in inv.gpus} == {H200_MIB}, inv
    bound = {n for n, why in scenario_a.outcome.items() if not why}
    unfit = {n: why for n, why in scenario_a.outcome.items() if why}
    assert len(bound) >= 12, f"only {sorted(bound)} bound; the rest: {unfit}"
    assert unfit, "more SM asked for than the node has, yet every pod was bound"
    for n, why in unfit.items():
        # a capacity reason, not a stuck handoff or a queue timeout
        assert "GPU" in why or "SM" in why or "memory" in why, f"{n}: unclear reason {why!r}"
        assert "waiting for the kubelet" not in why and "queued" not in why, f"{n}: {why}"
        assert ANN_ASSIGNMENT not in annotations(core, n), f"{n} was refused but keeps an assignment"
        assert not read_pod(core, n)["spec"].get("nodeName"), f"{n} was refused but is bound"

    admitted = {adm.pod_key.split("/", 1)[1]: adm for adm in kubelet.admissions.values()}
    assert set(admitted) == bound, f"kubelet admitted {sorted(admitted)}, extender bound {sorted(bound)}"
    used: dict[str, list] = defaultdict(lambda: [0, 0, []])
    for n in sorted(bound):
        init, cs, _ = scenario_a.pods[n]
        pod = read_pod(core, n)
        ann = pod["metadata"]["annotations"]
        assert pod["spec"]["nodeName"] == NODE_A and pod["status"].get("phase") == "Running", (
            n,
            pod["status"],
        )
        a = decode_assignment(ann[ANN_ASSIGNMENT], n)
        assert a.pod_uid == pod["metadata"]["uid"] and a.node == NODE_A, (n, a)
        names = [c.name for c in (*init, *cs)]
        assert sorted(a.containers) == sorted(names), (
            f"{n}: assignment containers {list(a.containers)} vs {names}"
        )
        assert sorted(decode_allocated(ann[ANN_ALLOCATED], n)) == sorted(names), (n, ann[ANN_ALLOCATED])
        adm = admitted[n]
        assert adm.ok and set(adm.envs) == set(names), f"{n}: admission {adm}"
        for c in (*init, *cs):
            check_env(f"{n}/{c.name}", c, a.containers[c.name], adm.envs[c.name])
        for uuid, (mem, sm, excl) in charge(a, {c.name for c in init}).items():
            assert uuid in gpus, f"{n}: GPU {uuid} is not on {NODE_A}"
            used[uuid][0] += mem
            used[uuid][1] += sm
            used[uuid][2].append(f"{n}{' (whole)' if excl else ''}")
    for uuid, (mem, sm, holders) in used.items():
        assert mem <= gpus[uuid].mem_mib and sm <= 100, (
            f"GPU {uuid} over-committed: {mem} MiB, {sm}% by {holders}"
        )
        if any("(whole)" in h for h in holders):
            assert len(holders) == 1, f"whole GPU {uuid} shared by {holders}"
    assert scenario_a.seconds < 2 * BIND_WAIT_S, f"scheduling and admission took {scenario_a.seconds:.1f}s"


def test_a_refused_pod_is_refused_again_at_filter_with_the_reason(
    cluster: Cluster, scenario_a: ScenarioA
) -> None:
    unfit = [n for n, why in scenario_a.outcome.items() if why]
    ok, why = filter_pod(cluster.ext, cluster.core, unfit[0], [NODE_A])
    assert ok == [] and NODE_A in why and ("SM" in why or "memory" in why or "GPU" in why), why


# --- scenario B: a pod deleted mid-handoff -----------------------------------------------------------
@pytest.mark.parametrize("deletion", ["immediate", "graceful"])
def test_pod_deleted_mid_handoff_does_not_block_the_next_bind(cluster: Cluster, deletion: str) -> None:
    """`graceful` is what a real API server does to a bound pod: it stays, with a
    deletionTimestamp, until its kubelet confirms (a finalizer holds it here)."""
    core, ext = cluster.core, cluster.ext
    node_name = f"node-b-{deletion}"
    node = Node(core, cluster.api.api_client(), node_name, gpus=2)  # not admitting yet
    gone, nxt, third = (f"b-{deletion}-{n}" for n in ("gone", "next", "third"))
    try:
        for n in (gone, nxt, third):
            make_pod(core, n, [C("main")])
        until(lambda: filter_pod(ext, core, gone, [node_name])[0], 5, f"the extender sees {node_name}")
        if deletion == "graceful":
            core.patch_namespaced_pod(gone, NS, {"metadata": {"finalizers": [FINALIZER]}})
        assert schedule(ext, core, gone, node_name) == ""
        ann = annotations(core, gone)
        assert ann[ANN_HANDOFF] == HANDOFF_PENDING
        gone_uuid = decode_assignment(ann[ANN_ASSIGNMENT]).containers["main"][0].uuid
        ok, why = filter_pod(ext, core, nxt, [node_name])
        assert ok == [node_name], why
        core.delete_namespaced_pod(gone, NS)
        node.admit()
        t0 = time.monotonic()
        assert bind_pod(ext, core, nxt, node_name) == ""
        bind_s = time.monotonic() - t0
        until(
            lambda: annotations(core, nxt).get(ANN_HANDOFF) == HANDOFF_DONE,
            BIND_WAIT_S / 2,
            f"{nxt} allocated",
        )
        total_s = time.monotonic() - t0
        assert total_s < BIND_WAIT_S / 3, f"bind {bind_s:.2f}s + allocate: {total_s:.2f}s; blocked by {gone}?"
        a = decode_assignment(annotations(core, nxt)[ANN_ASSIGNMENT])
        adm = {x.pod_key: x for x in node.kubelet.admissions.values()}
        assert f"{NS}/{gone}" not in adm and adm[f"{NS}/{nxt}"].ok, adm
        check_env(f"{nxt}/main", C("main"), a.containers["main"], adm[f"{NS}/{nxt}"].envs["main"])
        if deletion == "graceful":
            assert a.containers["main"][0].uuid != gone_uuid, "a GPU handed over while its pod still exists"
            # the kubelet confirms (a strategic-merge [] would leave a merge-strategy list as is)
            core.patch_namespaced_pod(gone, NS, {"metadata": {"finalizers": None}}, _content_type=MERGE)
        # The deleted pod's GPU is free again: a third whole-GPU pod fits, and the two live pods
        # hold both GPUs of the node, one each.
        # kube-scheduler retries an unschedulable pod when a pod leaves the node
        until(lambda: filter_pod(ext, core, third, [node_name])[0], 5, f"{gone} leaves the extender's view")
        assert schedule(ext, core, third, node_name) == ""
        until(
            lambda: annotations(core, third).get(ANN_HANDOFF) == HANDOFF_DONE,
            BIND_WAIT_S / 2,
            f"{third} allocated",
        )
        third_uuid = decode_assignment(annotations(core, third)[ANN_ASSIGNMENT]).containers["main"][0].uuid
        both = {g.uuid for g in decode_inventory(node.read()["metadata"]["annotations"][ANN_INVENTORY]).gpus}
        assert gone_uuid in both and {third_uuid, a.containers["main"][0].uuid} == both
    finally:
        node.stop()


# --- scenario C: a second extender rebuilds the same reservations ------------------------------------
def status_json(cluster: Cluster) -> dict[tuple[str, str], tuple[float, float]]:
    r = subprocess.run(
        [sys.executable, "-m", "gpupack", "status", "--json", "--kubeconfig", str(cluster.kubeconfig)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert not any(n["pending_handoffs"] for n in data["nodes"]), data
    return {
        (n["node"], g["uuid"]): (float(g["mem_reserved_mib"]), round(float(g["sm_reserved_pct"]), 1))
        for n in data["nodes"]
        for g in n["gpus"]
    }


def test_second_extender_rebuilds_the_same_reservations(cluster: Cluster, scenario_a: ScenarioA) -> None:
    before = cluster.ext.reserved()
    assert sum(mem for (node, _), (mem, _) in before.items() if node == NODE_A) > 0, before
    second = Extender(cluster.kubeconfig, cluster.tmp / "extender-2.log")
    try:
        assert status_json(cluster) == before  # while the second one boots
        second.wait_ready()
        until(
            lambda: second.reserved() == before,
            5,
            f"the same reservations from a second extender: {second.reserved()} vs {before}",
        )
        assert cluster.ext.reserved() == before
    finally:
        second.stop()
