"""The scale of the extender's prioritize answer, which the simulator's pipeline model mixes into
kube-scheduler's scores the same way.

kube-scheduler takes an extender's scores as 0..MAX_SCORE (its MaxExtenderPriority) and multiplies
them by the extender's weight; the policy's raw scores are on any scale, so prioritize maps them
linearly from the lowest..highest among the nodes asked about to 0..MAX_SCORE, rounded.
"""

from __future__ import annotations

from collections.abc import Collection

MAX_SCORE = 10


def normalised(raw: Collection[float]) -> dict[float, int]:
    """Each distinct raw score -> its 0..MAX_SCORE score over `raw`'s lowest..highest; every score
    MAX_SCORE when they are all (nearly) equal. Keyed by value: the nodes in one state share it."""
    if not raw:
        return {}
    lo, hi = min(raw), max(raw)
    span = hi - lo
    if span < 1e-12:
        return dict.fromkeys(raw, MAX_SCORE)
    return {v: round(MAX_SCORE * (v - lo) / span) for v in set(raw)}
