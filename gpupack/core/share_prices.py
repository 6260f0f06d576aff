"""What each GPU share is worth when the workload's shares are packed as well as they can be.

The sharing pods of a workload, taken as a one-dimensional cutting-stock problem (Gilmore and
Gomory, 1961): cover `count` pods of each share size with as few GPUs as possible, a GPU holding
any combination of shares that sums to at most `FULL`. Its linear relaxation, solved by column
generation (a revised simplex whose entering column is the best knapsack pattern), gives each
size a dual price `price[s]` — the fraction of a GPU a pod of that size is worth in the best
packing — and from those the value `value[v]` of `v` free milli: the most a GPU with `v` free can
still absorb, ``max Σ price over shares fitting in v``.

A placement that takes `s` from a GPU with `before` free leaves `after`; its cost
``value[before] − value[after] − price[s]`` is never negative, and zero when the share fits
in a best packing: a 320-milli pod next to a 650 costs nothing, the same pod in the 530
left by a 470 costs a sixth of a GPU (that hole is worth a 470's price, a 320 and the 210 it
leaves behind less). FGD and the eventual-waste table look one GPU ahead with an unlimited
supply of every size; the prices know which sizes are scarce (on openb gpushare80 there are
fourteen 810-milli pods for every 160 that could fill their holes, so a 210 hole is worth
nothing).

Integers throughout (micro-GPUs), so every code path that reads the tables decides alike; read
with one milli of slack (`SharePrices.near`, `SharePrices.cost`), since a GPU's free amount is
floored from its free memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpupack.core.model import FULL

SCALE = 1_000_000  # prices and values in millionths of a GPU
# The linear program is solved over this many of the most common share sizes; a rarer size is
# priced at what the common ones fitting in it are worth, so its cost is still never negative.
MAX_SIZES = 32
_EPS = 1e-9


@dataclass(frozen=True)
class SharePrices:
    """`value[v]`, v = 0..FULL: what `v` free milli can still absorb; `price`: per LP size;
    `near[d]`: what a share taking `d` is priced at (`cost`)."""

    value: tuple[int, ...]
    price: Mapping[int, int]
    gpus: float  # the linear program's optimum: GPUs the shares need, fractionally
    near: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A GPU's free amount is its scarcer resource normalised to milli, floored, so a share
        # asking for memory takes d ± 1 milli of it depending on what the GPU already holds: a share
        # of d is priced as the dearest program size within one milli of d, and a size outside the
        # program at what the program's sizes fitting in d + 1 are worth.
        v, p = self.value, self.price
        near = []
        for d in range(FULL + 1):
            ps = [p[s] for s in (d - 1, d, d + 1) if s in p]
            near.append(max(ps) if ps else v[min(d + 1, FULL)])
        object.__setattr__(self, "near", tuple(near))

    def of(self, size: int) -> int:
        """Price of a share of `size` milli (`near`)."""
        return self.near[min(max(size, 0), FULL)]

    def cost(self, before: int, after: int) -> int:
        """Micro-GPUs lost by taking `before − after` from a GPU with `before` free (≥ 0).

        What is left is read with the same milli of slack as `near`: ``value[after + 1]``. Where
        sizes and free amounts are multiples of 10 milli (openb) neither slack changes anything."""
        if not 0 <= after <= before <= FULL:
            before = min(max(before, 0), FULL)
            after = min(max(after, 0), before)
        value = self.value
        c = value[before] - value[after + 1 if after < before else after] - self.near[before - after]
        return c if c > 2 else 0  # rounding of three independently rounded terms


NO_PRICES = SharePrices((0,) * (FULL + 1), {}, 0.0)


def _knapsack(sizes: list[int], prices: list[float]) -> tuple[list[float], list[int]]:
    """Unbounded knapsack over capacities 0..FULL: best total price and the last size taken."""
    best = [0.0] * (FULL + 1)
    last = [-1] * (FULL + 1)
    items = sorted(
        ((s, p, i) for i, (s, p) in enumerate(zip(sizes, prices, strict=True)) if p > _EPS),
        key=lambda t: t[0],
    )
    for v in range(1, FULL + 1):
        b, arg = best[v - 1], -1
        for s, p, i in items:
            if s > v:
                break
            c = best[v - s] + p
            if c > b + _EPS:
                b, arg = c, i
        best[v] = b
        last[v] = arg
    return best, last


def _pattern(sizes: list[int], last: list[int], v: int) -> list[int]:
    out = [0] * len(sizes)
    while v > 0:
        i = last[v]
        if i < 0:
            v -= 1
        else:
            out[i] += 1
            v -= sizes[i]
    return out


def _duals(sizes: list[int], counts: list[int], max_iter: int) -> tuple[list[float], float]:
    """Dual prices of ``min Σx s.t. Σ_p a_p x_p ≥ counts, x ≥ 0`` over all packings `a_p`."""
    m = len(sizes)
    # Start from one GPU per pattern of a single size; the basis stays square, m columns.
    basis: list[list[int]] = [[FULL // s if j == i else 0 for j in range(m)] for i, s in enumerate(sizes)]
    cost = [1.0] * m
    binv = [[(1.0 / basis[i][i]) if j == i else 0.0 for j in range(m)] for i in range(m)]
    x = [counts[i] / basis[i][i] for i in range(m)]
    pi = [0.0] * m
    for _ in range(max_iter):
        pi = [sum(cost[r] * binv[r][j] for r in range(m)) for j in range(m)]
        # A negative price means the basis over-covers that size for free: let its surplus enter.
        neg = min(range(m), key=lambda j: pi[j])
        if pi[neg] < -_EPS:
            col, c = [-1 if j == neg else 0 for j in range(m)], 0.0
        else:
            best, last = _knapsack(sizes, pi)
            if best[FULL] <= 1.0 + _EPS:
                break
            col, c = _pattern(sizes, last, FULL), 1.0
        d = [sum(binv[r][j] * col[j] for j in range(m) if col[j]) for r in range(m)]
        leave, ratio = -1, 0.0
        for r in range(m):
            if d[r] > _EPS:
                t = x[r] / d[r]
                if leave < 0 or t < ratio - _EPS:
                    leave, ratio = r, t
        if leave < 0:  # cannot happen for a covering problem; keep the prices found
            break
        piv = d[leave]
        row = [v / piv for v in binv[leave]]
        for r in range(m):
            if r != leave and d[r]:
                f = d[r]
                br = binv[r]
                for j in range(m):
                    br[j] -= f * row[j]
                x[r] -= f * ratio
        binv[leave] = row
        x[leave] = ratio
        cost[leave] = c
    return [max(0.0, p) for p in pi], sum(x[r] * cost[r] for r in range(m))


def share_prices(counts: Mapping[int, int], max_iter: int = 400) -> SharePrices:
    """Prices for share sizes (milli, 0 < s < FULL) seen `counts[s]` times (`SharePrices`)."""
    seen = [(s, n) for s, n in counts.items() if 0 < s < FULL and n > 0]
    kept = sorted(seen, key=lambda t: (-t[1], t[0]))[:MAX_SIZES]
    if not kept:
        return NO_PRICES
    kept.sort()
    sizes = [s for s, _ in kept]
    pi, gpus = _duals(sizes, [n for _, n in kept], max_iter)
    best, _ = _knapsack(sizes, pi)
    value = tuple(round(v * SCALE) for v in best)
    price = {s: round(p * SCALE) for s, p in zip(sizes, pi, strict=True)}
    return SharePrices(value, price, gpus)
