"""LeaseFence's shared fresh reads, with the Lease read held mid-flight (a timing the real API
server will not produce on demand; tests/extender/test_extender_throughput.py and the handoff
cases check the fence against the real one)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from extender.api.lease import LeaseFence


class HeldLease:
    """A Kube whose read_lease answers the holder set at the moment the read starts, and returns
    only when the test lets it (`release`)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.reads = 0
        self.fail_next = False
        self._cv = threading.Condition()
        self._released = 0

    def read_lease(self, namespace: str, name: str) -> dict[str, Any]:
        with self._cv:
            self.reads += 1
            n = self.reads
            holder, fail = self.holder, self.fail_next
            self.fail_next = False
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._released >= n, timeout=10)
        if fail:
            raise ApiException(status=503, reason="Service Unavailable")
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return {"spec": {"holderIdentity": holder, "renewTime": now, "leaseDurationSeconds": 120}}

    def wait_reads(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.reads >= n, timeout=10), (self.reads, n)

    def release(self, n: int) -> None:
        with self._cv:
            self._released = n
            self._cv.notify_all()


def _fence(kube: HeldLease) -> LeaseFence:
    return LeaseFence(kube, "ns", "sched", "me", margin_s=5.0)  # type: ignore[arg-type]


def _check_in_thread(fence: LeaseFence, out: dict[str, str], key: str) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(key, fence.problem()), daemon=True)
    t.start()
    return t


def _waiting(fence: LeaseFence, n: int) -> None:
    """Until n threads wait for the fence's next read."""
    deadline = time.monotonic() + 10
    while len(fence._turn._waiters) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "checks never queued"
        time.sleep(0.005)


def test_a_check_never_takes_the_answer_of_a_read_that_began_before_it_asked() -> None:
    kube = HeldLease("me_1")
    fence = _fence(kube)
    out: dict[str, str] = {}
    first = _check_in_thread(fence, out, "first")
    kube.wait_reads(1)  # read 1 is on its way, with the Lease still ours
    kube.holder = "other_2"  # another replica's scheduler takes the Lease
    late = [_check_in_thread(fence, out, f"late{i}") for i in range(3)]
    _waiting(fence, 3)
    kube.release(1)
    first.join(10)
    assert out["first"] == ""  # read 1 began before the Lease moved: that check may write
    kube.wait_reads(2)
    kube.release(2)
    for t in late:
        t.join(10)
    # the three later checks shared read 2, which began after they asked, and saw the new holder
    assert kube.reads == 2
    for i in range(3):
        assert "is held by other_2" in out[f"late{i}"], out


def test_checks_that_arrive_during_a_read_share_one_more_read_and_later_ones_read_again() -> None:
    kube = HeldLease("me_1")
    fence = _fence(kube)
    out: dict[str, str] = {}
    first = _check_in_thread(fence, out, "first")
    kube.wait_reads(1)
    waiting = [_check_in_thread(fence, out, f"w{i}") for i in range(5)]
    _waiting(fence, 5)
    kube.release(1)
    kube.wait_reads(2)  # one of the five reads for all of them
    late = _check_in_thread(fence, out, "late")  # asked while read 2 runs: needs read 3
    _waiting(fence, 5)  # the four whose read 2 is on its way, and this one
    kube.release(2)
    for t in [first, *waiting]:
        t.join(10)
    assert kube.reads >= 2 and all(out[k] == "" for k in ["first", *(f"w{i}" for i in range(5))])
    kube.wait_reads(3)
    assert "late" not in out
    kube.release(3)
    late.join(10)
    assert out["late"] == "" and kube.reads == 3


def test_a_failed_shared_read_refuses_the_checks_it_answered_and_the_next_check_reads_again() -> None:
    kube = HeldLease("me_1")
    fence = _fence(kube)
    out: dict[str, str] = {}
    kube.fail_next = True
    first = _check_in_thread(fence, out, "first")
    kube.wait_reads(1)
    kube.release(1)
    first.join(10)
    assert "cannot read Lease ns/sched" in out["first"]
    # fails closed, and nothing of it is reused: the next check reads and may write
    kube.release(2)
    assert fence.problem() == "" and kube.reads == 2
    # a reused pass (fresh=False) comes only from a good read
    assert fence.problem(fresh=False) == "" and kube.reads == 2


def test_a_read_that_raises_leaves_the_fence_usable() -> None:
    class Broken(HeldLease):
        def read_lease(self, namespace: str, name: str) -> dict[str, Any]:
            raise RuntimeError("connection pool closed")

    fence = _fence(Broken("me_1"))
    for _ in range(2):  # the second call would hang if the first had left a read marked running
        with pytest.raises(RuntimeError):
            fence.problem()
