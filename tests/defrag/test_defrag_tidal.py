"""The night run on the real control plane (issue 15): a PodDisruptionBudget-protected Deployment
whose replicas take a while to become Ready is moved several times in ONE run without ever having
more than one replica away; freed GPUs are counted once the evicted pods are really gone; and
`--objective nodes` empties a whole node, keeps it from being refilled while the run lasts, and
leaves it marked the way the cluster autoscaler understands."""

from __future__ import annotations

import contextlib
import json
import threading
import time

from defrag_cluster import Fleet, Scheduling, allocate, running_not_ready_status
from kubernetes import client
from realk8s import running_ready_status, until

from extender.controllers.defrag.cli import main
from extender.controllers.defrag.executor import CA_SCALE_DOWN_DISABLED, TAINT_KEY, TAINT_VALUE
from gpupack.contract import ANN_ASSIGNMENT, SCHEDULER_NAME, decode_assignment

HOLD = "gpupack.io/test-slow-termination"


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def gpus_in_use(fleet: Fleet, ns: str) -> set[str]:
    """GPU uuids some pod of `ns` holds (a terminating pod still holds its GPUs)."""
    out = set()
    for p in fleet.pods(ns).values():
        text = (p["metadata"].get("annotations") or {}).get(ANN_ASSIGNMENT)
        if text:
            out |= set(decode_assignment(text).gpu_uuids())
    return out


class Sampler(threading.Thread):
    """Samples, every few tens of ms, how many replicas of `app` are Ready and not terminating, and
    the PodDisruptionBudget's status, until stopped."""

    def __init__(self, fleet: Fleet, ns: str, app: str, pdb: str) -> None:
        super().__init__(daemon=True)
        self.fleet, self.ns, self.app, self.pdb = fleet, ns, app, pdb
        self.ready: list[int] = []
        self.allowed: list[int] = []
        self.errors: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        core = client.CoreV1Api(self.fleet.cp.new_api_client())
        policy = client.PolicyV1Api(core.api_client)
        while not self.halt.is_set():
            try:
                raw = json.loads(
                    core.list_namespaced_pod(
                        self.ns, label_selector=f"app={self.app}", _preload_content=False
                    ).data
                )
                self.ready.append(
                    sum(1 for p in raw["items"] if ready(p) and not p["metadata"].get("deletionTimestamp"))
                )
                st = policy.read_namespaced_pod_disruption_budget(self.pdb, self.ns).status
                self.allowed.append(st.disruptions_allowed if st else -1)
            except Exception as e:  # a sample lost is not a test failure; too many are
                self.errors.append(repr(e))
            time.sleep(0.03)


def release_slowly(fleet: Fleet, ns: str, after: float, halt: threading.Event) -> None:
    """A kubelet that takes `after` seconds to finish a pod's termination: the test's finalizer on
    the original pods is dropped that long after their deletion started."""
    core = client.CoreV1Api(fleet.cp.new_api_client())
    seen: dict[str, float] = {}
    while not halt.is_set():
        for p in json.loads(core.list_namespaced_pod(ns, _preload_content=False).data)["items"]:
            meta = p["metadata"]
            if HOLD not in (meta.get("finalizers") or []) or not meta.get("deletionTimestamp"):
                continue
            first = seen.setdefault(meta["uid"], time.monotonic())
            if time.monotonic() - first >= after:
                rest = [f for f in meta["finalizers"] if f != HOLD]
                core.patch_namespaced_pod(
                    meta["name"],
                    ns,
                    {"metadata": {"finalizers": rest or None, "resourceVersion": meta["resourceVersion"]}},
                )
        time.sleep(0.1)


def test_a_pdb_protected_deployment_moves_several_times_in_one_run(
    cluster, fleet, proxy, kubeconfig, capsys, tmp_path
):
    ns = fleet.namespace("web")
    n1, n2 = fleet.node("n1", 4), fleet.node("n2", 2)
    _, (anchor,) = fleet.deployment(ns, "anchor", 50000, 50)
    fleet.place(ns, anchor, n1, 0, 50000, 50)
    web_rs, web = fleet.deployment(ns, "web", 8000, 10, replicas=4)
    for pod, (node, gpu) in zip(web, [(n1, 1), (n1, 2), (n1, 3), (n2, 0)], strict=True):
        fleet.place(ns, pod, node, gpu, 8000, 10)
        # Each original pod terminates slowly (2.5 s, longer than a replacement takes to be Ready),
        # so the last evicted pod still holds its GPU when the last move is done.
        fleet.core.patch_namespaced_pod(pod, ns, {"metadata": {"finalizers": [HOLD]}})
    fleet.policy.create_namespaced_pod_disruption_budget(ns, {
        "metadata": {"name": "web-pdb"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    })  # fmt: skip
    until(
        lambda: (st := fleet.policy.read_namespaced_pod_disruption_budget("web-pdb", ns).status) is not None
        and st.expected_pods == 4 and st.disruptions_allowed == 1,
        30, "the disruption controller to compute web-pdb",
    )  # fmt: skip

    def slow_start(core, pod) -> None:
        """The replacement runs at once but passes readiness only 1 s later."""
        allocate(core, pod)
        core.patch_namespaced_pod_status(pod.metadata.name, ns, running_not_ready_status(pod))

        def later() -> None:
            time.sleep(1.0)
            core.patch_namespaced_pod_status(pod.metadata.name, ns, running_ready_status(pod))

        threading.Thread(target=later, daemon=True).start()

    halt = threading.Event()
    releaser = threading.Thread(target=release_slowly, args=(fleet, ns, 2.5, halt), daemon=True)
    sampler = Sampler(fleet, ns, "web", "web-pdb")
    metrics = tmp_path / "m.prom"
    sched = Scheduling(cluster, tmp_path, ns, admit=slow_start, ready=False)
    try:
        releaser.start()
        sampler.start()
        rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, "--apply", "--json",
                   "--max-workload-share", "1", "--max-per-node", "0", "--move-timeout", "30", "--budget-wait", "30",
                   "--settle-timeout", "30", "--poll-interval", "0.1", "--metrics-file", str(metrics)])  # fmt: skip
        out, err = capsys.readouterr()
        sampler.halt.set()
        sampler.join(5)
        assert rc == 0, (err, sched.logs())
        assert not sched.kubelets.errors, sched.logs()
    finally:
        halt.set()
        sampler.halt.set()
        sched.stop()
    doc = json.loads(out)
    plan, result = doc["plan"], doc["result"]
    assert plan["evictions"] == 3 and {m["owner"] for m in plan["moves"]} == {f"ReplicaSet/{web_rs}"}
    assert [m["outcome"] for m in result["moves"]] == ["done"] * 3, "the whole plan ran in one run"
    assert all(m["on_reservation"] for m in result["moves"])
    # Each eviction was sent once the budget allowed it: no 429 was collected on the way.
    assert proxy.count("POST", r"/pods/[^/]+/eviction$") == 3
    # Never more than one replica away: sampled while the run lasted.
    assert len(sampler.ready) > 20 and len(sampler.errors) < len(sampler.ready) / 10, sampler.errors[:3]
    assert min(sampler.ready) == 3, f"ready replicas seen: {sorted(set(sampler.ready))}"
    assert min(sampler.allowed) == 0 and max(sampler.allowed) == 1
    # Freed = what the cluster shows afterwards, in the output, the metric and the Events.
    planned = {f"{g['node']}/{u}" for g in plan["groups"] for u in g["gpus_freed"]}
    assert result["still_terminating"] == []
    assert set(result["gpus_freed"]) == planned and len(planned) == 3
    in_use = gpus_in_use(fleet, ns)
    assert not any(u.split("/", 1)[1] in in_use for u in result["gpus_freed"])
    assert all(not p["metadata"].get("deletionTimestamp") for p in fleet.pods(ns).values())
    assert "gpupack_defrag_gpus_freed 3.0" in metrics.read_text()
    freed_events = [e["message"] for e in fleet.defrag_events(ns) if e["reason"] == "DefragFreedGPUs"]
    assert sorted(
        u for m in freed_events for u in m.split("GPU(s) ")[1].split(" by ")[0].split(", ")
    ) == sorted(u.split("/", 1)[1] for u in planned)


def test_objective_nodes_empties_a_node_and_keeps_it_empty_while_the_run_lasts(
    cluster, fleet, kubeconfig, capsys, tmp_path
):
    ns = fleet.namespace("night")
    n1, n2, n3 = fleet.node("n1", 2), fleet.node("n2", 4), fleet.node("n3", 1)
    # n3 is one the operator keeps (cluster autoscaler convention): never worth emptying.
    fleet.core.patch_node(n3, {"metadata": {"annotations": {CA_SCALE_DOWN_DISABLED: "true"}}})
    for name, node, gpu, mem, sm in (("a1", n1, 0, 50000, 50), ("a2", n1, 1, 50000, 50),
                                     ("w1", n2, 0, 8000, 10), ("w2", n2, 1, 8000, 10), ("k", n3, 0, 50000, 50)):  # fmt: skip
        fleet.place(ns, fleet.replicaset(ns, name, mem, sm)[0], node, gpu, mem, sm)
    uids = {k: p["metadata"]["uid"] for k, p in fleet.pods(ns).items()}

    rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, "--objective", "nodes",
               "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["objective"] == "nodes" and doc["protected_nodes"] == [n3]
    why = {k: doc[k] for k in ("excluded", "movable")} | {"skipped": doc["plan"]["skipped"]}
    assert doc["plan"]["nodes_freed"] == [n2] and doc["plan"]["evictions"] == 2, why
    assert {m["to_node"] for m in doc["plan"]["moves"]} == {n1}

    # While the run lasts, a pod that would fit only on n2's idle GPUs arrives.
    seen: dict[str, list] = {"taint": [], "late_node_while_tainted": []}
    halt = threading.Event()

    errors: list[str] = []

    def watch() -> None:
        core = client.CoreV1Api(cluster.new_api_client())
        created = False
        while not halt.is_set():
            try:
                node = json.loads(core.read_node(n2, _preload_content=False).data)
                taints = [t for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]
                seen["taint"].append([(t["value"], t["effect"]) for t in taints])
                if taints and not created:
                    tpl = fleet.template("late", 40000, 40, "offline")
                    core.create_namespaced_pod(
                        ns, {"metadata": {"name": "late", **tpl["metadata"]}, "spec": tpl["spec"]}
                    )
                    created = True
                if taints and created:
                    late = json.loads(core.read_namespaced_pod("late", ns, _preload_content=False).data)
                    seen["late_node_while_tainted"].append(late["spec"].get("nodeName"))
            except Exception as e:  # a slow API server under load: note it and keep sampling
                errors.append(repr(e))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    sched = Scheduling(cluster, tmp_path, ns)
    try:
        watcher.start()
        rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, "--objective", "nodes",
                   "--apply", "--json", "--move-timeout", "30", "--poll-interval", "0.1"])  # fmt: skip
        out, err = capsys.readouterr()
        assert rc == 0, (err, sched.logs())
        applied = json.loads(out)
        result = applied["result"]
        halt.set()
        watcher.join(5)
        assert [m["outcome"] for m in result["moves"]] == ["done", "done"], sched.logs()
        # What the run saw, for a failure: a pod it could not move, and the nodes it chose.
        why = {k: applied[k] for k in ("excluded", "movable", "plan")}
        assert result["nodes_freed"] == [n2] and result["tainted"] == [n2] and result["taint_kept"] == [], why
        assert sorted(result["gpus_freed"]) == [f"{n2}/GPU-{n2}-0", f"{n2}/GPU-{n2}-1"]
        # what the cluster gained, counted before and after: w1 and w2 joined busy GPUs of n1
        counts = [
            result[k]
            for k in ("used_gpus_before", "used_gpus_after", "used_nodes_before", "used_nodes_after")
        ]
        assert counts == [5, 3, 3, 2], counts
        # Marked the cluster autoscaler's way while emptied: its status-taint prefix, NoSchedule.
        assert [(TAINT_VALUE, "NoSchedule")] in seen["taint"], (seen["taint"][-3:], errors[:3])
        assert seen["late_node_while_tainted"] and set(seen["late_node_while_tainted"]) == {None}, (
            "nothing was scheduled onto the node being emptied",
            errors[:3],
        )
        pods = fleet.pods(ns)
        assert not any(p["spec"].get("nodeName") == n2 for k, p in pods.items() if k != f"{ns}/late"), (
            "n2 ended with no moved pod"
        )
        stayed = {k: uids[k] for k, p in pods.items() if k in uids and p["spec"].get("nodeName") in (n1, n3)}
        assert len(stayed) == 3 and all(pods[k]["metadata"]["uid"] == u for k, u in stayed.items())
        node = fleet.core.read_node(n2)
        assert CA_SCALE_DOWN_DISABLED not in (node.metadata.annotations or {})
        assert not [t for t in node.spec.taints or [] if t.key == TAINT_KEY], (
            "the taint is gone after the run"
        )
        assert "DefragFreedNode" in {e["reason"] for e in fleet.defrag_events(ns)}

        # After the run nothing holds the node any more: the waiting pod takes it (an autoscaler
        # would remove it only if it stayed empty for its scale-down-unneeded-time).
        # kube-scheduler v1.28 does not retry a parked pod on a Node update when the pod asks for a
        # resource the scheduler leaves to an extender (gpupack.io/gpu-mem is no node's allocatable:
        # its node-event pre-check counts it as missing), so the taint's removal alone leaves the
        # late pod waiting for a pod event or the scheduler's 5-minute flush. An update of the pod
        # itself is such an event (what the extender does after a restart); it lands only if
        # nothing holds n2 any more.
        def late_on_n2() -> bool:
            late = fleet.pods(ns)[f"{ns}/late"]
            if late["spec"].get("nodeName") == n2:
                return True
            with contextlib.suppress(client.ApiException):
                fleet.core.patch_namespaced_pod("late", ns, {"metadata": {"annotations": {
                    "test.gpupack.io/retry-at": f"{time.monotonic():.1f}"}}})  # fmt: skip
            return False

        try:
            until(late_on_n2, 30, "the late pod on n2", interval=2.0)
        except AssertionError as e:
            late = fleet.pods(ns).get(f"{ns}/late")
            raise AssertionError((str(e), late and late.get("status"), sched.logs())) from None
        assert fleet.core.read_namespaced_pod("late", ns).spec.scheduler_name == SCHEDULER_NAME
    finally:
        halt.set()
        sched.stop()
