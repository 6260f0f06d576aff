"""The learning batches (gpupack.core.learning): when the pods a learning policy is shown reach it.
The extender and the simulator's pipeline model both run this rule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.learning import (
    OBSERVE_BATCH_MAX,
    OBSERVE_FLUSH_S,
    OBSERVE_GROWTH,
    OBSERVE_MIN_GAP_S,
    OBSERVE_WARMUP,
    SEEN_MAX,
    LearningBatcher,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def flushes(gaps: list[float]) -> list[int]:
    """Batch sizes for pods arriving `gaps[i]` seconds after the one before (the first at 0)."""
    clock = Clock()
    learnt: list[int] = []
    b: LearningBatcher[int] = LearningBatcher(learnt.append, clock)
    sizes = []
    for i, gap in enumerate(gaps):
        clock.t += gap
        before = len(learnt)
        if b.offer(f"p{i}", i):
            sizes.append(len(learnt) - before)
    return sizes


@pytest.mark.parametrize(
    ("gap", "n", "want"),
    [
        # slow arrivals: the counts decide (1, 3, 12, 48: x OBSERVE_GROWTH what is learnt), then a
        # flush once more than OBSERVE_FLUSH_S has passed (49 pods at 1.25 s)
        (1.25, 64 + 98, [1, 3, 12, 48, 49, 49]),
        # slower still: OBSERVE_FLUSH_S ends the warm-up's last batch early (31 pods at 2 s)
        (2.0, 16 + 62, [1, 3, 12, 31, 31]),
        # a burst at 4 pods/s: the first at once; 3 waiting, but no flush before OBSERVE_MIN_GAP_S
        # (4 at 1 s); then 15 and 60 waiting; past the warm-up one flush a minute (241 pods)
        (0.25, 1 + 4 + 15 + 60 + 241, [1, 4, 15, 60, 241]),
    ],
)
def test_batches_grow_by_the_growth_factor_and_wait_for_the_gap(gap, n, want):
    assert flushes([0.0] + [gap] * (n - 1)) == want


def test_past_the_warm_up_a_batch_of_batch_max_flushes_within_the_minute():
    gaps = [0.0] + [1.0] * 63 + [0.001] * (OBSERVE_BATCH_MAX + 10)
    sizes = flushes(gaps)
    assert sizes[-1] == OBSERVE_BATCH_MAX


def test_a_pod_offered_again_is_learnt_once():
    clock = Clock()
    learnt: list[str] = []
    b: LearningBatcher[str] = LearningBatcher(learnt.append, clock)
    assert b.offer("uid-a", "a") and b.flushes == 1
    clock.t = 100.0
    assert not b.offer("uid-a", "a") and b.waiting == []
    assert b.offer("uid-b", "b") and learnt == ["a", "b"] and b.flushes == 2


def test_only_the_last_seen_max_identities_are_remembered():
    clock = Clock()
    b: LearningBatcher[int] = LearningBatcher(lambda p: None, clock)
    for i in range(SEEN_MAX + 1):
        b.offer(f"p{i}", i)
    waiting = len(b.waiting)
    b.offer("p0", 0)  # forgotten: offered again as new
    b.offer(f"p{SEEN_MAX}", SEEN_MAX)  # remembered
    assert len(b.waiting) == waiting + 1


def reference_observe(times: list[float], idents: list[str]) -> list[tuple[int, list[int]]]:
    """Extender._observe as of 19fa632 (extender/verbs/framework.py), over a clock reading `times[i]` at
    the i-th offer: (offer index, pods learnt) per flush."""
    observed: dict[str, None] = {}
    unobserved: list[int] = []
    total = 0
    last = 0.0
    out = []
    for i, (now, ident) in enumerate(zip(times, idents, strict=True)):
        if ident in observed:
            continue
        observed[ident] = None
        unobserved.append(i)
        since = now - last
        if total == 0:
            due = True
        else:
            batch = total * OBSERVE_GROWTH if total < OBSERVE_WARMUP else OBSERVE_BATCH_MAX
            due = (len(unobserved) >= batch and since >= OBSERVE_MIN_GAP_S) or since > OBSERVE_FLUSH_S
        if due:
            out.append((i, list(unobserved)))
            total += len(unobserved)
            unobserved.clear()
            last = now
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0.0, 0.01, 0.3, 0.99, 1.0, 2.5, 30.0, 61.0]), st.integers(0, 40)),
        min_size=1,
        max_size=300,
    )
)
def test_the_batcher_is_the_extenders_observe(arrivals):
    """Same flushes, same pods in each, as the extender's own rule; every distinct pod is learnt once,
    in the order offered, and flushes are at least OBSERVE_MIN_GAP_S apart."""
    times = list(itertools.accumulate(g for g, _ in arrivals))
    idents = [f"p{k}" for _, k in arrivals]
    clock = Clock()
    learnt: list[int] = []
    b: LearningBatcher[int] = LearningBatcher(learnt.append, clock)
    got = []
    flushed_at = []
    for i, (t, ident) in enumerate(zip(times, idents, strict=True)):
        clock.t = t
        before = len(learnt)
        if b.offer(ident, i):
            got.append((i, learnt[before:]))
            flushed_at.append(t)
    assert got == reference_observe(times, idents)
    assert learnt + b.waiting == sorted({idents.index(x): x for x in idents})
    assert all(b - a >= OBSERVE_MIN_GAP_S for a, b in itertools.pairwise(flushed_at))
