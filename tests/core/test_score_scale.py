"""The extender's prioritize scale (gpupack.core.score_scale), which the pipeline model mixes too."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupack.core.score_scale import MAX_SCORE, normalised


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ([], {}),
        ([3.0], {3.0: MAX_SCORE}),
        ([5.0, 5.0], {5.0: MAX_SCORE}),
        ([0.0, 50.0, 100.0], {0.0: 0, 50.0: 5, 100.0: 10}),
        ([-2.0, -1.0, 18.0], {-2.0: 0, -1.0: 0, 18.0: 10}),
        ([0.0, 0.25, 1.0], {0.0: 0, 0.25: 2, 1.0: 10}),  # round half to even, as Python rounds
    ],
)
def test_table(raw, want):
    assert normalised(raw) == want


@given(st.lists(st.integers(-10_000, 10_000).map(float), min_size=2))
def test_lowest_is_zero_highest_is_max_and_order_is_kept(raw):
    norm = normalised(raw)
    if min(raw) == max(raw):
        assert set(norm.values()) == {MAX_SCORE}
        return
    assert norm[min(raw)] == 0 and norm[max(raw)] == MAX_SCORE
    ranked = sorted(norm)
    assert all(norm[a] <= norm[b] for a, b in zip(ranked, ranked[1:], strict=False))
