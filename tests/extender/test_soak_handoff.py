"""A reduced run of benchmarks/soak_handoff.py on the tests' control plane: mixed pod shapes, deletions
while a handoff is pending, two extender SIGKILLs and a leader hand-over, through the real
kube-scheduler, the kubelet's real device manager and the real device plugin processes (and two
plugin SIGKILLs); it must end with no bind refused a fit filter passed, no over-committed GPU, no container env or allocation that differs
from its assignment, no refused admission, no node over its slots and no locked node."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak_handoff  # noqa: E402


def test_reduced_soak_ends_with_no_overcommit_no_mismatch_no_locked_node(cluster, sfx, tmp_path):
    out = soak_handoff.run(
        cluster, tmp_path, pods=24, nodes=3, seed=7,
        ns=f"soak-{sfx}", lease_ns=f"soak-lease-{sfx}", prefix=f"soak-{sfx}", settle_s=4,
        kubelet_mode="device-manager",
    )  # fmt: skip
    figures = {
        k: out[k]
        for k in ("overcommitted_gpus", "allocation_mismatches", "env_mismatches", "admissions_refused",
                  "not_admitted", "nodes_over_slots", "locked_nodes")
    }  # fmt: skip
    assert figures == dict.fromkeys(figures, 0), out
    assert len(out["events"]) == 5 and out["plugin_restarts"] == 2 and out["deleted_mid_handoff"] >= 1, out
    # everything that fits is placed: what stays Pending does so for capacity, with the reason
    assert out["handoffs_done"] >= 12, out
    assert not out["plugin_errors"] and not out["kubelet_errors"], out
    # issue 31 item 7: no bind refuses a fit that filter passed, across both extender SIGKILLs
    assert out["binds_failed_fit"] == 0, out["binds_failed_fit_detail"]


def test_reduced_soak_with_unplaced_gpu_pods_and_late_admissions_starts_no_container_on_another_pods_gpu(
    cluster, sfx, tmp_path
):
    """Issue 31 item 1 in the randomized soak: `gpupack.io/gpu` pods gpupack never placed, put on nodes
    whose handoff is pending, and pods admitted only after their handoff was given up (as the
    janitor does after --stale-handoff-s) and the next pod bound. None of their containers starts;
    every container that does start got its own assignment's GPU and env; nothing is over-committed
    or left locked. A rightful pod may still be refused (`admissions_refused`, reported, not 0):
    when the extender binds another pod to the node between the wrong pod's Allocate and its
    refusal, the consumed assignment cannot wait again (one pending handoff per node) and its pod
    must be re-created."""
    out = soak_handoff.run(
        cluster, tmp_path, pods=20, nodes=2, seed=11,
        ns=f"soak-{sfx}", lease_ns=f"soak-lease-{sfx}", prefix=f"soak-{sfx}", settle_s=4,
        kubelet_mode="device-manager", intruders=4, late=3,
    )  # fmt: skip
    assert out["intruders"] == 4 and out["late"] >= 1, out
    figures = {
        k: out[k]
        for k in ("intruders_started", "late_started", "overcommitted_gpus", "allocation_mismatches",
                  "env_mismatches", "not_admitted", "nodes_over_slots", "locked_nodes")
    }  # fmt: skip
    assert figures == dict.fromkeys(figures, 0), (figures, out["env_mismatch_detail"], out)
    assert out["intruders_refused"] == out["intruders"], out
    assert out["env_checked_containers"] > 0 and out["prestart_accepted"] > 0, out
    assert not out["plugin_errors"] and not out["kubelet_errors"], out
