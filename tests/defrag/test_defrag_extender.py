"""End to end: defrag reserves a GPU, evicts, and the real extender places the replacement there."""

from __future__ import annotations

import json

import pytest
from defrag_cluster import ExtenderProcess, SchedulerLoop

from extender.defrag.cli import main
from gpupack.contract import ANN_ASSIGNMENT, ANN_RESERVATIONS, decode_assignment


@pytest.fixture
def extender(kubeapi, kubeconfig, tmp_path):
    p = ExtenderProcess(kubeconfig, tmp_path / "extender.log")
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()


def test_the_extender_places_each_replacement_on_its_reserved_gpu(cluster, kubeapi, kubeconfig, extender, capsys,
                                                                   tmp_path):
    cluster.node("n1", 4)
    cluster.node("n2", 2)
    anchor = cluster.replicaset("batch", "anchor", 50000, 50)[0]
    cluster.place("batch", anchor, "n1", 0, 50000, 50)
    # The assignment names the reservation only when the extender steered the pod by it.
    w1 = cluster.replicaset("batch", "w1", 8000, 10)[0]
    cluster.place("batch", w1, "n1", 1, 8000, 10)
    w2 = cluster.replicaset("batch", "w2", 8000, 10)[0]
    cluster.place("batch", w2, "n2", 0, 8000, 10)
    lonely = cluster.bare_pod("batch", "lonely", 8000, 10)
    cluster.place("batch", lonely, "n2", 1, 8000, 10)
    lonely_uid = kubeapi.get("pods", lonely, "batch")["metadata"]["uid"]
    metrics = tmp_path / "m.prom"

    with SchedulerLoop(kubeapi, extender.url) as sched:
        rc = main(["--kubeconfig", str(kubeconfig), "--apply", "--json", "--move-timeout", "20",
                   "--poll-interval", "0.05", "--metrics-file", str(metrics)])
        out, err = capsys.readouterr()
    assert rc == 0, (err, sched.log)
    doc = json.loads(out)
    plan, result = doc["plan"], doc["result"]
    assert plan["evictions"] == 2 and plan["gpus_freed"] == 2
    assert [m["outcome"] for m in result["moves"]] == ["done", "done"], sched.log
    assert all(m["on_reservation"] for m in result["moves"])
    for move, res in zip(plan["moves"], result["moves"], strict=True):
        ns, name = res["replacement"].split("/")
        pod = kubeapi.get("pods", name, ns)
        a = decode_assignment(pod["metadata"]["annotations"][ANN_ASSIGNMENT])
        assert pod["spec"]["nodeName"] == move["to_node"]
        assert sorted(a.gpu_uuids()) == move["to_gpus"]
        assert a.reservation.endswith(f"-{move['step']}")
        assert (pod["status"] or {}).get("phase") == "Running"
    assert sorted(result["gpus_freed"]) == sorted(f"{g['node']}/{u}" for g in plan["groups"] for u in g["gpus_freed"])
    for n in ("n1", "n2"):
        assert ANN_RESERVATIONS not in kubeapi.get("nodes", n)["metadata"].get("annotations", {})
    assert kubeapi.get("pods", lonely, "batch")["metadata"]["uid"] == lonely_uid, "the bare pod stayed"
    reasons = [e["reason"] for e in cluster.events()]
    assert reasons.count("DefragEvicted") == 2 and reasons.count("DefragMoved") == 2
    assert "DefragFreedGPUs" in reasons
    text = metrics.read_text()
    assert "gpupack_defrag_gpus_freed 2.0" in text
    assert 'gpupack_defrag_evictions_total{result="evicted"} 2.0' in text
