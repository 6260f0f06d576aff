"""`gpupack defrag` against the real Kubernetes control plane: dry run, caps, window, lease, real
PodDisruptionBudgets and Eviction API, timeouts, ineligible pods, faults through the proxy."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from defrag_cluster import LEASE, Fleet
from faultproxy import FaultProxy
from realk8s import until

from extender.controllers.defrag.cli import main
from gpupack.contract import ANN_RESERVATIONS, decode_reservations

EVICTION = r"/pods/[^/]+/eviction$"


@dataclass
class Seeded:
    ns: str
    node: str
    anchor: str
    w1: str
    w2: str


def seed(fleet: Fleet, bare: bool = False) -> Seeded:
    """n1: GPU0 anchor (50000 MiB, 50 %), GPU1 w1 (8000, 10 %), GPU2 w2 (8000, 10 %), GPU3 idle.
    The plan: w1 and w2 move onto GPU0; GPUs 1 and 2 become idle. Two evictions, two GPUs."""
    ns, node = fleet.namespace("batch"), fleet.node("n1", 4)
    anchor = fleet.replicaset(ns, "anchor", 50000, 50)[0]
    fleet.place(ns, anchor, node, 0, 50000, 50)
    w1 = fleet.replicaset(ns, "w1", 8000, 10)[0]
    fleet.place(ns, w1, node, 1, 8000, 10)
    w2 = fleet.bare_pod(ns, "lonely", 8000, 10) if bare else fleet.replicaset(ns, "w2", 8000, 10)[0]
    fleet.place(ns, w2, node, 2, 8000, 10)
    return Seeded(ns, node, anchor, w1, w2)


def run_cli(kubeconfig: Path, fleet: Fleet, *args: str, capsys=None) -> tuple[int, str, str]:
    rc = main(["--kubeconfig", str(kubeconfig), "--lease-namespace", fleet.lease_ns, *args])
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return rc, out, err


def state(fleet: Fleet, s: Seeded) -> str:
    """Every object a run could change, by resourceVersion (and the Events defrag writes)."""
    pods = {k: p["metadata"]["resourceVersion"] for k, p in fleet.pods(s.ns).items()}
    node = fleet.node_annotations(s.node)
    lease = fleet.lease()
    events = [e["reason"] for e in fleet.defrag_events(s.ns)]
    return json.dumps({"pods": pods, "node": node, "lease": lease, "events": events}, sort_keys=True)


def outside_window() -> str:
    now = datetime.now(UTC)
    a, b = now + timedelta(hours=2), now + timedelta(hours=3)
    return f"{a:%H:%M}-{b:%H:%M}"


def test_dry_run_prints_the_plan_and_changes_nothing(fleet, proxy, kubeconfig, capsys):
    s = seed(fleet)
    before = state(fleet, s)
    rc, out, _ = run_cli(kubeconfig, fleet, capsys=capsys)
    assert rc == 0
    assert "2 eviction(s) free 2 whole GPU(s) (1.00 per eviction)" in out
    assert f"{s.ns}/w1-" in out and f"{s.node}[{f'GPU-{s.node}-0'[-8:]}]" in out
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["dry_run"] is True
    plan = doc["plan"]
    assert plan["evictions"] == 2 and plan["gpus_freed"] == 2
    assert sorted(g for grp in plan["groups"] for g in grp["gpus_freed"]) == [
        f"GPU-{s.node}-1",
        f"GPU-{s.node}-2",
    ]
    assert all(m["to_gpus"] == [f"GPU-{s.node}-0"] for m in plan["moves"])
    # Nothing written: only reads reached the API, and every object is as it was.
    assert proxy.requests and all(r.method == "GET" for r in proxy.requests), proxy.requests
    assert state(fleet, s) == before


def test_caps_bound_the_plan(fleet, kubeconfig, capsys):
    s = seed(fleet)
    for flag, value, expect in (
        ("--max-evictions", "1", 1),
        ("--max-per-node", "1", 1),
        ("--max-per-namespace", "1", 1),
        ("--max-evictions", "0", 0),
    ):
        rc, out, _ = run_cli(kubeconfig, fleet, "--json", flag, value, capsys=capsys)
        assert rc == 0
        assert json.loads(out)["plan"]["evictions"] == expect, flag
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", "--namespace", "other", capsys=capsys)
    doc = json.loads(out)
    assert doc["plan"]["evictions"] == 0 and doc["excluded"] == {"namespace": 3}
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", "--namespace", s.ns, capsys=capsys)
    assert json.loads(out)["plan"]["evictions"] == 2


def test_online_pods_need_the_flag(fleet, kubeconfig, capsys):
    ns, node = fleet.namespace("web"), fleet.node("n1", 2)
    a = fleet.replicaset(ns, "a", 30000, 30, cls="online")[0]
    fleet.place(ns, a, node, 0, 30000, 30)
    b = fleet.replicaset(ns, "b", 30000, 30, cls="online")[0]
    fleet.place(ns, b, node, 1, 30000, 30)
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", capsys=capsys)
    assert json.loads(out)["plan"]["evictions"] == 0 and json.loads(out)["excluded"] == {"online": 2}
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", "--allow-online", capsys=capsys)
    assert json.loads(out)["plan"]["evictions"] == 1


def test_outside_the_window_apply_refuses_unless_forced(fleet, proxy, kubeconfig, capsys, tmp_path):
    s = seed(fleet)
    before = state(fleet, s)
    metrics = tmp_path / "m.prom"
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--window", outside_window(), "--metrics-file",
                           str(metrics), capsys=capsys)  # fmt: skip
    assert rc == 3
    assert "outside the allowed window" in err and "--force" in err and "Traceback" not in err
    assert proxy.requests == [], "it refused before talking to the API"
    assert state(fleet, s) == before
    assert 'gpupack_defrag_run_result{result="refused-window"} 1.0' in metrics.read_text()
    # A dry run outside the window still shows the plan.
    rc, out, err = run_cli(kubeconfig, fleet, "--window", outside_window(), capsys=capsys)
    assert rc == 0 and "2 eviction(s)" in out
    rc, _, err = run_cli(kubeconfig, fleet, "--window", "25:00-26:00", capsys=capsys)
    assert rc == 2 and "expected HH:MM-HH:MM" in err


def test_pdb_refusal_skips_the_pod_and_the_run_goes_on(fleet, proxy, kubeconfig, capsys, tmp_path):
    s = seed(fleet)
    # Real budgets: the disruption controller sees one healthy pod of each and allows none.
    fleet.pdb(s.ns, "w1", min_available=1, expect_allowed=0)
    fleet.pdb(s.ns, "w2", min_available=1, expect_allowed=0)
    uids = {k: p["metadata"]["uid"] for k, p in fleet.pods(s.ns).items()}
    metrics = tmp_path / "m.prom"
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--move-timeout", "5", "--poll-interval",
                           "0.05", "--budget-wait", "0.5", "--metrics-file", str(metrics), capsys=capsys)  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert [m["outcome"] for m in result["moves"]] == ["pdb-refused", "pdb-refused"]
    # The budget as the real disruption controller computed it is named in the detail.
    for m, pdb in zip(result["moves"], ("w1-pdb", "w2-pdb"), strict=True):
        assert (
            f"waited 0.5s for a disruption budget: {pdb}: 0 disruption(s) allowed, 1 healthy" in m["detail"]
        )
    assert result["evictions"] == 0
    pods = fleet.pods(s.ns)
    assert {k: p["metadata"]["uid"] for k, p in pods.items()} == uids, "no pod was evicted or added"
    assert not any(p["metadata"].get("deletionTimestamp") for p in pods.values())
    assert ANN_RESERVATIONS not in fleet.node_annotations(s.node)
    reasons = [e["reason"] for e in fleet.defrag_events(s.ns)]
    assert reasons.count("DefragEvictionRefused") == 2
    assert 'gpupack_defrag_evictions_total{result="pdb-refused"} 2.0' in metrics.read_text()
    assert proxy.count("POST", EVICTION) == 0, "it waits on the budget instead of collecting 429s"


def test_a_pdb_with_room_lets_the_eviction_through(fleet, proxy, kubeconfig, capsys):
    """A budget that allows one disruption is not a refusal: the real Eviction API evicts."""
    s = seed(fleet)
    fleet.pdb(s.ns, "w1", min_available=0, expect_allowed=1)
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--max-evictions", "1", "--move-timeout",
                           "0.5", "--poll-interval", "0.05", capsys=capsys)  # fmt: skip
    assert rc == 1, err  # nobody schedules the replacement
    assert [m["outcome"] for m in json.loads(out)["result"]["moves"]] == ["timeout"]
    evicted = fleet.pods(s.ns)[f"{s.ns}/{s.w1}"]
    assert evicted["metadata"].get("deletionTimestamp"), "the pod was evicted (terminating; no kubelet)"
    assert any(c["type"] == "DisruptionTarget" for c in evicted["status"].get("conditions") or [])


def test_a_timeout_stops_the_run_and_releases_every_reservation(fleet, proxy, kubeconfig, capsys, tmp_path):
    s = seed(fleet)
    metrics = tmp_path / "m.prom"
    seen: list[list] = []

    def watch_reservations():
        # The reservation is on the node while the move waits.
        def has():
            text = fleet.node_annotations(s.node).get(ANN_RESERVATIONS)
            if text:
                seen.append(decode_reservations(text, s.node))
            return text

        until(has, 20, "a reservation")

    t = threading.Thread(target=watch_reservations)
    t.start()
    # Nobody schedules the replacement the real ReplicaSet controller creates: it stays Pending.
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--move-timeout", "1.5", "--poll-interval",
                           "0.05", "--metrics-file", str(metrics), capsys=capsys)  # fmt: skip
    t.join()
    assert rc == 1
    result = json.loads(out)["result"]
    assert f"not running on {s.node} within 1.5s" in result["aborted"]
    assert "is Pending, unbound" in result["aborted"]
    assert [m["outcome"] for m in result["moves"]] == ["timeout"], "the second move never started"
    assert proxy.count("POST", EVICTION) == 1
    r = seen[0][0]
    assert r.owner_kind == "ReplicaSet" and r.namespace == s.ns and r.pod_class == "offline"
    assert [sh.uuid for sh in r.containers["main"]] == [f"GPU-{s.node}-0"]
    assert ANN_RESERVATIONS not in fleet.node_annotations(s.node)
    assert {"DefragEvicted", "DefragAborted"} <= {e["reason"] for e in fleet.defrag_events(s.ns)}
    text = metrics.read_text()
    assert "gpupack_defrag_moves_aborted_total 1.0" in text
    assert 'gpupack_defrag_evictions_total{result="evicted"} 1.0' in text
    pods = fleet.pods(s.ns)
    assert not pods[f"{s.ns}/{s.w2}"]["metadata"].get("deletionTimestamp"), "the second pod was left alone"
    replacements = [p for p in fleet.pods_owned(s.ns, "ReplicaSet", "w1") if p["metadata"]["name"] != s.w1]
    assert len(replacements) == 1 and not replacements[0]["spec"].get("nodeName")
    lease = fleet.lease()
    assert lease is not None and not lease["spec"].get("holderIdentity"), "the lease is given back"


def test_bare_daemonset_and_job_pods_are_never_moved(fleet, kubeconfig, capsys):
    ns, node = fleet.namespace("batch"), fleet.node("n1", 4)
    anchor = fleet.replicaset(ns, "anchor", 50000, 50)[0]
    fleet.place(ns, anchor, node, 0, 50000, 50)
    fleet.bare_pod(ns, "lonely", 8000, 10)
    fleet.place(ns, "lonely", node, 1, 8000, 10)
    agent = fleet.daemonset(ns, "agent", node, 8000, 10)
    fleet.place(ns, agent, node, 2, 8000, 10)
    job = fleet.job(ns, "job", 8000, 10)
    fleet.place(ns, job, node, 3, 8000, 10)
    uids = {k: p["metadata"]["uid"] for k, p in fleet.pods(ns).items()}
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["excluded"] == {"bare-pod": 1, "daemonset": 1, "job": 1}
    moved = {m["pod"] for m in doc["plan"]["moves"]}
    assert moved <= {f"{ns}/{anchor}"}
    rc, out, _ = run_cli(kubeconfig, fleet, "--json", "--allow-jobs", capsys=capsys)
    assert f"{ns}/{job}" in {m["pod"] for m in json.loads(out)["plan"]["moves"]}
    # Applying (with nothing able to reschedule) never touches them.
    rc, out, _ = run_cli(kubeconfig, fleet, "--apply", "--json", "--move-timeout", "0.5", "--poll-interval",
                         "0.05", capsys=capsys)  # fmt: skip
    after = fleet.pods(ns)
    for key in (f"{ns}/lonely", f"{ns}/{agent}", f"{ns}/{job}"):
        assert after[key]["metadata"]["uid"] == uids[key]
        assert not after[key]["metadata"].get("deletionTimestamp")


def test_the_lease_prevents_overlapping_runs(fleet, proxy, kubeconfig, capsys):
    seed(fleet)
    now = datetime.now(UTC)
    fleet.coord.create_namespaced_lease(fleet.lease_ns, {
        "metadata": {"name": LEASE},
        "spec": {"holderIdentity": "other-run", "leaseDurationSeconds": 600,
                 "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")},
    })  # fmt: skip
    rc, _, err = run_cli(kubeconfig, fleet, "--apply", capsys=capsys)
    assert rc == 3 and "another defrag run (other-run) holds lease" in err
    assert proxy.count("POST", EVICTION) == 0
    # An expired lease is taken over.
    old = now - timedelta(hours=1)
    fleet.coord.patch_namespaced_lease(
        LEASE, fleet.lease_ns, {"spec": {"renewTime": old.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
    )
    rc, _, err = run_cli(kubeconfig, fleet, "--apply", "--max-evictions", "0", capsys=capsys)
    assert rc == 0, err

    # Two runs at once: the second finds the first holding the lease.
    results: dict[str, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__("first", run_cli(
        kubeconfig, fleet, "--apply", "--move-timeout", "3", "--poll-interval", "0.05")[0]))  # fmt: skip
    first.start()
    until(lambda: ((fleet.lease() or {})["spec"].get("holderIdentity") or "").endswith(tuple("0123456789abcdef"))
          and proxy.count("POST", EVICTION) >= 1, 30, "the first run to start moving")  # fmt: skip
    results["second"] = run_cli(kubeconfig, fleet, "--apply")[0]
    first.join(30)
    assert results == {"first": 1, "second": 3}  # the first times out (nobody schedules), the second refused
    assert proxy.count("POST", EVICTION) == 1


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--max-evictions", "-1"], "--max-evictions must be >= 0"),
        (["--max-workload-share", "2"], "--max-workload-share must be in 0..1"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], "cannot load Kubernetes configuration"),
    ],
)
def test_bad_arguments_get_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_a_corrupt_reservations_annotation_is_reported_never_rewritten(fleet, proxy, kubeconfig, capsys):
    s = seed(fleet)
    fleet.core.patch_node(s.node, {"metadata": {"annotations": {ANN_RESERVATIONS: "{not json"}}})
    rc, out, err = run_cli(kubeconfig, fleet, capsys=capsys)
    assert rc == 0 and "2 eviction(s)" in out
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--move-timeout", "1", "--poll-interval",
                           "0.05", capsys=capsys)  # fmt: skip
    assert rc == 0, err
    moves = json.loads(out)["result"]["moves"]
    assert [m["outcome"] for m in moves] == ["reserve-failed", "reserve-failed"]
    assert "not valid JSON" in moves[0]["detail"] and "not rewriting it" in moves[0]["detail"]
    assert proxy.count("POST", EVICTION) == 0
    assert proxy.count("PATCH", "/api/v1/nodes/") == 0
    assert fleet.node_annotations(s.node)[ANN_RESERVATIONS] == "{not json"


def test_a_conflict_on_the_reservation_write_is_retried(fleet, proxy: FaultProxy, kubeconfig, capsys):
    """409 on the Node patch (someone else wrote the Node): re-read and write again."""
    s = seed(fleet)
    proxy.fail_next("PATCH", f"/api/v1/nodes/{s.node}$", 409, times=2)
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--max-evictions", "1", "--move-timeout",
                           "0.5", "--poll-interval", "0.05", capsys=capsys)  # fmt: skip
    assert rc == 1, err  # it got as far as the eviction; nobody schedules the replacement
    assert [m["outcome"] for m in json.loads(out)["result"]["moves"]] == ["timeout"]
    assert proxy.count("POST", EVICTION) == 1
    # 2 refused + the reservation written + the reservation removed at the end
    assert proxy.count("PATCH", f"/api/v1/nodes/{s.node}$") == 4
    assert ANN_RESERVATIONS not in fleet.node_annotations(s.node)


def test_a_server_error_on_the_eviction_stops_the_run_and_cleans_up(fleet, proxy, kubeconfig, capsys):
    """500 from the Eviction API is not a PDB refusal: the run stops (exit 1), evicts nothing more,
    and the reservation it wrote for that move is gone."""
    s = seed(fleet)
    proxy.fail_next("POST", EVICTION, 500)
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--move-timeout", "0.5", "--poll-interval", "0.05",
                           capsys=capsys)  # fmt: skip
    assert rc == 1
    assert "Kubernetes API error 500" in err and "Traceback" not in err
    assert proxy.count("POST", EVICTION) == 1
    assert ANN_RESERVATIONS not in fleet.node_annotations(s.node)
    assert not any(p["metadata"].get("deletionTimestamp") for p in fleet.pods(s.ns).values())
    lease = fleet.lease()
    assert lease is not None and not lease["spec"].get("holderIdentity"), "the lease is given back"


def test_a_throttled_eviction_is_retried_not_taken_for_a_pdb(fleet, proxy, kubeconfig, capsys, tmp_path):
    """429 without a DisruptionBudget cause is the API server's load shedding (priority and
    fairness), not a budget: the eviction is tried again after Retry-After."""
    s = seed(fleet)
    proxy.fail_next("POST", EVICTION, 429, retry_after=1, message="too many requests, please try again later")
    metrics = tmp_path / "m.prom"
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--max-evictions", "1", "--move-timeout",
                           "0.5", "--poll-interval", "0.05", "--metrics-file", str(metrics), capsys=capsys)  # fmt: skip
    assert rc == 1, err  # evicted on the second try; nobody schedules the replacement
    assert [m["outcome"] for m in json.loads(out)["result"]["moves"]] == ["timeout"]
    assert proxy.count("POST", EVICTION) == 2
    assert fleet.pods(s.ns)[f"{s.ns}/{s.w1}"]["metadata"].get("deletionTimestamp")
    assert "DefragEvictionRefused" not in {e["reason"] for e in fleet.defrag_events(s.ns)}
    assert 'gpupack_defrag_evictions_total{result="evicted"} 1.0' in metrics.read_text()


def test_losing_the_lease_stops_the_run_before_the_next_move(fleet, proxy, kubeconfig, capsys):
    """A 409 renewing the Lease (another writer changed it) means the run may no longer act."""
    s = seed(fleet)
    proxy.fail_next("PUT", f"/namespaces/{fleet.lease_ns}/leases/{LEASE}$", 409)
    rc, out, err = run_cli(kubeconfig, fleet, "--apply", "--json", "--move-timeout", "0.5", "--poll-interval",
                           "0.05", capsys=capsys)  # fmt: skip
    assert rc == 1, err
    result = json.loads(out)["result"]
    assert "lost the run lease" in result["aborted"] and result["moves"] == []
    assert proxy.count("POST", EVICTION) == 0
    assert ANN_RESERVATIONS not in fleet.node_annotations(s.node)
