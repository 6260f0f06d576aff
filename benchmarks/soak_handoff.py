"""Randomized soak of the bind -> Allocate handoff against the real kube-apiserver and kube-scheduler.

N pods of mixed shapes (shared GPUs of both classes, whole GPUs, two GPUs, two containers, an init
container before the app containers) arrive at the real kube-scheduler v1.28.7 running gpupack's
shipped profile, which calls the real `gpupack extender`. Meanwhile some pods are deleted while their
handoff is pending, the active extender is SIGKILLed and restarted, and leadership moves from one
scheduler + extender pair to another (the Lease the extenders are fenced by changes holder while the
old pair is still running, as at a real hand-over).

The kubelets (`--kubelet`):
- `device-manager` (default): each node admits through the kubelet's real device manager
  (`devicemanager-harness`, one run per pod, one pod at a time per node, nodes in parallel) and a
  real `gpupack device-plugin` process per node (the tests' fake NVML), which publishes the node's
  inventory; every container's env from the device manager is compared with
  `handoff.container_env` of its assignment, and the plugin of a random node is SIGKILLed and
  restarted twice mid-run (between two admissions, with pods bound there waiting). A pod whose
  admission fails is set Failed, as the kubelet does. Harness runs cost ~1-2 s each: size it at
  ~100 pods on 6-8 nodes.
- `emulator`: the device plugin's side of the handoff is emulated in-process
  (tests/extender/ext_helpers.DevicePluginEmulator): fast (300 pods in ~30 s), no env, no plugin.

It ends with the figures that must be 0 — over-committed GPUs, pods whose allocation differs from
their assignment, pods whose env differs from their assignment, admissions refused, nodes over their
`gpupack.io/gpu` slots, locked nodes — and the throughput:

    python benchmarks/soak_handoff.py [--kubelet device-manager|emulator] [--pods 100] [--nodes 8]
                                      [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "extender"))

import dm_nodes  # noqa: E402
import realk8s  # noqa: E402
from ext_helpers import (  # noqa: E402
    DevicePluginEmulator,
    annotations,
    container,
    create_pod,
    gpu_node,
    kill_tree,
    list_pods,
    pod_obj,
)
from kubernetes import client  # noqa: E402
from processes import ExtenderProcess, free_port  # noqa: E402

from deviceplugin.metrics import reserved_by_gpu  # noqa: E402
from gpupack import handoff  # noqa: E402
from gpupack.contract import (  # noqa: E402
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    RES_GPU,
    ContractError,
    decode_allocated,
    decode_assignment,
    decode_inventory,
    parse_int_quantity,
)

NS = "soak"
LEASE_NS, LEASE = "gpupack-system", "gpupack-scheduler"
GPUS_PER_NODE = 4
KUBELETS = ("device-manager", "emulator")


def shapes(rng: random.Random, i: int, ns: str = NS) -> dict[str, Any]:
    """One pod of a random shape."""
    cls = rng.choice(["online", "online", "offline"])
    kind = rng.choices(["share", "whole", "two", "pair", "init"], weights=[50, 8, 5, 17, 20])[0]
    mem = rng.choice([4000, 8000, 10000, 20000, 30000])
    sm = rng.choice([5, 10, 20, 30])
    name = f"{kind}-{i}"
    if kind == "share":
        return pod_obj(name, [container("c", 1, mem, sm)], cls=cls, namespace=ns)
    if kind == "whole":
        return pod_obj(name, [container("c", 1)], cls=cls, namespace=ns)
    if kind == "two":
        return pod_obj(name, [container("c", 2, mem, sm)], cls=cls, namespace=ns)
    if kind == "pair":
        return pod_obj(
            name, [container("a", 1, mem, sm), container("b", 1, mem // 2, sm)], cls=cls, namespace=ns
        )
    return pod_obj(
        name, [container("app", 1, mem, sm)], cls=cls, namespace=ns,
        init=[container("warmup", 1, rng.choice([2000, mem]), rng.choice([5, sm]))],
    )  # fmt: skip


class Leader:
    """The leader-election Lease the extenders are fenced by, renewed by its holder every 2 s as
    kube-scheduler's elector does (this machine gives every process one host name, so the
    schedulers here run without their own election and the Lease is written for them)."""

    def __init__(self, cp: realk8s.ControlPlane, holder: str, namespace: str = LEASE_NS) -> None:
        self.api = client.CoordinationV1Api(cp.new_api_client())
        self.holder, self.ns = holder, namespace
        self.stop = threading.Event()
        self._write()
        threading.Thread(target=self._run, daemon=True).start()

    def _write(self) -> None:
        t = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {
            "holderIdentity": f"{self.holder}_0f1e",
            "leaseDurationSeconds": 15,
            "renewTime": t,
            "acquireTime": t,
        }
        body = {"metadata": {"name": LEASE, "namespace": self.ns}, "spec": spec}
        for _ in range(5):
            try:
                cur = self.api.read_namespaced_lease(LEASE, self.ns)
                body["metadata"]["resourceVersion"] = cur.metadata.resource_version
                self.api.replace_namespaced_lease(LEASE, self.ns, body)
                return
            except client.ApiException as e:
                if e.status == 404:
                    self.api.create_namespaced_lease(self.ns, body)
                    return
                if e.status != 409:
                    raise

    def hand_over(self, holder: str) -> None:
        self.holder = holder
        self._write()

    def _run(self) -> None:
        while not self.stop.wait(2.0):
            with contextlib.suppress(Exception):
                self._write()


class Pair:
    """One scheduler replica: an extender (fenced by the Lease, identity `name`) and, while it
    leads, a kube-scheduler pointed at it."""

    def __init__(self, cp: realk8s.ControlPlane, tmp: Path, name: str, lease_ns: str = LEASE_NS) -> None:
        self.cp, self.tmp, self.name, self.lease_ns = cp, tmp, name, lease_ns
        self.port = free_port()
        self.kc = cp.write_kubeconfig(tmp / f"{name}.kubeconfig")
        self.starts = 0
        self.ext = self._start_ext()
        self.sched: realk8s.Proc | None = None

    def _start_ext(self) -> ExtenderProcess:
        self.starts += 1
        e = ExtenderProcess(
            self.kc, self.tmp / f"extender-{self.name}-{self.starts}.log",
            "--lease-namespace", self.lease_ns, "--lease-name", LEASE, "--identity", self.name,
            "--bind-wait-s", "3", "--sweep-interval-s", "1", "--stale-handoff-s", "60",
            "--log-level", "info",  # every bind failure with its reason, also a SIGKILLed one's
            # as shipped (deploy/scheduler/deployment.yaml): kube-scheduler binds where filter kept
            "--filter-keep-best", "1",
            port=self.port,
        )  # fmt: skip
        e.wait_ready(60)
        return e

    def restart_extender(self) -> float:
        """SIGKILL and restart; seconds it was away."""
        t0 = time.monotonic()
        kill_tree(self.ext.proc)
        self.ext = self._start_ext()
        return time.monotonic() - t0

    def start_scheduler(self) -> None:
        self.sched = self.cp.start_scheduler(
            realk8s.gpupack_scheduler_config(self.ext.url), name=f"gpupack-scheduler-{self.name}"
        )

    def stop(self) -> None:
        if self.sched is not None:
            self.sched.stop()
            self.sched = None
        self.ext.stop()


def check(pods: list[dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures that must be 0, over the pods left at the end (a Failed pod holds nothing: the
    caller counts refused admissions itself)."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in handoff.TERMINAL_PHASES]  # fmt: skip
    bound = [p for p in live if p["spec"].get("nodeName")]
    # GPUs and their memory as each node's inventory publishes them
    gpu_mem: dict[str, dict[str, int]] = {}
    for name, node in nodes.items():
        raw = (node["metadata"].get("annotations") or {}).get(ANN_INVENTORY)
        gpu_mem[name] = {g.uuid: g.mem_mib for g in decode_inventory(raw, name).gpus} if raw else {}
    over: list[str] = []
    for node in {p["spec"]["nodeName"] for p in bound}:
        for uuid, (mem, sm) in reserved_by_gpu(bound, node).items():
            if mem > gpu_mem.get(node, {}).get(uuid, 0) or sm > 100:
                over.append(f"{uuid}: {mem} MiB, {sm} % SM")
    classes: dict[str, set[str]] = {}
    wrong: list[str] = []
    for p in bound:
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        try:
            a = decode_assignment(annotations(p)[ANN_ASSIGNMENT])
            allocated = decode_allocated(annotations(p).get("gpupack.io/allocated", "[]"))
        except (KeyError, ContractError) as e:
            wrong.append(f"{key}: {e}")
            continue
        for shares in a.containers.values():
            for s in shares:
                classes.setdefault(s.uuid, set()).add(a.pod_class)
        view = handoff.pod_view(p)
        want = [c.name for c in handoff.gpu_containers(view)]
        problems = []
        if a.node != p["spec"]["nodeName"] or a.pod_uid != p["metadata"]["uid"]:
            problems.append(f"assignment for {a.node}/{a.pod_uid}")
        if annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE and allocated != want:
            problems.append(f"allocated {allocated}, GPU containers {want}")
        for c in handoff.gpu_containers(view):
            shares = a.containers.get(c.name, ())
            if len(shares) != c.gpu_count() or any(s.uuid not in gpu_mem.get(a.node, {}) for s in shares):
                problems.append(f"{c.name}: {shares}")
                continue
            exclusive = not ({"gpupack.io/gpu-mem", "gpupack.io/gpu-sm"} & set(c.limits))
            for s in shares:
                if exclusive:
                    ok = s.exclusive and s.mem_mib == gpu_mem[a.node][s.uuid] and s.sm_pct == 100
                else:
                    ok = (not s.exclusive and s.mem_mib == parse_int_quantity(c.limits.get("gpupack.io/gpu-mem", 0), "m")
                          and s.sm_pct == parse_int_quantity(c.limits.get("gpupack.io/gpu-sm", 0), "s"))  # fmt: skip
                if not ok:
                    problems.append(f"{c.name}: {s}")
            # the env the device plugin hands this container is a pure function of these shares
            env = handoff.container_env(shares)
            if env["NVIDIA_VISIBLE_DEVICES"] != ",".join(s.uuid for s in shares):
                problems.append(f"{c.name}: env {env}")
        if problems:
            wrong.append(f"{key}: {'; '.join(problems)}")
    mixed = [u for u, c in classes.items() if len(c) > 1]
    slots_over = []
    for name, node in nodes.items():
        have = int(node["status"]["allocatable"].get(RES_GPU, "0"))
        use = 0
        for p in bound:
            if p["spec"]["nodeName"] == name:
                cs = handoff.pod_view(p).containers
                use += max(
                    sum(c.gpu_count() for c in cs if not c.init),
                    max((c.gpu_count() for c in cs if c.init), default=0),
                )
        if use > have:
            slots_over.append(f"{name}: {use} > {have}")
    locked = sorted(
        {p["spec"]["nodeName"] for p in bound if annotations(p).get(ANN_HANDOFF) == HANDOFF_PENDING}
        | {f"(unbound) {p['metadata']['name']}" for p in live if not p["spec"].get("nodeName") and ANN_ASSIGNMENT in annotations(p)}
    )  # fmt: skip
    return {
        "overcommitted_gpus": len(over) + len(mixed), "overcommit_detail": over[:5] + mixed[:5],
        "allocation_mismatches": len(wrong), "mismatch_detail": wrong[:5],
        "nodes_over_slots": len(slots_over), "slots_detail": slots_over[:5],
        "locked_nodes": len(locked), "locked_detail": locked[:5],
        "bound_live": len(bound), "pending_live": len(live) - len(bound),
    }  # fmt: skip


def run(
    cp: realk8s.ControlPlane, tmp: Path, pods: int, nodes: int, seed: int,
    ns: str = NS, lease_ns: str = LEASE_NS, prefix: str = "soak", settle_s: float = 20.0,
    kubelet_mode: str = "device-manager", intruders: int = 0, late: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The soak on `cp`: pods in `ns`, nodes `<prefix>-<i>`, the Lease in `lease_ns`; it ends once
    nothing has changed for `settle_s` (pods that fit nowhere stay Pending). `kubelet_mode`:
    "device-manager" or "emulator" (see the module's doc). With the device manager, `intruders`
    `gpupack.io/gpu` pods gpupack never placed are put on nodes (preferably one with a pending
    handoff) and `late` pods are admitted late: their handoff is given up as the extender's janitor
    does after --stale-handoff-s, and their admission waits until another pod is bound to their node
    (or 8 s). Neither may start a container with a GPU (issue 31 item 1)."""
    if kubelet_mode not in KUBELETS:
        raise ValueError(f"kubelet_mode must be one of {KUBELETS}, got {kubelet_mode!r}")
    rng = random.Random(seed)
    cp.ensure_namespace(ns)
    cp.ensure_namespace(lease_ns)
    names = [f"{prefix}-{i}" for i in range(nodes)]
    dm: dict[str, dm_nodes.DeviceManagerNode] = {}
    try:
        if kubelet_mode == "device-manager":
            dm = dm_nodes.start_nodes(
                cp, names, GPUS_PER_NODE, cp.write_kubeconfig(tmp / "plugin.kubeconfig")
            )
        else:
            for n in names:
                gpu_node(cp, n, GPUS_PER_NODE)
        return _run(cp, tmp, pods, names, seed, rng, ns, lease_ns, settle_s, dm, intruders, late)
    finally:
        for node in dm.values():
            node.close(keep_logs=tmp / "nodes")


def _run(
    cp: realk8s.ControlPlane, tmp: Path, pods: int, names: list[str], seed: int, rng: random.Random,
    ns: str, lease_ns: str, settle_s: float, dm: dict[str, dm_nodes.DeviceManagerNode],
    intruders: int = 0, late: int = 0,
) -> dict[str, Any]:  # fmt: skip
    core = cp.core
    leader = Leader(cp, "replica-a", lease_ns)
    a, b = Pair(cp, tmp, "replica-a", lease_ns), Pair(cp, tmp, "replica-b", lease_ns)
    a.start_scheduler()
    events: list[str] = []
    deleted: set[str] = set()
    stop = threading.Event()
    plugin: DevicePluginEmulator | None = None
    kubelet: realk8s.KubeletEmulator
    if dm:
        kubelet = dm_kubelet = dm_nodes.DeviceManagerKubelet(cp, ns, dm).start()
    else:
        plugin = DevicePluginEmulator(cp, delay=0.2)
        kubelet = realk8s.KubeletEmulator(cp, ns, on_admit=plugin).start()

    def deleter() -> None:
        # delete pods whose handoff is pending (bound, not yet admitted): ~1 in 12 pods
        quota = max(1, pods // 12)
        while not stop.wait(0.1) and len(deleted) < quota:
            for p in list_pods(core, ns):
                if (p["spec"].get("nodeName") and annotations(p).get(ANN_HANDOFF) == HANDOFF_PENDING
                        and p["metadata"]["name"] not in deleted and rng.random() < 0.3):  # fmt: skip
                    with contextlib.suppress(client.ApiException):
                        core.delete_namespaced_pod(p["metadata"]["name"], ns)
                        deleted.add(p["metadata"]["name"])
                    break

    threading.Thread(target=deleter, daemon=True).start()
    # issue 31 item 1: unplaced GPU pods and late admissions, spread over the run
    intruder_at = set(rng.sample(range(pods), min(intruders, pods))) if dm else set()
    late_at = set(rng.sample(range(1, pods), min(late, pods - 1))) if dm else set()
    intruder_names: list[str] = []
    late_names: list[str] = []
    if late_at:
        threading.Thread(
            target=_late_janitor, args=(core, ns, dm_kubelet, late_names, stop), daemon=True
        ).start()
    t0 = time.monotonic()
    active = a
    for i in range(pods):
        body = shapes(rng, i, ns)
        if i in late_at:  # held before it exists; the janitor looks at it once it does
            dm_kubelet.hold[body["metadata"]["name"]] = threading.Event()
        create_pod(core, body, ns)
        if i in late_at:
            late_names.append(body["metadata"]["name"])
        if i in intruder_at:
            intruder_names.append(_intruder(core, ns, names, len(intruder_names), rng))
        if i == pods // 4:
            events.append(
                f"extender {active.name} SIGKILLed and restarted ({active.restart_extender():.1f} s away)"
            )
        if dm and i in (pods // 3, 2 * pods // 3):
            events.append(dm_nodes.random_restart(dm, rng))
        if i == pods // 2:
            # hand-over: the Lease moves to replica-b while replica-a's scheduler still runs
            leader.hand_over("replica-b")
            b.start_scheduler()
            time.sleep(1.0)
            a.sched.stop()  # type: ignore[union-attr]  # it would exit on losing the Lease
            a.sched = None
            active = b
            events.append("leadership handed over replica-a -> replica-b (old pair running for 1 s)")
        if i == 3 * pods // 4:
            events.append(
                f"extender {active.name} SIGKILLed and restarted ({active.restart_extender():.1f} s away)"
            )
        time.sleep(rng.uniform(0, 0.02))
    created = time.monotonic()

    def progress() -> tuple[int, int, int]:
        """(handoffs done, pods, bound pods the kubelet has not yet admitted or refused)."""
        ps = list_pods(core, ns)
        done = sum(
            1 for p in ps if p["spec"].get("nodeName") and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE
        )
        bound = [p for p in ps if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
        if dm:
            with dm_kubelet.mu:
                seen = set(dm_kubelet.admitted) | set(dm_kubelet.rejected)
            waiting = sum(1 for p in bound if p["metadata"]["name"] not in seen)
        else:
            waiting = sum(1 for p in bound if annotations(p).get(ANN_HANDOFF) == HANDOFF_PENDING)
        return done, len(ps), waiting

    # Settled: nothing changed for settle_s and no bound pod still waits for its admission (on a
    # loaded machine a node's device manager runs queue up for longer than settle_s). A pod whose
    # admission never comes is given up once nothing has changed for longer than the janitor's
    # --stale-handoff-s, and then counted (not_admitted, locked_nodes).
    last, still = progress(), time.monotonic()
    t_last_bind = time.monotonic()
    while time.monotonic() - created < 600:
        quiet = time.monotonic() - still
        if quiet >= max(settle_s, 90.0) or (quiet >= settle_s and last[2] == 0):
            break
        time.sleep(1.0)
        cur = progress()
        if cur != last:
            if cur[0] != last[0]:
                t_last_bind = time.monotonic()
            last, still = cur, time.monotonic()
        if cur[0] == cur[1] and cur[2] == 0:
            break
    stop.set()
    # a last janitor pass may be due: give stale state its grace, then look
    time.sleep(2.0)
    final = list_pods(core, ns)
    (tmp / "final-pods.json").write_text(json.dumps(final))  # managedFields say who wrote what, when
    node_objs = {n: json.loads(core.read_node(n, _preload_content=False).data) for n in names}
    out = check(final, node_objs)
    bound = sum(
        1 for p in final if p["spec"].get("nodeName") and annotations(p).get(ANN_HANDOFF) == HANDOFF_DONE
    )
    nodes = len(names)
    out.update(
        kubelet=("device-manager" if dm else "emulator"),
        pods=pods, nodes=nodes, gpus=nodes * GPUS_PER_NODE, seed=seed, deleted_mid_handoff=len(deleted),
        handoffs_done=bound, seconds=round(t_last_bind - t0, 1), pods_per_s=round(bound / max(t_last_bind - t0, 1e-9), 2),
        events=events, plugin_errors=plugin.errors[:5] if plugin else [], kubelet_errors=kubelet.errors[:5],
        env_mismatches=0, env_mismatch_detail=[], env_checked_containers=0, admissions=0,
        admissions_refused=0, refused_detail=[], not_admitted=0, not_admitted_detail=[],
    )  # fmt: skip
    if dm:
        with dm_kubelet.mu:
            refused = all_refused = dict(dm_kubelet.rejected)
            admitted = dict(dm_kubelet.admitted)
            out.update(
                env_mismatches=len(dm_kubelet.env_mismatches), env_mismatch_detail=dm_kubelet.env_mismatches[:5],
                env_checked_containers=dm_kubelet.env_checked, admissions=dm_kubelet.harness_runs,
                harness_s_mean=round(dm_kubelet.harness_s / max(dm_kubelet.harness_runs, 1), 2),
                plugin_restarts=sum(n.plugin_starts - 1 for n in dm.values()),
            )  # fmt: skip
        # intruders and late pods are refused by design; any other refusal counts
        expected = set(intruder_names) | set(late_names)
        started = dict(dm_kubelet.started)
        out.update(
            intruders=len(intruder_names), late=len(late_names),
            intruders_started=sum(started.get(n, 0) for n in intruder_names),
            late_started=sum(started.get(n, 0) for n in late_names),
            intruders_refused=sum(n in refused for n in intruder_names),
            late_refused=sum(n in refused for n in late_names),
            **_plugin_log_figures(tmp, dm),
        )  # fmt: skip
        refused = {k: v for k, v in refused.items() if k not in expected}
        out["admissions_refused"] = len(refused)
        out["refused_detail"] = [f"{k}: {v}" for k, v in list(refused.items())[:3]]
        # every live pod whose handoff is done went through a device manager run that gave it its env
        unadmitted = [
            p["metadata"]["name"] for p in final
            if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
            and p["metadata"]["name"] not in admitted and p["metadata"]["name"] not in all_refused
        ]  # fmt: skip
        out["not_admitted"] = len(unadmitted)
        out["not_admitted_detail"] = unadmitted[:5]
    pending = [
        p for p in final if not p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    ]
    out["pending_detail"] = {
        p["metadata"]["name"]: [e.message for e in core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={p['metadata']['name']},reason=FailedScheduling").items][-1:]
        for p in pending[:5]
    }  # fmt: skip
    out["binds_refused_not_leader"] = {
        pair.name: sum(
            float(line.rsplit(" ", 1)[1])
            for line in pair.ext.http.get(pair.ext.url + "/metrics", timeout=5).text.splitlines()
            if line.startswith('gpupack_extender_bind_failures_total{reason="not-leader"}')
        )
        for pair in (a, b)
    }
    # binds refused a fit that filter had passed (reason fit-*), by every extender that ran,
    # SIGKILLed ones too (from their logs): issue 31 item 7's figure
    failed_fit = [
        line.split(" gpupack.extender: ", 1)[-1]
        for log_file in sorted(tmp.glob("extender-*.log"))
        for line in log_file.read_text(errors="replace").splitlines()
        if " failed (fit-" in line
    ]
    out["binds_failed_fit"] = len(failed_fit)
    out["binds_failed_fit_detail"] = failed_fit[:5]
    kubelet.stop()
    leader.stop.set()
    for p in (a, b):
        p.stop()
    return out


def _intruder(core: client.CoreV1Api, ns: str, nodes: list[str], i: int, rng: random.Random) -> str:
    """A `gpupack.io/gpu` pod gpupack never placed (another scheduler's, put on a node by hand),
    on a node whose handoff is pending if there is one: the kubelet may admit it before that pod."""
    waiting = sorted({p["spec"]["nodeName"] for p in list_pods(core, ns) if p["spec"].get("nodeName")
                      and annotations(p).get(ANN_HANDOFF) == HANDOFF_PENDING and p["spec"]["nodeName"] in nodes})  # fmt: skip
    name = f"intruder-{i}"
    body = {
        "metadata": {"name": name, "namespace": ns},
        "spec": {"schedulerName": "default-scheduler", "nodeName": rng.choice(waiting or nodes),
                 "containers": [{"name": "main", "image": "busybox", "resources": {"limits": {RES_GPU: "1"}}}]},
    }  # fmt: skip
    core.create_namespaced_pod(ns, body, _preload_content=False)
    return name


def _late_janitor(
    core: client.CoreV1Api, ns: str, kubelet: dm_nodes.DeviceManagerKubelet, late: list[str],
    stop: threading.Event,
) -> None:  # fmt: skip
    """What the extender's janitor does to a handoff pending longer than --stale-handoff-s (marks it
    failed, so the node takes the next pod), for the pods in `late`, whose admission is held; each
    admission is let go once another pod is bound to its node after that, or after 8 s."""
    given_up: dict[str, tuple[str, float]] = {}
    seen: set[str] = set()  # listed once at least: missing from a later list means deleted
    while not stop.wait(0.2):
        pods = {p["metadata"]["name"]: p for p in list_pods(core, ns)}
        for name in list(late):
            ev = kubelet.hold[name]
            if ev.is_set():
                continue
            p = pods.get(name)
            if p is None and name not in seen:
                # created after this list was read (the name is added once its create returned):
                # not gone, not listed yet. Taken for deleted, its admission was let go at once, with
                # its handoff still pending, and its containers started (CI flake, late_started)
                continue
            seen.add(name)
            if p is None or p["metadata"].get("deletionTimestamp"):
                ev.set()
                continue
            node = p["spec"].get("nodeName")
            if name not in given_up:
                if node and annotations(p).get(ANN_HANDOFF) == HANDOFF_PENDING:
                    patch = {"metadata": {"resourceVersion": p["metadata"]["resourceVersion"],
                                          "annotations": handoff.failed_annotations()}}  # fmt: skip
                    with contextlib.suppress(client.ApiException):  # 409: look again next round
                        core.patch_namespaced_pod(name, ns, patch)
                        given_up[name] = (node, time.monotonic())
                continue
            node, since = given_up[name]
            next_bound = any(
                q["spec"].get("nodeName") == node and n != name and n not in given_up
                and annotations(q).get(ANN_HANDOFF) == HANDOFF_PENDING for n, q in pods.items()
            )  # fmt: skip
            if next_bound or time.monotonic() - since > 8:
                ev.set()
    for name in late:
        kubelet.hold[name].set()


def _plugin_log_figures(tmp: Path, dm: dict[str, dm_nodes.DeviceManagerNode]) -> dict[str, int]:
    """PreStartContainer's refusals and repairs, from every plugin's log (killed ones too)."""
    lines = [line for n in dm.values() for f in sorted(n.dirs.base.glob("plugin-*.log"))
             for line in f.read_text(errors="replace").splitlines()]  # fmt: skip
    return {
        "prestart_accepted": sum("PreStartContainer: pod" in x and "may start" in x for x in lines),
        "prestart_refused": sum("PreStartContainer(" in x and "refused" in x for x in lines),
        "records_repaired": sum("repaired pod" in x for x in lines),
    }


FIGURES_ZERO = ("overcommitted_gpus", "allocation_mismatches", "env_mismatches", "admissions_refused",
                "not_admitted", "nodes_over_slots", "locked_nodes")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubelet", choices=KUBELETS, default="device-manager")
    ap.add_argument("--pods", type=int, default=None, help="default 100 with the device manager, else 300")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--intruders", type=int, default=0, help="unplaced gpupack.io/gpu pods (device manager only)"
    )
    ap.add_argument("--late", type=int, default=0, help="pods admitted after their handoff was given up")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpupack-soak-"))
    cp = realk8s.ControlPlane(tmp).start()
    try:
        pods = args.pods or (100 if args.kubelet == "device-manager" else 300)
        out = run(cp, tmp, pods, args.nodes, args.seed, kubelet_mode=args.kubelet,
                  intruders=args.intruders, late=args.late)  # fmt: skip
    finally:
        cp.stop()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        keys = ["kubelet", "pods", "nodes", "gpus", "deleted_mid_handoff", "handoffs_done", "pending_live",
                "seconds", "pods_per_s", *FIGURES_ZERO]  # fmt: skip
        if out["kubelet"] == "device-manager":
            keys += ["admissions", "env_checked_containers", "harness_s_mean", "plugin_restarts",
                     "intruders", "intruders_started", "late", "late_started", "prestart_refused",
                     "records_repaired"]  # fmt: skip
        for k in keys:
            print(f"{k:24} {out[k]}")
        for e in out["events"]:
            print(f"event: {e}")
        print(
            f"binds refused (not leader) {out['binds_refused_not_leader']} (counted since each extender's last start)"
        )
        for k in (
            "overcommit_detail",
            "mismatch_detail",
            "env_mismatch_detail",
            "refused_detail",
            "not_admitted_detail",
            "slots_detail",
            "locked_detail",
            "plugin_errors",
            "kubelet_errors",
            "pending_detail",
        ):
            if out[k]:
                print(f"{k}: {out[k]}")
    bad = sum(out[k] for k in FIGURES_ZERO)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
