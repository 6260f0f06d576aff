"""A lower bound on unallocated GPUs: the most GPU milli any placement of the arrived pods can allocate.

The replay (docs/simulate.md, "Replay rules") never removes a pod and drops one that does not fit,
so after an arrival allocated = arrived - dropped. Whatever the policy, and even for an offline
packer that knows every arrived pod, allocated <= :func:`max_allocated` of the arrived pods, so
unallocated >= 100 - max_allocated / capacity (% of capacity). The figure is a linear program
solved by HiGHS through scipy.

What it keeps exact:
- GPU models: a pod class goes only on node types whose model its gpu_spec allows.
- Per node: a class whose CPU, RAM or GPU count exceeds a node's never goes on that node type.
- Per GPU: the shares on one GPU add up to at most 1000 milli, and a whole-GPU pod takes a GPU no
  share uses. This is an arc-flow model per node type (Valerio de Carvalho), whose LP relaxation
  equals the Gilmore-Gomory configuration LP: it implies every inequality a dual-feasible
  function gives (a share > 500 needs a GPU of its own among shares > 500 and whole GPUs,
  Fekete-Schepers u^(k), ...), so none is added separately.
- Per node, on GPU counts: multi-GPU pods take whole GPUs of one node (a second, tiny arc-flow per
  node type over 0..GPUs of a node, where single GPUs are items of size 1).
- CPU and RAM per node type: the type's pods use at most count x the node's CPU and RAM.

What it relaxes (so the true optimum allocates less, and unallocated is higher):
- Integrality: pods, GPU patterns and node patterns are counted fractionally.
- Node boundaries for CPU and RAM: a node type's nodes pool their CPU and RAM (each pod still fits
  one node), and the GPU and node patterns are not tied to the node whose CPU they use.
- Arrival order: any pod may be left out, as an offline optimum that holds an 810-milli share back
  for pods that fill a GPU would do; CPU-only pods, which allocate no GPU, are then all left out.
  cpu_only="replay" puts back the replay's rule for them (one is left out only when no node has
  room for it when it arrives), per arrival window, and its consequence that no pod of a later
  window asking at least as much CPU and RAM fits anywhere either. It still relaxes the order
  within a window (a window's pods all count as arrived before the one left out) and "no node
  has room" per node (pooled per type, the type's nodes split fractionally between short of CPU
  and short of RAM). On cpu300, seed 42, at the bin's last event it raises the bound from 2.96 to
  3.05 (4 windows, 12 s), 3.33 (8 windows, 23 s) and 3.46 (16 windows, HiGHS's proven bound at
  a 200 s limit); on cpu235 (8 windows) it moves nothing (2.93).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gpupack.core.model import FULL
from gpupack.simulate.openb import NodeList, PodList

CpuOnly = Literal["replay", "optional"]


@dataclass(frozen=True)
class NodeType:
    cpu: int
    ram: int
    gpus: int
    model: str
    count: int


@dataclass(frozen=True)
class PodClass:
    cpu: int
    ram: int
    num: int  # GPUs
    milli: int  # per GPU
    spec: frozenset[str] | None  # allowed models; None = any

    def fits(self, t: NodeType) -> bool:
        """Whether one pod of this class fits an empty node of type `t`."""
        if self.cpu > t.cpu or self.ram > t.ram or self.num > t.gpus:
            return False
        return self.num == 0 or self.spec is None or t.model in self.spec


def node_types(nodes: NodeList) -> list[NodeType]:
    c = Counter(zip(nodes.cpu.tolist(), nodes.ram.tolist(), nodes.gpus.tolist(), nodes.model, strict=True))
    return [NodeType(int(a), int(b), int(g), m, n) for (a, b, g, m), n in sorted(c.items())]


def pod_classes(pods: PodList, idx: np.ndarray) -> Counter[PodClass]:
    return Counter(
        PodClass(
            int(pods.cpu[i]), int(pods.ram[i]), int(pods.num_gpu[i]), int(pods.gpu_milli[i]), pods.spec[i]
        )
        for i in idx
    )


class _Model:
    """Columns and sparse rows for scipy.optimize.milp."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost: float = 0.0, ub: float = np.inf, integer: bool = False) -> int:
        self.cost.append(cost)
        self.ub.append(ub)
        self.integer.append(int(integer))
        return len(self.cost) - 1

    def row(self, coef: dict[int, float], lo: float = -np.inf, hi: float = np.inf) -> None:
        if coef:
            self.rows.append((coef, lo, hi))

    def solve(self, time_limit: float | None) -> float:
        """The optimum of max -cost, or where a time limit cut a MIP short, HiGHS's proven bound on it."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        r, c, v, lo, hi = [], [], [], [], []
        for i, (coef, a, b) in enumerate(self.rows):
            for j, x in coef.items():
                r.append(i)
                c.append(j)
                v.append(x)
            lo.append(a)
            hi.append(b)
        a_mat = coo_matrix((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        options: dict[str, float | bool] = {"presolve": True}
        if time_limit is not None:
            options["time_limit"] = time_limit
        res = milp(
            np.array(self.cost),
            integrality=np.array(self.integer),
            bounds=Bounds(np.zeros(len(self.cost)), np.array(self.ub)),
            constraints=LinearConstraint(a_mat, np.array(lo), np.array(hi)),
            options=options,
        )
        bound = getattr(res, "mip_dual_bound", None)
        if res.status == 0 and res.fun is not None:
            # HiGHS proves optimality within its MIP gap (1e-4 relative by default): its dual bound
            # is the valid side. A pure LP has no gap: there dual bound and objective coincide.
            return -float(bound if bound is not None and any(self.integer) else res.fun)
        if res.status == 1 and bound is not None and np.isfinite(bound):
            return -float(bound)  # cut short: the proven bound so far
        if res.status == 1 and any(self.integer):
            self.integer = [0] * len(self.integer)  # cut short before any bound: the LP relaxation
            return self.solve(None)
        raise RuntimeError(f"the bound's program did not solve: {res.message}")


def _reachable(sizes: list[int], cap: int) -> dict[int, list[int]]:
    """Arc-flow with items in decreasing order: for each size, the vertices (load so far) an arc of
    that size may leave from. A pattern is drawn as its items largest first, so an arc of size s
    leaves only from a load made of items >= s; this keeps every pattern and drops most arcs."""
    out: dict[int, list[int]] = {}
    seen = {0}
    for s in sorted(set(sizes), reverse=True):
        frontier = sorted(seen)
        grown = set(seen)
        for v in frontier:  # any number of size-s items after the larger ones
            w = v + s
            while w <= cap and w not in grown:
                grown.add(w)
                w += s
        out[s] = sorted(v for v in grown if v + s <= cap)
        seen = grown
    return out


def _arc_flow(m: _Model, sizes: list[int], cap: int) -> tuple[dict[int, dict[int, float]], int]:
    """Paths from load 0, each a bin (a GPU, a node) filled with items in decreasing order.

    Returns per size the flow variables of its arcs (to tie to pod counts) and the variable
    counting the paths (bins used). Conservation: at every load > 0 what comes in either goes on or
    ends the bin there (waste), so in - out >= 0."""
    leave = _reachable(sizes, cap)
    arcs: dict[int, dict[int, float]] = {}
    into: dict[int, dict[int, float]] = {}
    out_of: dict[int, dict[int, float]] = {}
    for s, starts in leave.items():
        arcs[s] = {}
        for v in starts:
            x = m.var()
            arcs[s][x] = 1.0
            out_of.setdefault(v, {})[x] = 1.0
            into.setdefault(v + s, {})[x] = 1.0
    for w, ins in into.items():
        coef = dict(ins)
        for x in out_of.get(w, {}):
            coef[x] = coef.get(x, 0.0) - 1.0
        m.row(coef, lo=0.0)
    bins = m.var()
    coef = {x: 1.0 for x in out_of.get(0, {})}
    coef[bins] = -1.0
    m.row(coef, lo=0.0, hi=0.0)
    return arcs, bins


def max_allocated(
    types: list[NodeType],
    arrived: Counter[PodClass] | list[Counter[PodClass]],
    cpu_only: CpuOnly = "optional",
    time_limit: float | None = 60.0,
) -> float:
    """An upper bound on the GPU milli any placement of the arrived pods on `types` allocates.

    `arrived`: the pods by class, or by class per arrival window (consecutive stretches of the
    arrival order, earliest first); windows matter only to the CPU-only rule.

    cpu_only="optional": CPU-only pods may be left out, so the bound holds for every placement
    at all; the optimum then leaves them all out (they allocate no GPU).
    cpu_only="replay": a CPU-only pod is left out only if, when it arrived, no node had room for
    it, as in the replay and in kube-scheduler. Per CPU-only class c and window k a binary says
    whether one of its pods was left out. If not, all of them are placed. If so, at that pod's
    arrival every node of every type t was short of CPU (used >= C_t - cpu_c + 1) or of RAM (used
    >= R_t - ram_c + 1), and only pods of windows <= k can have been using it (a superset of those
    that arrived before it: a relaxation); the model keeps this as a fractional split a + b = n_t
    of the type's nodes with the type's pooled CPU >= a (C_t - cpu_c + 1) and pooled RAM >= b (R_t
    - ram_c + 1). With one window this says nothing a placement of the GPU pods followed by the
    CPU-only pods would break; with several, CPU-only pods that arrive while the cluster still has
    room must be placed and keep their CPU and RAM to the end. And since nothing leaves, once a
    pod of c was left out no node ever again has cpu_c CPU and ram_c RAM free: a pod of any later
    window asking at least both (GPU pods included) is then left out too.
    """
    if cpu_only not in ("replay", "optional"):
        raise ValueError(f"cpu_only: {cpu_only!r}")
    windows = [arrived] if isinstance(arrived, Counter) else list(arrived)
    m = _Model()
    by_type: list[list[tuple[PodClass, int, int]]] = [[] for _ in types]  # (class, window, var)
    placed: dict[tuple[PodClass, int], dict[int, float]] = {}  # pods of a class and window placed
    for k, win in enumerate(windows):
        for c, n in win.items():
            if n <= 0 or (c.num == 0 and cpu_only == "optional"):
                continue  # CPU-only and optional: left out at no GPU cost
            row = placed[c, k] = {}
            for ti, t in enumerate(types):
                if c.fits(t):
                    v = m.var(cost=-float(c.num * c.milli), ub=float(n))
                    row[v] = 1.0
                    by_type[ti].append((c, k, v))
            m.row(row, hi=float(n))
    # Pooled CPU and RAM used on each type by the pods of windows <= k.
    cpu_used: list[list[int]] = []
    ram_used: list[list[int]] = []
    for ti, t in enumerate(types):
        cu: list[int] = []
        ru: list[int] = []
        for k in range(len(windows)):
            u, r = m.var(), m.var()
            here = [(c, v) for c, kk, v in by_type[ti] if kk == k]
            prev_u = {cu[-1]: -1.0} if cu else {}
            prev_r = {ru[-1]: -1.0} if ru else {}
            m.row({u: 1.0, **prev_u, **{v: -float(c.cpu) for c, v in here}}, lo=0.0, hi=0.0)
            m.row({r: 1.0, **prev_r, **{v: -float(c.ram) for c, v in here}}, lo=0.0, hi=0.0)
            cu.append(u)
            ru.append(r)
        m.row({cu[-1]: 1.0}, hi=float(t.count * t.cpu))
        m.row({ru[-1]: 1.0}, hi=float(t.count * t.ram))
        cpu_used.append(cu)
        ram_used.append(ru)
        _gpu_packing(m, t, by_type[ti])
    if cpu_only == "replay":
        # blocked[c][k]: some pod of CPU-only class c was left out in windows <= k (monotone)
        blocked: dict[PodClass, list[int]] = {}
        for k, win in enumerate(windows):
            for c, n in win.items():
                row = placed.get((c, k), {})
                if c.num or not row:  # a class no empty node fits is always left out
                    continue
                dropped = m.var(ub=1.0, integer=True)
                zs = blocked.setdefault(c, [])
                while len(zs) <= k:
                    z = m.var(ub=1.0)
                    if zs:
                        m.row({z: 1.0, zs[-1]: -1.0}, lo=0.0)
                    zs.append(z)
                m.row({zs[k]: 1.0, dropped: -1.0}, lo=0.0)
                m.row({**row, dropped: float(n)}, lo=float(n))  # none left out: all placed
                for ti, t in enumerate(types):
                    a, b = m.var(), m.var()
                    m.row({a: 1.0, b: 1.0, dropped: -float(t.count)}, lo=0.0, hi=0.0)
                    m.row({cpu_used[ti][k]: 1.0, a: -float(t.cpu - c.cpu + 1)}, lo=0.0)
                    m.row({ram_used[ti][k]: 1.0, b: -float(t.ram - c.ram + 1)}, lo=0.0)
        # Nothing leaves in the replay: once a pod of c found no node with its CPU and RAM free,
        # none ever has both again, so no pod of a later window asking at least as much of both
        # fits anywhere.
        for k, win in enumerate(windows):
            for p, n in win.items():
                later = placed.get((p, k), {})
                if not later or k == 0:
                    continue
                for c, zs in blocked.items():
                    if p.cpu >= c.cpu and p.ram >= c.ram:
                        m.row({**later, zs[min(k - 1, len(zs) - 1)]: float(n)}, hi=float(n))
    return m.solve(time_limit)


def _gpu_packing(m: _Model, t: NodeType, here: list[tuple[PodClass, int, int]]) -> None:
    """Shares pack into GPUs, whole GPUs into nodes, on the `t.count` nodes of type `t`."""
    # Per GPU: shares (one GPU each) pack into 1000 milli.
    share = [(c, v) for c, _, v in here if c.num == 1 and c.milli < FULL]
    used = None
    if share:
        arcs, used = _arc_flow(m, [c.milli for c, _ in share], FULL)
        for s, xs in arcs.items():
            coef = dict(xs)
            for c, v in share:
                if c.milli == s:
                    coef[v] = -1.0
            m.row(coef, lo=0.0, hi=0.0)
    # Per node: multi-GPU pods take whole GPUs of one node; single GPUs (a whole-GPU pod or a GPU
    # holding shares) are arcs of size 1.
    whole = [(c, v) for c, _, v in here if c.num >= 1 and c.milli >= FULL]
    singles = {v: 1.0 for c, v in whole if c.num == 1}
    if used is not None:
        singles[used] = 1.0
    multi = [(c, v) for c, v in whole if c.num > 1]
    if not multi:
        m.row(singles, hi=float(t.count * t.gpus))
        return
    arcs, nodes_used = _arc_flow(m, [1] + [c.num for c, _ in multi], t.gpus)
    m.row({nodes_used: 1.0}, hi=float(t.count))
    for k, xs in arcs.items():
        coef = dict(xs)
        if k == 1:
            for v in singles:
                coef[v] = coef.get(v, 0.0) - 1.0
            m.row(coef, lo=0.0)
        else:
            for c, v in multi:
                if c.num == k:
                    coef[v] = -1.0
            m.row(coef, lo=0.0, hi=0.0)


# --- the replay's bin 100 --------------------------------------------------------------------


def split(pods: PodList, prefix: np.ndarray, windows: int) -> list[Counter[PodClass]]:
    """The arrived pods by class, in `windows` stretches of equal length of the arrival order."""
    cuts = np.linspace(0, len(prefix), max(1, windows) + 1).round().astype(int)
    return [pod_classes(pods, prefix[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


@dataclass
class BinBound:
    unallocated_pct: float | None  # mean over the bin's events, as the replay's curve averages
    events: int  # events the mean is over
    solved_at: list[int]  # arrival indices (0-based, into the order) where the program was solved


def bin_events(pods: PodList, order: np.ndarray, capacity: int, b: int = 100) -> np.ndarray:
    """Indices into `order` whose arrival puts the arrived request in bin `b`, as
    replay.Curve counts them; where the bin has none, the last arrival before it (the state the
    curve carries into it), and none if the arrivals never reach the bin."""
    arrived = np.cumsum(pods.gpu_request[order])
    bins = arrived * 100 // capacity
    hit = np.nonzero(bins == b)[0]
    if len(hit) or not (bins > b).any():
        return hit
    before = np.nonzero(bins < b)[0]
    return before[-1:]


def bin_bound(
    nodes: NodeList,
    pods: PodList,
    order: np.ndarray,
    b: int = 100,
    cpu_only: CpuOnly = "optional",
    samples: int = 4,
    windows: int = 1,
    time_limit: float | None = 60.0,
) -> BinBound:
    """The bound on the replay's figure for bin `b` (mean unallocated % over the bin's events).

    `windows`: arrival windows for the CPU-only rule (see max_allocated). The program is solved
    at `samples` events spread over the bin (first and last at least). At
    any event e, allocated(e) <= min(M(next sample), M(previous sample) + arrived(e) -
    arrived(previous sample)), since M grows with the arrived prefix and no placement allocates
    more than arrives; each event's bound is 100 - that / capacity and the bin's is their mean.
    """
    capacity = nodes.gpu_capacity
    events = bin_events(pods, order, capacity, b)
    if not len(events):
        return BinBound(None, 0, [])
    types = node_types(nodes)
    arrived = np.cumsum(pods.gpu_request[order])
    picks = sorted({int(events[round(i)]) for i in np.linspace(0, len(events) - 1, max(1, samples))})
    at = {e: max_allocated(types, split(pods, order[: e + 1], windows), cpu_only, time_limit) for e in picks}
    vals = []
    for e in events.tolist():
        cap = float(arrived[e])
        after = [s for s in picks if s >= e]
        before = [s for s in picks if s <= e]
        if after:
            cap = min(cap, at[after[0]])
        if before:
            s = before[-1]
            cap = min(cap, at[s] + float(arrived[e] - arrived[s]))
        vals.append(100.0 - cap * 100.0 / capacity)
    return BinBound(float(np.mean(vals)), len(events), picks)
