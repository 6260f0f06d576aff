"""The order of a new best-node index (answers.sorted_index) is exactly the sort of its
(key, node) tuples, whatever the scores, ties and nodes the policy has not ranked."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extender.verbs.scoring import sorted_index

nodes = st.lists(st.sampled_from([f"n{i}" for i in range(30)]), unique=True, max_size=30)
scores = st.one_of(st.none(), st.sampled_from([0.0, 1.5, -2.0, 7.25]), st.floats(-1e6, 1e6))


@pytest.mark.slow
@given(nodes, st.data())
def test_sorted_index_is_the_tuple_sort(names, data):
    tie = {n: data.draw(st.sampled_from([0.1, 0.5, 0.9, data.draw(st.floats(0, 0.99))])) for n in names
           if data.draw(st.booleans())}  # fmt: skip
    ranked = sorted(tie, key=lambda n: (tie[n], n))
    scored = {}
    for n in names:
        s = data.draw(scores)
        if s is not None:
            scored[n] = s
    key_of = {n: (scored.get(n) is None, -(scored.get(n) or 0.0), tie.get(n, 2.0)) for n in names}
    assert sorted_index(key_of, scored, ranked) == sorted((k, n) for n, k in key_of.items())


def test_a_score_that_is_not_finite_sorts_as_the_tuples_do():
    scored = {"a": math.inf, "b": 1.0}
    key_of = {n: (False, -v, 0.5) for n, v in scored.items()} | {"c": (True, -0.0, 0.5)}
    assert sorted_index(key_of, scored, ["a", "b", "c"]) == sorted((k, n) for n, k in key_of.items())
