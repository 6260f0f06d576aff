"""The filter's stages after the placement answer, each a function of one input to one output that
changes nothing it is given (filtering.Filter runs them in order):

    candidates (the shape's answer or a new shape's sample, filtering.py)
      -> steer   a pod with its own defrag reservation goes to the reserved nodes only
      -> rank    the nodes answered: the policy's best few or all, none held by another bind
      -> settle  no node answered is about to take a pod whose room no fit sees yet
      -> answer  (filtering.py: the expectation, the metrics, the extender/v1 JSON)

A `Verdict` is what the filter would answer so far; every stage returns a new one."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from gpupack.contract import Reservation

# node -> the key of the pod that holds it (another pod's bind, handoff or expected bind), or None
Busy = Callable[[str], str | None]
# (passing nodes, keep, busy, skipped) -> the kept nodes, best first; those busy held noted in skipped
Best = Callable[[Collection[str], int, Busy | None, dict[str, str]], list[str]]


def busy_reason(node: str, key: str) -> str:
    return f"node {node}: pod {key} is being bound there or waits for its kubelet (GPU handoff)"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the filter answers so far: the nodes that pass (`passed`: in the request's order, or,
    before ranking a whole answer with keep-best, the set of them), the reason of each node that
    does not (`failed`, `unresolvable`) and how many nodes each reason code left out (`codes`)."""

    passed: Collection[str]
    failed: Mapping[str, str]
    unresolvable: Mapping[str, str]
    codes: Mapping[str, int]

    def without(self, reasons: Mapping[str, str], code: str, kept: Collection[str]) -> Verdict:
        """This verdict with `kept` passing and the nodes of `reasons` failed for them, counted as `code`."""
        if not reasons:
            return replace(self, passed=kept)
        codes = dict(self.codes)
        codes[code] = codes.get(code, 0) + len(reasons)
        return Verdict(kept, {**self.failed, **reasons}, self.unresolvable, codes)

    def counted(self, code: str, k: int) -> Verdict:
        """This verdict with `k` more nodes counted as left out for `code` (no reason is answered)."""
        return replace(self, codes={**self.codes, code: self.codes.get(code, 0) + k})


def take_best(
    ordered: Iterable[str],
    keep: int,
    busy: Callable[[str], str | None] | None = None,
    skipped: dict[str, str] | None = None,
) -> list[str]:
    """The first `keep` of `ordered` (passing nodes, the policy's best first) that `busy` does not
    hold, those it holds before the last one kept noted in `skipped` (node -> the pod holding it);
    when it holds every one, the best of them, as without `busy`, none noted."""
    kept: list[str] = []
    held: list[str] = []
    for n in ordered:
        if busy is not None and (k := busy(n)) is not None:
            held.append(n)
            if skipped is not None:
                skipped[n] = k
            continue
        kept.append(n)
        if len(kept) == keep:
            break
    if not kept and held:
        kept = held[:keep]
        if skipped is not None:
            skipped.clear()
    return kept


@dataclass(frozen=True, slots=True)
class Ranking:
    """How `rank` chooses the nodes answered: with `best` the `keep` the policy prefers, when more
    than `keep` pass (always, with `always`); without, every passing node in the request's order.
    Nodes `busy` holds are left out while another passes."""

    keep: int = 0
    best: Best | None = None
    busy: Busy | None = None
    always: bool = False


def steer(v: Verdict, steered: Mapping[str, Reservation]) -> Verdict:
    """A pod with its own defrag reservation on some passing nodes passes only there; the others
    fail naming the node and the reservation (`steered`: node -> the pod's reservation there)."""
    wanted = [n for n in v.passed if n in steered] if steered else []
    if not wanted:
        return v
    target = wanted[0]
    why = f"pod is steered to node {target} by defrag reservation {steered[target].id}"
    return v.without({n: why for n in v.passed if n not in steered}, "reservation-steer", wanted)


def rank(v: Verdict, names: list[str], how: Ranking) -> Verdict:
    """The nodes answered, by `how`: those another pod's bind or handoff holds fail (counted as
    handoff-pending) while another passes; passing nodes the policy did not keep are only counted
    (not-best): kube-scheduler reads reasons only when no node passes, and one does here."""
    pool = v.passed
    skipped: dict[str, str] = {}
    if how.best is not None and (how.always or len(pool) > how.keep):
        kept = how.best(pool, how.keep, how.busy, skipped)
        held = {n: busy_reason(n, k) for n, k in skipped.items()}
        left = len(pool) - len(kept) - len(held)
        return v.without(held, "handoff-pending", kept).counted("not-best", left)
    order = pool if isinstance(pool, list) else [n for n in names if n in pool]
    if how.busy is None:
        return replace(v, passed=order)
    kept = take_best(order, len(order), how.busy, skipped)
    return v.without({n: busy_reason(n, k) for n, k in skipped.items()}, "handoff-pending", kept)


@dataclass(frozen=True, slots=True)
class Wait:
    """The filter waits for the room of a bind to be charged on one of `nodes`, then answers again."""

    nodes: list[str]


@dataclass(frozen=True, slots=True)
class NotWhole:
    """Every node that passes is taking a pod whose room no fit sees yet: the answer is an error to
    retry (`by`: node -> that pod's key)."""

    by: Mapping[str, str]


def settle(
    v: Verdict, unsettled: Mapping[str, str], coming: Mapping[str, str], waited: bool
) -> Verdict | Wait | NotWhole:
    """The nodes answered once none is about to take a pod whose room no fit sees yet
    (`unsettled`: a bind that has arrived and holds nothing yet; `coming`: a bind expected any
    moment). Before waiting once (`waited`), a filter whose every node is such waits for that room;
    after, a node only expected passes (that pod may never come), one whose bind has arrived fails
    while another passes, and with none the answer is an error to retry."""
    passed = list(v.passed)
    if passed and not waited and coming and all(n in coming or n in unsettled for n in passed):
        return Wait(passed)
    if not any(n in unsettled for n in passed):
        return v
    whole = [n for n in passed if n not in unsettled]
    if not whole and not waited:
        return Wait([n for n in passed if n in unsettled])
    held = {n: busy_reason(n, unsettled[n]) for n in passed if n in unsettled}
    if not whole:
        return NotWhole(unsettled)
    return v.without(held, "handoff-pending", whole)
