"""`gpupack defrag` against the in-test Kubernetes API over HTTP: dry run, caps, window, lease,
PodDisruptionBudgets, timeouts, ineligible pods."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta

import pytest
from defrag_cluster import wait_for

from extender.defrag.cli import main
from gpupack.contract import ANN_RESERVATIONS, decode_reservations

# n1: GPU0 anchor (50000 MiB, 50 %), GPU1 w1 (8000, 10 %), GPU2 w2 (8000, 10 %), GPU3 idle.
# The plan: w1 and w2 move onto GPU0; GPUs 1 and 2 become idle. Two evictions, two GPUs.


def seed(cluster, bare: bool = False) -> dict[str, str]:
    cluster.node("n1", 4)
    names = {}
    names["anchor"] = cluster.replicaset("batch", "anchor", 50000, 50)[0]
    cluster.place("batch", names["anchor"], "n1", 0, 50000, 50)
    names["w1"] = cluster.replicaset("batch", "w1", 8000, 10)[0]
    cluster.place("batch", names["w1"], "n1", 1, 8000, 10)
    if bare:
        names["w2"] = cluster.bare_pod("batch", "lonely", 8000, 10)
    else:
        names["w2"] = cluster.replicaset("batch", "w2", 8000, 10)[0]
    cluster.place("batch", names["w2"], "n1", 2, 8000, 10)
    return names


def run_cli(kubeconfig, *args: str, capsys=None) -> tuple[int, str, str]:
    rc = main(["--kubeconfig", str(kubeconfig), *args])
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return rc, out, err


def snapshot(server) -> str:
    return json.dumps({r: server.list(r) for r in ("pods", "nodes", "leases", "events")}, sort_keys=True)


def outside_window() -> str:
    now = datetime.now(UTC)
    a, b = now + timedelta(hours=2), now + timedelta(hours=3)
    return f"{a:%H:%M}-{b:%H:%M}"


def test_dry_run_prints_the_plan_and_changes_nothing(cluster, kubeapi, kubeconfig, capsys):
    seed(cluster)
    before = snapshot(kubeapi)
    kubeapi.clear_requests()
    rc, out, _ = run_cli(kubeconfig, capsys=capsys)
    assert rc == 0
    assert "2 eviction(s) free 2 whole GPU(s) (1.00 per eviction)" in out
    assert "batch/w1-" in out and "n1[GPU-n1-0]" in out
    rc, out, _ = run_cli(kubeconfig, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["dry_run"] is True
    plan = doc["plan"]
    assert plan["evictions"] == 2 and plan["gpus_freed"] == 2
    assert sorted(g for grp in plan["groups"] for g in grp["gpus_freed"]) == ["GPU-n1-1", "GPU-n1-2"]
    assert all(m["to_gpus"] == ["GPU-n1-0"] for m in plan["moves"])
    # Nothing written: only reads reached the API, and every object is as it was.
    writes = [(r.method, r.path) for r in kubeapi.requests if r.method != "GET" and "/replicasets/" not in r.path]
    assert writes == []
    assert snapshot(kubeapi) == before


def test_caps_bound_the_plan(cluster, kubeconfig, capsys):
    seed(cluster)
    for flag, value, expect in (("--max-evictions", "1", 1), ("--max-per-node", "1", 1),
                                ("--max-per-namespace", "1", 1), ("--max-evictions", "0", 0)):
        rc, out, _ = run_cli(kubeconfig, "--json", flag, value, capsys=capsys)
        assert rc == 0
        assert json.loads(out)["plan"]["evictions"] == expect, flag
    rc, out, _ = run_cli(kubeconfig, "--json", "--namespace", "other", capsys=capsys)
    doc = json.loads(out)
    assert doc["plan"]["evictions"] == 0 and doc["excluded"] == {"namespace": 3}


def test_online_pods_need_the_flag(cluster, kubeconfig, capsys):
    cluster.node("n1", 2)
    a = cluster.replicaset("web", "a", 30000, 30, cls="online")[0]
    cluster.place("web", a, "n1", 0, 30000, 30)
    b = cluster.replicaset("web", "b", 30000, 30, cls="online")[0]
    cluster.place("web", b, "n1", 1, 30000, 30)
    rc, out, _ = run_cli(kubeconfig, "--json", capsys=capsys)
    assert json.loads(out)["plan"]["evictions"] == 0 and json.loads(out)["excluded"] == {"online": 2}
    rc, out, _ = run_cli(kubeconfig, "--json", "--allow-online", capsys=capsys)
    assert json.loads(out)["plan"]["evictions"] == 1


def test_outside_the_window_apply_refuses_unless_forced(cluster, kubeapi, kubeconfig, capsys, tmp_path):
    seed(cluster)
    before = snapshot(kubeapi)
    metrics = tmp_path / "m.prom"
    rc, out, err = run_cli(kubeconfig, "--apply", "--window", outside_window(), "--metrics-file", str(metrics),
                           capsys=capsys)
    assert rc == 3
    assert "outside the allowed window" in err and "--force" in err and "Traceback" not in err
    assert snapshot(kubeapi) == before
    assert 'gpupack_defrag_run_result{result="refused-window"} 1.0' in metrics.read_text()
    # A dry run outside the window still shows the plan.
    rc, out, err = run_cli(kubeconfig, "--window", outside_window(), capsys=capsys)
    assert rc == 0 and "2 eviction(s)" in out
    rc, _, err = run_cli(kubeconfig, "--window", "25:00-26:00", capsys=capsys)
    assert rc == 2 and "expected HH:MM-HH:MM" in err


def test_pdb_refusal_skips_the_pod_and_the_run_goes_on(cluster, kubeapi, kubeconfig, capsys, tmp_path):
    names = seed(cluster)
    cluster.pdb("batch", "w1")
    cluster.pdb("batch", "w2")
    metrics = tmp_path / "m.prom"
    rc, out, err = run_cli(kubeconfig, "--apply", "--json", "--move-timeout", "5", "--poll-interval", "0.05",
                           "--metrics-file", str(metrics), capsys=capsys)
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert [m["outcome"] for m in result["moves"]] == ["pdb-refused", "pdb-refused"]
    assert result["evictions"] == 0
    pods = cluster.pods("batch")
    assert f"batch/{names['w1']}" in pods and f"batch/{names['w2']}" in pods
    assert ANN_RESERVATIONS not in kubeapi.get("nodes", "n1")["metadata"].get("annotations", {})
    reasons = [e["reason"] for e in cluster.events()]
    assert reasons.count("DefragEvictionRefused") == 2
    assert 'gpupack_defrag_evictions_total{result="pdb-refused"} 2.0' in metrics.read_text()
    assert kubeapi.count_requests("POST", r"/eviction$") == 2


def test_a_timeout_stops_the_run_and_releases_every_reservation(cluster, kubeapi, kubeconfig, capsys, tmp_path):
    names = seed(cluster)
    metrics = tmp_path / "m.prom"
    seen: list[list] = []

    def watch_reservations():
        # The reservation is on the node while the move waits.
        def has():
            raw = kubeapi.get("nodes", "n1")["metadata"].get("annotations", {}).get(ANN_RESERVATIONS)
            if raw:
                seen.append(decode_reservations(raw, "n1"))
            return raw
        wait_for(has, 10, "a reservation")

    t = threading.Thread(target=watch_reservations)
    t.start()
    # Nobody schedules the replacement: it stays Pending.
    rc, out, err = run_cli(kubeconfig, "--apply", "--json", "--move-timeout", "1.5", "--poll-interval", "0.05",
                           "--metrics-file", str(metrics), capsys=capsys)
    t.join()
    assert rc == 1
    result = json.loads(out)["result"]
    assert "not running on n1 within 1.5s" in result["aborted"]
    assert [m["outcome"] for m in result["moves"]] == ["timeout"], "the second move never started"
    assert kubeapi.count_requests("POST", r"/eviction$") == 1
    r = seen[0][0]
    assert r.owner_kind == "ReplicaSet" and r.namespace == "batch" and r.pod_class == "offline"
    assert [s.uuid for s in r.containers["main"]] == ["GPU-n1-0"]
    assert ANN_RESERVATIONS not in kubeapi.get("nodes", "n1")["metadata"].get("annotations", {})
    assert {"DefragEvicted", "DefragAborted"} <= {e["reason"] for e in cluster.events()}
    text = metrics.read_text()
    assert "gpupack_defrag_moves_aborted_total 1.0" in text
    assert 'gpupack_defrag_evictions_total{result="evicted"} 1.0' in text
    assert f"batch/{names['w2']}" in cluster.pods("batch"), "the second pod was left alone"
    lease = kubeapi.get("leases", "gpupack-defrag", "gpupack-system") or kubeapi.list("leases")[0]
    assert not lease["spec"].get("holderIdentity"), "the lease is given back"


def test_bare_and_daemonset_pods_are_never_moved(cluster, kubeapi, kubeconfig, capsys):
    cluster.node("n1", 4)
    anchor = cluster.replicaset("batch", "anchor", 50000, 50)[0]
    cluster.place("batch", anchor, "n1", 0, 50000, 50)
    cluster.bare_pod("batch", "lonely", 8000, 10)
    cluster.place("batch", "lonely", "n1", 1, 8000, 10)
    cluster.bare_pod("batch", "agent", 8000, 10, owner=("DaemonSet", "agent"))
    cluster.place("batch", "agent", "n1", 2, 8000, 10)
    cluster.bare_pod("batch", "job-1", 8000, 10, owner=("Job", "job"))
    cluster.place("batch", "job-1", "n1", 3, 8000, 10)
    uids = {k: p["metadata"]["uid"] for k, p in cluster.pods("batch").items()}
    rc, out, _ = run_cli(kubeconfig, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["excluded"] == {"bare-pod": 1, "daemonset": 1, "job": 1}
    moved = {m["pod"] for m in doc["plan"]["moves"]}
    assert moved <= {f"batch/{anchor}"}
    rc, out, _ = run_cli(kubeconfig, "--json", "--allow-jobs", capsys=capsys)
    assert "batch/job-1" in {m["pod"] for m in json.loads(out)["plan"]["moves"]}
    # Applying (with nothing able to reschedule) never touches them.
    rc, out, _ = run_cli(kubeconfig, "--apply", "--json", "--move-timeout", "0.5", "--poll-interval", "0.05",
                         capsys=capsys)
    after = {k: p["metadata"]["uid"] for k, p in cluster.pods("batch").items()}
    for key in ("batch/lonely", "batch/agent", "batch/job-1"):
        assert after[key] == uids[key]


def test_the_lease_prevents_overlapping_runs(cluster, kubeapi, kubeconfig, capsys):
    seed(cluster)
    now = datetime.now(UTC)
    kubeapi.create("leases", {
        "metadata": {"name": "gpupack-defrag", "namespace": "gpupack-system"},
        "spec": {"holderIdentity": "other-run", "leaseDurationSeconds": 600,
                 "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")},
    })
    rc, _, err = run_cli(kubeconfig, "--apply", capsys=capsys)
    assert rc == 3 and "another defrag run (other-run) holds lease" in err
    assert kubeapi.count_requests("POST", r"/eviction$") == 0
    # An expired lease is taken over.
    old = now - timedelta(hours=1)
    kubeapi.patch("leases", "gpupack-defrag", {"spec": {"renewTime": old.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}},
                  "gpupack-system")
    rc, _, err = run_cli(kubeconfig, "--apply", "--max-evictions", "0", capsys=capsys)
    assert rc == 0, err

    # Two runs at once: the second finds the first holding the lease.
    results: dict[str, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__("first", main(
        ["--kubeconfig", str(kubeconfig), "--apply", "--move-timeout", "2", "--poll-interval", "0.05"])))
    first.start()
    wait_for(lambda: (kubeapi.get("leases", "gpupack-defrag", "gpupack-system")["spec"].get("holderIdentity") or "")
             .endswith(tuple("0123456789abcdef")) and kubeapi.count_requests("POST", r"/eviction$") >= 1,
             what="the first run to start moving")
    results["second"] = main(["--kubeconfig", str(kubeconfig), "--apply"])
    first.join(30)
    assert results == {"first": 1, "second": 3}  # the first times out (nobody schedules), the second refused
    assert kubeapi.count_requests("POST", r"/eviction$") == 1


@pytest.mark.parametrize("argv, msg", [
    (["--max-evictions", "-1"], "--max-evictions must be >= 0"),
    (["--max-workload-share", "2"], "--max-workload-share must be in 0..1"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "cannot load Kubernetes configuration"),
])
def test_bad_arguments_get_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_a_corrupt_reservations_annotation_is_reported_never_rewritten(cluster, kubeapi, kubeconfig, capsys):
    seed(cluster)
    kubeapi.patch("nodes", "n1", {"metadata": {"annotations": {ANN_RESERVATIONS: "{not json"}}})
    rc, out, err = run_cli(kubeconfig, capsys=capsys)
    assert rc == 0 and "2 eviction(s)" in out
    rc, out, err = run_cli(kubeconfig, "--apply", "--json", "--move-timeout", "1", "--poll-interval", "0.05",
                           capsys=capsys)
    assert rc == 0, err
    moves = json.loads(out)["result"]["moves"]
    assert [m["outcome"] for m in moves] == ["reserve-failed", "reserve-failed"]
    assert "not valid JSON" in moves[0]["detail"] and "not rewriting it" in moves[0]["detail"]
    assert kubeapi.count_requests("POST", r"/eviction$") == 0
    assert kubeapi.get("nodes", "n1")["metadata"]["annotations"][ANN_RESERVATIONS] == "{not json"
