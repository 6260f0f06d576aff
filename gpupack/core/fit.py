"""Can this pod go on this node, and on which GPUs? Every "no" carries a reason a person reads.

How a pod's containers combine (documented in the README):
- Each app container that asks for GPUs gets its own `gpus` distinct GPUs on the node; two
  containers of one pod may share a GPU, their needs then add up there.
- Init containers run one at a time before the app containers, so they reuse the GPUs the app
  containers hold: per GPU the pod reserves max(largest init need there, sum of app needs there).
  An init container that needs more GPUs than the app containers hold is placed like an app
  container (conservative: it keeps its own reservation).
- A container with `gpupack.io/gpu` and neither memory nor SM share holds its GPUs exclusively.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from gpupack.core.model import FULL, GPU, Charged, ContainerRequest, Node, Placement, PodRequest, Share

# Rank of a GPU for one container share: lower is preferred. Policies supply it.
GpuRank = Callable[[Node, GPU, int, int], float]

K = TypeVar("K", bound=Hashable)


def pod_charge(
    app: Iterable[Iterable[tuple[K, int, int, bool]]], init: Iterable[Iterable[tuple[K, int, int, bool]]]
) -> dict[K, tuple[int, int, bool]]:
    """What a pod reserves per GPU, max(init, sum of app), from its containers' holds.

    Each hold is (gpu, memory, SM, exclusive) in the caller's own GPU key (node position, UUID)
    and units (MiB and milli, MiB and percent): the rule only adds and compares. `app`: one
    iterable of holds per app container; `init`: one per init container, in the pod's order.
    App containers add up per GPU. An init container all of whose GPUs the pod holds already (by
    its app containers, or an earlier init container holding its own) runs before them there and
    is charged max(its need, what is held); one that does not holds its GPUs like an app
    container and adds up. The one implementation of this rule: fit's placements, the extender's
    view of an assignment and the device plugin's per-GPU metrics charge through it."""
    held: dict[K, tuple[int, int, bool]] = {}

    def add(gpu: K, mem: int, sm: int, ex: bool) -> None:
        m, k, e = held.get(gpu, (0, 0, False))
        held[gpu] = (m + mem, k + sm, e or ex)

    for hs in app:
        for gpu, mem, sm, ex in hs:
            add(gpu, mem, sm, ex)
    peak: dict[K, tuple[int, int, bool]] = {}
    for hs in init:
        one = list(hs)
        if one and all(h[0] in held for h in one):
            for gpu, mem, sm, ex in one:
                m, k, e = peak.get(gpu, (0, 0, False))
                peak[gpu] = (max(m, mem), max(k, sm), e or ex)
        else:
            for gpu, mem, sm, ex in one:
                add(gpu, mem, sm, ex)
    charged = dict(held)
    for gpu, (pm, pk, pe) in peak.items():
        m, k, e = charged[gpu]
        charged[gpu] = (max(m, pm), max(k, pk), e or pe)
    return charged


def holds(shares: Iterable[Share]) -> list[tuple[int, int, int, bool]]:
    """A container's shares as pod_charge's holds (GPU position, MiB, milli, exclusive)."""
    return [(s.gpu_index, s.mem_mib, s.milli, s.exclusive) for s in shares]


@dataclass(frozen=True)
class FitFailure:
    reason: str
    code: str  # short machine key for metrics: model, gpu-count, gpu-mem, gpu-sm, class, cpu, ram, ...
    unresolvable: bool = False  # no preemption or wait can help on this node

    def __bool__(self) -> bool:  # so `if fit:` reads naturally
        return False


@dataclass(frozen=True)
class Fit:
    placement: Placement
    charged: Charged  # gpu index -> (mem, milli, exclusive)
    # What the policy that made this fit worked out of its score while choosing the GPUs, and
    # under which of its tables (GpupackPolicy.node_score reads it); not part of the fit's identity.
    score_memo: tuple[object, ...] | None = field(default=None, compare=False, repr=False)

    def __bool__(self) -> bool:
        return True


def _fmt_milli(milli: int) -> str:
    return f"{milli / 10:g}% SM"


def static_check(node: Node, pod: PodRequest) -> FitFailure | None:
    """Reasons that do not depend on what else runs on the node (FailedAndUnresolvable)."""
    if not node.schedulable:
        return FitFailure(f"node {node.name} is cordoned", "unschedulable", True)
    if not node.gpus:
        return FitFailure(f"node {node.name} publishes no gpupack GPU inventory", "no-gpu", True)
    if pod.gpu_models is not None and not any(g.model in pod.gpu_models for g in node.gpus):
        allowed = "|".join(sorted(pod.gpu_models))
        return FitFailure(f"GPU model {node.model} is not among the allowed {allowed}", "model", True)
    usable = [g for g in node.gpus if pod.gpu_models is None or g.model in pod.gpu_models]
    biggest_mem = max(g.mem_mib for g in usable)
    for c in (*pod.containers, *pod.init_containers):
        if c.gpus > len(usable):
            return FitFailure(
                f"container {c.name} needs {c.gpus} GPUs; node has {len(usable)}", "gpu-count", True
            )
        if c.mem_mib is not None and c.mem_mib > biggest_mem:
            return FitFailure(
                f"container {c.name} needs {c.mem_mib} MiB on one GPU; the largest GPU here has "
                f"{biggest_mem} MiB",
                "gpu-mem",
                True,
            )
    if node.cpu_milli and pod.cpu_milli > node.cpu_milli:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; node has {node.cpu_milli}m", "cpu", True)
    if node.ram_mib and pod.ram_mib > node.ram_mib:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; node has {node.ram_mib} MiB", "ram", True)
    return None


def _can_take(g: GPU, pod: PodRequest, c: ContainerRequest, mem: int, milli: int, used: Charged) -> bool:
    if not g.healthy or (pod.gpu_models is not None and g.model not in pod.gpu_models):
        return False
    extra_mem, extra_milli, extra_ex = used.get(g.index, (0, 0, False))
    if c.exclusive:
        return g.empty and g.index not in used
    if g.exclusive or extra_ex:
        return False
    if g.pod_class is not None and g.pod_class != pod.pod_class:
        return False
    return g.free_mem - extra_mem >= mem and g.free_milli - extra_milli >= milli


def _share_of(g: GPU, c: ContainerRequest) -> tuple[int, int]:
    if c.exclusive:
        return g.mem_mib, FULL
    return c.mem_mib or 0, c.milli or 0


def _explain(node: Node, pod: PodRequest, c: ContainerRequest, used: Charged) -> FitFailure:
    """Why container `c` found too few GPUs: name the binding constraint and the best candidate."""
    healthy = [g for g in node.gpus if g.healthy and (pod.gpu_models is None or g.model in pod.gpu_models)]
    if len(healthy) < c.gpus:
        bad = len(node.gpus) - len([g for g in node.gpus if g.healthy])
        return FitFailure(
            f"container {c.name} needs {c.gpus} GPUs; {bad} of {len(node.gpus)} GPUs here are unhealthy",
            "unhealthy",
        )
    if c.exclusive:
        idle = [g for g in healthy if g.empty and g.index not in used]
        return FitFailure(
            f"container {c.name} needs {c.gpus} whole GPU(s); {len(idle)} of {len(node.gpus)} are idle",
            "gpu-whole",
        )
    same_class = [g for g in healthy if not g.exclusive and g.pod_class in (None, pod.pod_class)]
    if len(same_class) < c.gpus:
        other = len([g for g in healthy if g.pod_class not in (None, pod.pod_class)])
        return FitFailure(
            f"container {c.name} needs {c.gpus} GPU(s) for class {pod.pod_class}; {other} GPU(s) here "
            f"hold other-class pods and {len([g for g in healthy if g.exclusive])} are held whole",
            "class",
        )

    def free(g: GPU) -> tuple[int, int]:
        m, k, _ = used.get(g.index, (0, 0, False))
        return g.free_mem - m, g.free_milli - k

    mem = c.mem_mib or 0
    milli = c.milli or 0
    by_mem = max(same_class, key=lambda g: (free(g)[0], -g.index))
    if mem and free(by_mem)[0] < mem:
        return FitFailure(
            f"no GPU with {mem} MiB free for class {pod.pod_class}; largest free is "
            f"{free(by_mem)[0]} MiB on GPU {by_mem.index}",
            "gpu-mem",
        )
    by_milli = max(same_class, key=lambda g: (free(g)[1], -g.index))
    if milli and free(by_milli)[1] < milli:
        return FitFailure(
            f"no GPU with {_fmt_milli(milli)} free for class {pod.pod_class}; most free is "
            f"{_fmt_milli(free(by_milli)[1])} on GPU {by_milli.index}",
            "gpu-sm",
        )
    both = [g for g in same_class if free(g)[0] >= mem and free(g)[1] >= milli]
    return FitFailure(
        f"container {c.name} needs {c.gpus} GPU(s) each with {mem} MiB and {_fmt_milli(milli)} free "
        f"for class {pod.pod_class}; {len(both)} GPU(s) here have both",
        "gpu-mem-sm",
    )


def _pick(node: Node, pod: PodRequest, c: ContainerRequest, used: Charged, rank: GpuRank) -> list[GPU] | None:
    cands = []
    for g in node.gpus:
        mem, milli = _share_of(g, c)
        if _can_take(g, pod, c, mem, milli, used):
            # GPUs this pod already uses come first: a pod spreads over as few GPUs as it can.
            cands.append((g.index not in used, rank(node, g, mem, milli), g.index, g))
    if len(cands) < c.gpus:
        return None
    cands.sort(key=lambda t: t[:3])
    return [t[3] for t in cands[: c.gpus]]


def _charge(used: Charged, gpus: list[GPU], c: ContainerRequest) -> tuple[Share, ...]:
    shares = []
    for g in gpus:
        mem, milli = _share_of(g, c)
        m0, k0, e0 = used.get(g.index, (0, 0, False))
        used[g.index] = (m0 + mem, k0 + milli, e0 or c.exclusive)
        shares.append(Share(g.index, mem, milli, c.exclusive))
    return tuple(shares)


def tightest(node: Node, g: GPU, mem: int, milli: int) -> float:
    """Default in-node rank: the GPU left with the least room (memory first), so big holes stay big."""
    if g.empty:
        return 2.0 + g.index * 1e-6  # an idle GPU only when no used one fits
    left_mem = (g.free_mem - mem) / g.mem_mib if g.mem_mib else 0.0
    left_milli = (g.free_milli - milli) / FULL
    return left_mem * 0.5 + left_milli * 0.5


def _fit_one_share(node: Node, pod: PodRequest, c: ContainerRequest, rank: GpuRank) -> Fit | None:
    """The common case (one container, one shared GPU) without the general bookkeeping.

    The extender filters every node per pod, so this path is what its latency is made of; it must
    decide exactly as the general path does (tests compare the two). None means "does not fit
    here": the caller then runs the general path, which explains why.
    """
    if (node.cpu_milli and pod.cpu_milli > node.cpu_milli - node.cpu_used) or (
        node.ram_mib and pod.ram_mib > node.ram_mib - node.ram_used
    ):
        return None
    mem = c.mem_mib or 0
    milli = c.milli or 0
    cls = pod.pod_class
    models = pod.gpu_models
    best = None
    best_key = 0.0
    for g in node.gpus:
        if (
            not g.healthy
            or g.exclusive
            or (g.pod_class is not None and g.pod_class != cls)
            or g.mem_mib - g.mem_used < mem
            or FULL - g.milli_used < milli
            or (models is not None and g.model not in models)
        ):
            continue
        key = rank(node, g, mem, milli)
        if best is None or key < best_key:
            best, best_key = g, key
    if best is None:
        return None
    return Fit(
        Placement(node.name, {c.name: (Share(best.index, mem, milli, False),)}),
        {best.index: (mem, milli, False)},
    )


def fit(node: Node, pod: PodRequest, rank: GpuRank = tightest) -> Fit | FitFailure:
    """Place every GPU container of `pod` on `node`, choosing GPUs by `rank`; or say why not."""
    if len(pod.containers) == 1 and not pod.init_containers and node.schedulable and node.gpus:
        c = pod.containers[0]
        if c.gpus == 1 and not c.exclusive:
            f = _fit_one_share(node, pod, c, rank)
            if f is not None:
                return f
    return fit_general(node, pod, rank)


def fit_general(node: Node, pod: PodRequest, rank: GpuRank = tightest) -> Fit | FitFailure:
    """The general path: any mix of containers, init containers, whole and shared GPUs."""
    bad = static_check(node, pod)
    if bad is not None:
        return bad
    if node.cpu_milli and pod.cpu_milli > node.free_cpu:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; {node.free_cpu}m free", "cpu")
    if node.ram_mib and pod.ram_mib > node.free_ram:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; {node.free_ram} MiB free", "ram")

    used: Charged = {}
    containers: dict[str, tuple[Share, ...]] = {}
    # Largest first: a big container placed last is the one most likely to find no room.
    order = sorted(
        pod.containers, key=lambda c: (not c.exclusive, -c.gpus, -(c.mem_mib or 0), -(c.milli or 0))
    )
    for c in order:
        gpus = _pick(node, pod, c, used, rank)
        if gpus is None:
            return _explain(node, pod, c, used)
        containers[c.name] = _charge(used, gpus, c)

    init_peak: Charged = {}
    for c in pod.init_containers:
        chosen = []
        for i in sorted(used, key=lambda i: (not used[i][2], -(node.gpus[i].free_mem - used[i][0]), i)):
            g = node.gpus[i]
            mem, milli = _share_of(g, c)
            am, ak, ae = used[i]
            pm, pk, _ = init_peak.get(i, (0, 0, False))
            if ae:
                ok = True  # the pod holds this GPU whole already
            elif c.exclusive:
                ok = g.empty  # nobody else on it: the pod may take it whole
            else:
                ok = g.free_mem >= max(am, pm, mem) and g.free_milli >= max(ak, pk, milli)
            if ok:
                chosen.append((i, mem, milli))
            if len(chosen) == c.gpus:
                break
        if len(chosen) == c.gpus:
            shares = []
            for i, mem, milli in chosen:
                pm, pk, pe = init_peak.get(i, (0, 0, False))
                init_peak[i] = (max(pm, mem), max(pk, milli), pe or c.exclusive)
                shares.append(Share(i, mem, milli, c.exclusive))
            containers[c.name] = tuple(shares)
            continue
        # Cannot ride on the app containers' GPUs: reserve its own, like an app container.
        gpus = _pick(node, pod, c, used, rank)
        if gpus is None:
            return _explain(node, pod, c, used)
        containers[c.name] = _charge(used, gpus, c)

    # the search above kept its own running totals; the charge is the one rule's
    charged = pod_charge(
        [holds(containers[c.name]) for c in pod.containers],
        [holds(containers[c.name]) for c in pod.init_containers],
    )
    return Fit(Placement(node.name, containers), charged)


def host_fit(node: Node, pod: PodRequest) -> Fit | FitFailure:
    """A CPU-only pod on a node without gpupack GPUs: CPU and memory only (the core's fit refuses
    GPU-less nodes, which only CPU-only pods may use)."""
    if not node.schedulable:
        return FitFailure(f"node {node.name} is cordoned", "unschedulable", True)
    if node.cpu_milli and pod.cpu_milli > node.cpu_milli:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; node has {node.cpu_milli}m", "cpu", True)
    if node.ram_mib and pod.ram_mib > node.ram_mib:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; node has {node.ram_mib} MiB", "ram", True)
    if node.cpu_milli and pod.cpu_milli > node.free_cpu:
        return FitFailure(f"needs {pod.cpu_milli}m CPU; {node.free_cpu}m free", "cpu")
    if node.ram_mib and pod.ram_mib > node.free_ram:
        return FitFailure(f"needs {pod.ram_mib} MiB RAM; {node.free_ram} MiB free", "ram")
    return Fit(Placement(node.name, {}), {})
