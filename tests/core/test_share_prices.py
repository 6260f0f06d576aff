"""The share prices (cutting-stock duals) and the packing cost the gpupack policy charges with them."""

from fractions import Fraction
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.gpupack_policy import GpupackPolicy, _amount, _take, share_counts, share_size
from gpupack.core.model import FULL, GPU, ContainerRequest, Node, PodRequest
from gpupack.core.share_prices import MAX_SIZES, NO_PRICES, SCALE, share_prices
from gpupack.core.workload import Shape, Workload


def gpus_of(prices):
    return round(prices.gpus, 6)


def test_one_size_is_worth_what_fits():
    p = share_prices({500: 10})
    assert p.price == {500: SCALE // 2}
    assert gpus_of(p) == 5.0
    assert p.value[FULL] == SCALE and p.value[499] == 0 and p.value[500] == SCALE // 2
    assert p.cost(FULL, 500) == 0 and p.cost(500, 0) == 0
    # 500 taken from 700 free leaves 200, where nothing fits: the 500 wasted nothing it could use
    assert p.cost(700, 200) == 0


def test_scarce_fillers_are_worth_nothing():
    # 14 pods of 810 for each 160: most 190-milli holes stay empty, so a 160 is free and an 810
    # costs a whole GPU; a 320 in the 530 a 470 leaves costs a sixth of a GPU, next to a 650 nothing
    p = share_prices({810: 1400, 160: 100, 470: 1000, 320: 500, 650: 500})
    assert p.of(160) == 0 and p.of(810) == SCALE
    assert p.of(470) == SCALE // 2
    assert p.cost(530, 210) == round(SCALE / 6)
    assert p.cost(350, 30) == 0
    assert p.cost(FULL, 680) == 0
    # a 160 into a hole a 320 could fill loses that 320's worth
    assert p.cost(350, 190) == p.of(320)


def test_a_size_outside_the_program_is_priced_by_what_it_holds():
    counts = {10 * (i + 1): 100 - i for i in range(MAX_SIZES + 5)}
    p = share_prices(counts)
    assert len(p.price) == MAX_SIZES
    rare = 10 * (MAX_SIZES + 3)
    assert rare not in p.price and p.of(rare) == p.value[rare + 1]


def test_no_shares_no_prices():
    assert share_prices({}) is NO_PRICES
    assert share_prices({0: 3, FULL: 4}) is NO_PRICES
    assert NO_PRICES.cost(FULL, 300) == 0


def _best_pattern_value(prices: dict[int, Fraction]) -> Fraction:
    """Brute force: the most a GPU's worth of shares is worth at `prices`."""
    sizes = sorted(prices)
    best = Fraction(0)
    ranges = [range(FULL // s + 1) for s in sizes]
    for counts in product(*ranges):
        if sum(c * s for c, s in zip(counts, sizes, strict=True)) <= FULL:
            best = max(best, sum(c * prices[s] for c, s in zip(counts, sizes, strict=True)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(120, 990), st.integers(1, 500), min_size=1, max_size=4))
def test_prices_are_an_optimal_dual(counts):
    """Strong duality: no GPU packing is worth more than a GPU at these prices (dual feasible,
    checked by brute force), and what the pods are worth equals the GPUs the program needs."""
    p = share_prices(counts)
    prices = {s: Fraction(v, SCALE) for s, v in p.price.items()}
    # each price is rounded to a millionth: a pattern of k shares may gain k/2 of them
    assert _best_pattern_value(prices) <= 1 + Fraction(FULL // min(prices), 2 * SCALE)
    worth = sum(counts[s] * prices[s] for s in prices)
    assert abs(float(worth) - p.gpus) <= 1e-5 * max(1.0, p.gpus)
    volume = sum(s * n for s, n in counts.items()) / FULL
    singles = sum(n / (FULL // s) for s, n in counts.items())
    assert volume - 1e-6 <= p.gpus <= singles + 1e-6


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.integers(1, 999), st.integers(1, 1000), min_size=1, max_size=12),
    st.integers(0, FULL),
    st.integers(0, FULL),
)
def test_cost_is_never_negative_and_value_grows(counts, before, take):
    p = share_prices(counts)
    assert p.value[0] == 0
    assert all(a <= b for a, b in zip(p.value, p.value[1:], strict=False))
    after = max(0, before - take)
    assert p.cost(before, after) >= 0  # clamped; what makes it so without the clamp, below
    assert p.cost(before, before) == 0
    # value is superadditive (two GPUs' worth of free milli fit in their sum), so taking a program
    # size costs no less than zero before rounding: value[before] >= value[after] + price
    d = before - after
    assert p.value[before] >= p.value[after] + p.value[d] - 2
    if d in p.price:
        assert p.value[before] >= p.value[after] + p.price[d] - 3


def test_share_counts_by_class_and_gpu_memory():
    wl = Workload.of(
        [Shape(0, 1, 300, 0, None, "online")] * 3
        + [Shape(0, 1, 300, 0, None, "offline")] * 5
        + [Shape(0, 1, 0, 8000, None, None)] * 2  # memory only: its size depends on the GPU
        + [Shape(0, 2, 400, 0, None, "online")]  # two shares of 400
        + [Shape(0, 1, FULL, 0, None, "online")] * 7  # whole GPUs are not shares
    )
    assert share_counts(wl.counts, "online", 16000) == {300: 3, 500: 2, 400: 2}
    assert share_counts(wl.counts, "offline", 32000) == {300: 5, 250: 2}
    assert share_size(300, 12000, 16000) == 750 and share_size(300, 0, 0) == 300


def _gpu(node, i, used_milli):
    g = GPU(f"{node}-{i}", i, "A10", 24576)
    if used_milli:
        g.milli_used = used_milli
        g.mem_used = 24576 * used_milli // FULL
        g.pod_class = "online"
        g.holders = {"x": (g.mem_used, used_milli)}
    return g


def test_policy_puts_a_share_where_the_packing_loses_nothing():
    """Where the packing cost and the one-GPU look-ahead disagree (the old policy's choices, with
    the price weight at 0, are the first GPU in both cases)."""
    shapes = [Shape(0, 1, 810)] * 1400 + [Shape(0, 1, 160)] * 100 + [Shape(0, 1, 470)] * 1000
    shapes += [Shape(0, 1, 320)] * 500 + [Shape(0, 1, 650)] * 500 + [Shape(0, 1, 230)] * 300
    shapes += [Shape(0, 1, FULL)] * 800
    policy = GpupackPolicy(workload=Workload.of(shapes))

    def share(m):
        return PodRequest("p", "online", (ContainerRequest("c", 1, None, m),))

    # a 320 in the 530 a 470 leaves strands 210 that scarce 160s will not fill: an idle GPU instead
    # (its 680 takes a 650), and the 530 stays for another 470
    node = Node("n", [_gpu("n", 0, 470), _gpu("n", 1, 0)])
    assert list(policy.fit(node, share(320)).charged) == [1]
    # a 230 in the 350 a 650 leaves takes a 320's place: the 470's GPU (530 -> 300, a 230 more)
    node = Node("n", [_gpu("n", 0, 650), _gpu("n", 1, 470)])
    assert list(policy.fit(node, share(230)).charged) == [1]
    # the node score tells the same: one node of each kind, the 470's wins
    a = Node("a", [_gpu("a", 0, 650)])
    b = Node("b", [_gpu("b", 0, 470)])
    pod = share(230)
    assert policy.node_score(b, pod, policy.fit(b, pod)) > policy.node_score(a, pod, policy.fit(a, pod))


def test_learnt_prices_follow_the_workload():
    policy = GpupackPolicy()
    for _ in range(20):
        policy.observe(PodRequest("p", "online", (ContainerRequest("c", 1, None, 500),)))
    first = policy.prices("online", 24576)
    assert first.price == {500: SCALE // 2}
    assert policy.prices("online", 24576) is first  # not solved again while the workload holds
    for _ in range(40):
        policy.observe(PodRequest("p", "online", (ContainerRequest("c", 1, None, 300),)))
    later = policy.prices("online", 24576)
    assert set(later.price) == {300, 500}


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.integers(256, 40000), st.integers(8000, 96000), st.sampled_from([0, 50, 100, 250]))
def test_a_workload_of_one_memory_share_packs_at_no_cost(mem, gpu_mem, milli):
    """Free amounts normalised from memory are floored, so the k-th share of M MiB takes one milli
    more or less than the first: each share that still fits must cost nothing all the same."""
    shape = Shape(0, 1, milli, mem)
    size = share_size(milli, mem, gpu_mem)
    if not 0 < size < FULL:
        return
    policy = GpupackPolicy(workload=Workload.of([shape] * 40))
    prices = policy.prices("online", gpu_mem)
    v = (FULL, gpu_mem, gpu_mem, None, True)
    while v[0] >= milli and v[1] >= mem:
        t = _take(v, mem, milli, "online")
        assert prices.cost(_amount(v), _amount(t)) == 0, (v, t)
        v = t
