"""End to end on the production path: defrag reserves a GPU and evicts through the real Eviction
API; the real ReplicaSet controller creates the replacement; the real kube-scheduler (configured
by deploy/scheduler/config.yaml) asks the real extender, which places it on the reserved GPU; the
kubelets (emulated, with the device plugin's handoff) run it."""

from __future__ import annotations

import json
import threading
import time

import pytest
from defrag_cluster import Fleet, Scheduling, allocate, running_not_ready_status
from realk8s import running_ready_status

from extender.controllers.defrag.cli import main
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, ANN_RESERVATIONS, HANDOFF_DONE, decode_assignment


@pytest.fixture
def fleet_ns(fleet: Fleet) -> str:
    return fleet.namespace("batch")


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_the_extender_places_each_replacement_on_its_reserved_gpu(
    cluster, fleet, fleet_ns, kubeconfig, capsys, tmp_path
):
    ns = fleet_ns
    n1, n2 = fleet.node("n1", 4), fleet.node("n2", 2)
    _, (anchor,) = fleet.deployment(ns, "anchor", 50000, 50)
    fleet.place(ns, anchor, n1, 0, 50000, 50)
    rs1, (w1,) = fleet.deployment(ns, "w1", 8000, 10)
    fleet.place(ns, w1, n1, 1, 8000, 10)
    # A StatefulSet's replacement keeps the pod's name (new UID) and appears only once the old
    # pod is gone.
    w2 = fleet.statefulset(ns, "w2", 8000, 10)
    fleet.place(ns, w2, n2, 0, 8000, 10)
    lonely = fleet.bare_pod(ns, "lonely", 8000, 10)
    fleet.place(ns, lonely, n2, 1, 8000, 10)
    uids = {k: p["metadata"]["uid"] for k, p in fleet.pods(ns).items()}
    metrics = tmp_path / "m.prom"

    sched = Scheduling(cluster, tmp_path, ns)
    try:
        rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, "--apply", "--json",
                   "--move-timeout", "30", "--poll-interval", "0.1", "--metrics-file", str(metrics)])  # fmt: skip
        out, err = capsys.readouterr()
        assert rc == 0, (err, sched.logs())
        doc = json.loads(out)
        plan, result = doc["plan"], doc["result"]
        assert plan["evictions"] == 2 and plan["gpus_freed"] == 2
        assert {m["owner"] for m in plan["moves"]} == {f"ReplicaSet/{rs1}", "StatefulSet/w2"}
        assert [m["outcome"] for m in result["moves"]] == ["done", "done"], sched.logs()
        assert all(m["on_reservation"] for m in result["moves"]), sched.logs()
        assert not sched.kubelets.errors, sched.logs()
    finally:
        sched.stop()
    pods = fleet.pods(ns)
    for move, res in zip(plan["moves"], result["moves"], strict=True):
        pod = pods[res["replacement"]]
        ann = pod["metadata"]["annotations"]
        a = decode_assignment(ann[ANN_ASSIGNMENT])
        assert pod["spec"]["nodeName"] == move["to_node"]
        assert sorted(a.gpu_uuids()) == move["to_gpus"]
        assert a.reservation.endswith(f"-{move['step']}")
        assert ann[ANN_HANDOFF] == HANDOFF_DONE
        assert pod["status"]["phase"] == "Running" and ready(pod)
        assert pod["metadata"]["uid"] != uids[move["pod"]]
        evicted = pods.get(move["pod"])
        assert evicted is None or evicted["metadata"]["uid"] != uids[move["pod"]], "the evicted pod is gone"
    assert sorted(result["gpus_freed"]) == sorted(
        f"{g['node']}/{u}" for g in plan["groups"] for u in g["gpus_freed"]
    )
    for n in (n1, n2):
        assert ANN_RESERVATIONS not in fleet.node_annotations(n)
    assert pods[f"{ns}/{lonely}"]["metadata"]["uid"] == uids[f"{ns}/{lonely}"], "the bare pod stayed"
    reasons = [e["reason"] for e in fleet.defrag_events(ns)]
    assert reasons.count("DefragEvicted") == 2 and reasons.count("DefragMoved") == 2
    assert "DefragFreedGPUs" in reasons
    text = metrics.read_text()
    assert "gpupack_defrag_gpus_freed 2.0" in text
    assert 'gpupack_defrag_evictions_total{result="evicted"} 2.0' in text


def test_a_move_waits_until_the_replacement_is_ready(cluster, fleet, fleet_ns, kubeconfig, capsys, tmp_path):
    """Running is not enough: a replacement that has not passed readiness serves nothing yet (and a
    PodDisruptionBudget does not count it), so the move is not finished and its reservation stays."""
    ns = fleet_ns
    n1 = fleet.node("n1", 4)
    _, (anchor,) = fleet.deployment(ns, "anchor", 50000, 50)
    fleet.place(ns, anchor, n1, 0, 50000, 50)
    _, (w1,) = fleet.deployment(ns, "w1", 8000, 10)
    fleet.place(ns, w1, n1, 1, 8000, 10)
    seen: dict[str, object] = {}

    def slow_start(core, pod) -> None:
        allocate(core, pod)
        core.patch_namespaced_pod_status(pod.metadata.name, ns, running_not_ready_status(pod))

        def become_ready() -> None:
            time.sleep(2.0)
            # What defrag shows while the replacement runs but is not ready yet.
            seen["reservation"] = ANN_RESERVATIONS in fleet.node_annotations(n1)
            seen["moved"] = [e["reason"] for e in fleet.defrag_events(ns) if e["reason"] == "DefragMoved"]
            core.patch_namespaced_pod_status(pod.metadata.name, ns, running_ready_status(pod))

        threading.Thread(target=become_ready, daemon=True).start()

    sched = Scheduling(cluster, tmp_path, ns, admit=slow_start, ready=False)
    try:
        rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, "--apply", "--json",
                   "--move-timeout", "30", "--poll-interval", "0.1"])  # fmt: skip
        out, err = capsys.readouterr()
        assert rc == 0, (err, sched.logs())
        assert not sched.kubelets.errors, sched.logs()
    finally:
        sched.stop()
    (move,) = json.loads(out)["result"]["moves"]
    assert move["outcome"] == "done" and move["on_reservation"]
    assert seen == {"reservation": True, "moved": []}, "the move was taken as done before the pod was Ready"
    assert ready(fleet.pods(ns)[move["replacement"]])
