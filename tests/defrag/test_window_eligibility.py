"""Small pure pieces of the defrag command: the time window and who may move."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from extender.controllers.defrag.eligibility import Eligibility, why_not
from extender.controllers.defrag.window import WindowError, parse_window
from gpupack.core.request import parse_pod


def at(h: int, m: int = 0) -> datetime:
    return datetime(2026, 1, 5, h, m, tzinfo=UTC)


def test_window_plain_wrapping_and_midnight():
    w = parse_window("01:00-05:00")
    assert w.contains(at(1)) and w.contains(at(4, 59)) and not w.contains(at(5)) and not w.contains(at(0, 59))
    wrap = parse_window("22:30-02:00")
    assert (
        wrap.contains(at(23))
        and wrap.contains(at(1, 59))
        and not wrap.contains(at(2))
        and not wrap.contains(at(12))
    )
    late = parse_window("20:00-24:00")
    assert late.contains(at(23, 59)) and not late.contains(at(0, 0))
    assert parse_window("00:00-00:00").contains(at(13))
    # 01:00-05:00 in Berlin is 00:00-04:00 UTC in winter.
    berlin = parse_window("01:00-05:00", "Europe/Berlin")
    assert berlin.contains(at(0, 30)) and not berlin.contains(at(4, 30))


@pytest.mark.parametrize("text", ["1-5", "01:00", "25:00-01:00", "01:60-02:00", "24:30-01:00", "01:00-24:30"])
def test_bad_windows_are_rejected(text):
    with pytest.raises(WindowError):
        parse_window(text)
    with pytest.raises(WindowError, match="unknown time zone"):
        parse_window("01:00-02:00", "Mars/Olympus")


def pod(owner_kind: str | None, cls: str = "offline", phase: str = "Running", deleting: bool = False) -> dict:
    meta: dict = {"name": "p", "namespace": "ns", "labels": {"gpupack.io/class": cls}}
    if owner_kind:
        meta["ownerReferences"] = [{"kind": owner_kind, "name": "o", "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    limits = {"gpupack.io/gpu-mem": "1000"}
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


@pytest.mark.parametrize(
    "kind, rules, expect",
    [
        ("ReplicaSet", Eligibility(), None),
        ("StatefulSet", Eligibility(), None),
        (None, Eligibility(allow_jobs=True, allow_online=True), "bare-pod"),
        ("DaemonSet", Eligibility(allow_jobs=True, allow_online=True), "daemonset"),
        ("Node", Eligibility(), "controller"),
        ("Job", Eligibility(), "job"),
        ("Job", Eligibility(allow_jobs=True), None),
    ],
)
def test_only_recreated_pods_move(kind, rules, expect):
    p = pod(kind)
    assert why_not(p, parse_pod(p), rules) == expect


def test_online_terminating_pending_and_namespaces():
    p = pod("ReplicaSet", cls="online")
    assert why_not(p, parse_pod(p), Eligibility()) == "online"
    assert why_not(p, parse_pod(p), Eligibility(allow_online=True)) is None
    p = pod("ReplicaSet", deleting=True)
    assert why_not(p, parse_pod(p), Eligibility()) == "terminating"
    p = pod("ReplicaSet", phase="Pending")
    assert why_not(p, parse_pod(p), Eligibility()) == "not-running"
    p = pod("ReplicaSet")
    assert why_not(p, parse_pod(p), Eligibility(namespaces=frozenset({"other"}))) == "namespace"
