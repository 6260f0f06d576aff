"""The filter's stages one by one (extender/verbs/filter_stages.py), each a table of inputs and
the verdict it must give; none may change what it is given."""

from __future__ import annotations

import copy
from collections.abc import Collection

import pytest

from extender.verbs.filter_stages import (
    NotWhole,
    Ranking,
    Verdict,
    Wait,
    busy_reason,
    rank,
    settle,
    steer,
    take_best,
)
from gpupack.contract import Reservation

NAMES = ["a", "b", "c", "d"]


def verdict(passed: Collection[str], failed: dict[str, str] | None = None) -> Verdict:
    return Verdict(passed, failed or {"x": "no room"}, {"u": "unreadable"}, {"no-room": 1})


def frozen(v: Verdict) -> tuple:
    return (
        sorted(v.passed) if isinstance(v.passed, set) else list(v.passed),
        copy.deepcopy(dict(v.failed)),
        dict(v.unresolvable),
        dict(v.codes),
    )


def reservation(rid: str) -> Reservation:
    return Reservation(
        id=rid, namespace="ns", owner_kind="ReplicaSet", owner_name="o", pod_class="online",
        containers={}, expires="2030-01-01T00:00:00Z",
    )  # fmt: skip


@pytest.mark.parametrize(
    "passed, steered, want_passed, want_failed",
    [
        (["a", "b"], {}, ["a", "b"], {}),  # no reservation of the pod's own: unchanged
        (["a", "b"], {"c": "r1"}, ["a", "b"], {}),  # its reserved node does not pass: unchanged
        (["a", "b", "c"], {"b": "r1"}, ["b"], {"a": "b r1", "c": "b r1"}),
        (["a", "b", "c"], {"c": "r2", "b": "r1"}, ["b", "c"], {"a": "b r1"}),  # named: the first passing
    ],
)
def test_steer(passed, steered, want_passed, want_failed) -> None:
    v = verdict(passed)
    before = frozen(v)
    out = steer(v, {n: reservation(r) for n, r in steered.items()})
    assert frozen(v) == before
    assert list(out.passed) == want_passed
    for n, why in want_failed.items():
        node, rid = why.split()
        assert out.failed[n] == f"pod is steered to node {node} by defrag reservation {rid}"
    assert out.codes.get("reservation-steer", 0) == len(want_failed)
    assert out.failed["x"] == "no room" and out.unresolvable == {"u": "unreadable"}


def order_best(order: list[str]):
    """A policy that prefers the nodes in `order`."""

    def best(pool: Collection[str], keep: int, busy, skipped: dict[str, str]) -> list[str]:
        return take_best([n for n in order if n in pool], keep, busy, skipped)

    return best


@pytest.mark.parametrize(
    "passed, how, want, held, not_best",
    [
        # every passing node, in the request's order
        (["b", "a"], Ranking(), ["b", "a"], {}, None),
        ({"c", "a"}, Ranking(), ["a", "c"], {}, None),  # a set is answered in the request's order
        # held nodes fail while another passes; all held: all pass (a bind there waits)
        (["a", "b", "c"], Ranking(busy={"b": "ns/p"}.get), ["a", "c"], {"b": "ns/p"}, None),
        (["a", "b"], Ranking(busy={"a": "ns/p", "b": "ns/q"}.get), ["a", "b"], {}, None),
        # keep-best: the policy's best one; the others counted, not answered
        ({"a", "b", "c"}, Ranking(1, order_best(["c", "b", "a"])), ["c"], {}, 2),
        # ... its best held: the next, the held one failed
        (
            {"a", "b", "c"},
            Ranking(1, order_best(["c", "b", "a"]), {"c": "ns/p"}.get),
            ["b"],
            {"c": "ns/p"},
            1,
        ),
        # no more pass than kept: no ranking, the request's order, held ones out
        ({"a", "c"}, Ranking(2, order_best(["c", "a"]), {"a": "ns/p"}.get), ["c"], {"a": "ns/p"}, None),
        # a sample's ranking applies however few pass
        ({"a", "c"}, Ranking(2, order_best(["c", "a"]), always=True), ["c", "a"], {}, 0),
    ],
)
def test_rank(passed, how, want, held, not_best) -> None:
    v = verdict(passed)
    before = frozen(v)
    out = rank(v, NAMES, how)
    assert frozen(v) == before
    assert list(out.passed) == want
    assert {n: r for n, r in out.failed.items() if n != "x"} == {
        n: busy_reason(n, k) for n, k in held.items()
    }
    assert out.codes.get("handoff-pending", 0) == len(held)
    assert out.codes.get("not-best") == not_best


@pytest.mark.parametrize(
    "passed, unsettled, coming, waited, want",
    [
        (["a", "b"], {}, {}, False, ["a", "b"]),
        (["a", "b"], {}, {"c": "ns/p"}, False, ["a", "b"]),  # expected elsewhere: answered
        (["a", "b"], {}, {"a": "ns/p", "b": "ns/q"}, False, Wait(["a", "b"])),  # all expected: wait
        (["a", "b"], {}, {"a": "ns/p", "b": "ns/q"}, True, ["a", "b"]),  # waited: they pass
        (["a", "b"], {"a": "ns/p"}, {}, False, ["b"]),  # a bind arrived on a: the other node
        (["a", "b"], {"a": "ns/p", "b": "ns/q"}, {}, False, Wait(["a", "b"])),
        (["a", "b"], {"a": "ns/p", "b": "ns/q"}, {}, True, NotWhole({"a": "ns/p", "b": "ns/q"})),
        ([], {"a": "ns/p"}, {"a": "ns/p"}, False, []),  # nothing passes: nothing to wait for
    ],
)
def test_settle(passed, unsettled, coming, waited, want) -> None:
    v = verdict(passed)
    before = frozen(v)
    out = settle(v, unsettled, coming, waited)
    assert frozen(v) == before
    if isinstance(want, list):
        assert isinstance(out, Verdict) and list(out.passed) == want
        gone = [n for n in passed if n not in want]
        assert out.codes.get("handoff-pending", 0) == len(gone)
        assert all(out.failed[n] == busy_reason(n, unsettled[n]) for n in gone)
    else:
        assert out == want
