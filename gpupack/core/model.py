"""Plain data for the packing core: what a cluster holds and what a pod asks for.

Units: GPU memory in MiB; GPU compute in *milli* of one GPU (0..1000). Users write SM share in
percent (`gpupack.io/gpu-sm: 40`), which is 400 milli here; the finer unit lets the openb trace
(whose shares are in milli) replay without rounding.

The state is mutable on purpose: the scheduler path and the trace replay place thousands of pods
per second, and copying a 50,000-GPU snapshot per decision would dominate. What-if planning uses
:meth:`ClusterState.clone`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

FULL = 1000  # milli in one GPU


@dataclass(frozen=True)
class ContainerRequest:
    """One container's GPU need. `mem_mib`/`milli` are per GPU; both None means whole GPUs."""

    name: str
    gpus: int
    mem_mib: int | None = None
    milli: int | None = None
    init: bool = False

    @property
    def exclusive(self) -> bool:
        return self.mem_mib is None and self.milli is None


@dataclass(frozen=True)
class PodRequest:
    key: str  # "namespace/name"
    pod_class: str = "online"
    containers: tuple[ContainerRequest, ...] = ()  # app containers needing GPUs
    init_containers: tuple[ContainerRequest, ...] = ()
    cpu_milli: int = 0  # host CPU/RAM: checked by the replay; kube-scheduler checks them in a cluster
    ram_mib: int = 0
    gpu_models: frozenset[str] | None = None  # allowed models; None = any
    uid: str = ""
    namespace: str = ""
    owner: tuple[str, str] | None = None  # (kind, name) of the controlling owner

    @property
    def gpu_containers(self) -> tuple[ContainerRequest, ...]:
        return self.containers

    @property
    def total_gpus(self) -> int:
        return sum(c.gpus for c in self.containers)

    @property
    def needs_gpu(self) -> bool:
        return bool(self.containers or self.init_containers)

    @cached_property
    def gpu_slots(self) -> int:
        """GPUs the kubelet must have free for the pod at once: its app containers' together, or its
        largest init container's (init containers run one at a time, before the others). Cached:
        the extender asks once per node it fits the pod on."""
        return max(self.total_gpus, max((c.gpus for c in self.init_containers), default=0))


@dataclass
class GPU:
    uuid: str
    index: int
    model: str
    mem_mib: int
    sm_count: int = 0
    healthy: bool = True
    mem_used: int = 0
    milli_used: int = 0
    pod_class: str | None = None  # class of the pods on it; None when empty
    exclusive: bool = False  # held whole by one container
    # pod key -> (mem MiB, milli) that pod holds here
    holders: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def free_mem(self) -> int:
        return 0 if self.exclusive else self.mem_mib - self.mem_used

    @property
    def free_milli(self) -> int:
        return 0 if self.exclusive else FULL - self.milli_used

    @property
    def empty(self) -> bool:
        return not self.holders

    def charge(self, holder: str, mem: int, milli: int, exclusive: bool, pod_class: str | None) -> None:
        """Count `holder` (a pod key, or a reservation's) on this GPU: the whole GPU when
        `exclusive`, else `mem` MiB and `milli` of it. No check: :meth:`ClusterState.place` checks
        first; the extender also charges what the API says is already there, and what a defrag
        reservation holds, whatever they collide with. A GPU with pods keeps its class."""
        if exclusive:
            self.exclusive = True
            self.mem_used, self.milli_used = self.mem_mib, FULL
        else:
            self.mem_used += mem
            self.milli_used += milli
        if self.pod_class is None or not self.holders:
            self.pod_class = pod_class
        self.holders[holder] = (self.mem_mib if exclusive else mem, FULL if exclusive else milli)

    def copy(self) -> GPU:
        g = GPU(
            self.uuid,
            self.index,
            self.model,
            self.mem_mib,
            self.sm_count,
            self.healthy,
            self.mem_used,
            self.milli_used,
            self.pod_class,
            self.exclusive,
            dict(self.holders),
        )
        return g


@dataclass
class Node:
    name: str
    gpus: list[GPU]
    cpu_milli: int = 0  # 0 = not tracked (a real cluster: kube-scheduler checks CPU/RAM)
    ram_mib: int = 0
    cpu_used: int = 0
    ram_used: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True

    @property
    def model(self) -> str:
        return self.gpus[0].model if self.gpus else ""

    @property
    def free_cpu(self) -> int:
        return self.cpu_milli - self.cpu_used

    @property
    def free_ram(self) -> int:
        return self.ram_mib - self.ram_used

    def gpu(self, uuid: str) -> GPU | None:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        return None

    def copy(self) -> Node:
        return Node(
            self.name,
            [g.copy() for g in self.gpus],
            self.cpu_milli,
            self.ram_mib,
            self.cpu_used,
            self.ram_used,
            dict(self.labels),
            self.schedulable,
        )


@dataclass(frozen=True)
class Share:
    """What one container holds on one GPU."""

    gpu_index: int  # position in Node.gpus
    mem_mib: int
    milli: int
    exclusive: bool = False


@dataclass(frozen=True)
class Placement:
    """Where a pod goes: a node and, per container (init containers too), its GPU shares."""

    node: str
    containers: dict[str, tuple[Share, ...]]

    def per_gpu(self) -> dict[int, tuple[int, int, bool]]:
        """GPU index -> (mem, milli, exclusive) the pod as a whole holds there."""
        return _pod_usage(self)


def _pod_usage(p: Placement) -> dict[int, tuple[int, int, bool]]:
    out: dict[int, tuple[int, int, bool]] = {}
    for shares in p.containers.values():
        for s in shares:
            mem, milli, ex = out.get(s.gpu_index, (0, 0, False))
            out[s.gpu_index] = (mem + s.mem_mib, milli + s.milli, ex or s.exclusive)
    return out


class PlacementError(ValueError):
    """A placement that would break an invariant (over-commit, class mix, exclusivity)."""


# GPU index -> (MiB, milli, exclusive) a pod is charged there; typed records that cross modules.
Charged = dict[int, tuple[int, int, bool]]
# What a ClusterState records per pod: the request, where it went, what it is charged per GPU.
Holding = tuple[PodRequest, Placement, Charged]


@dataclass
class ClusterState:
    nodes: dict[str, Node] = field(default_factory=dict)
    # pod key -> (request, placement, per-GPU usage actually charged)
    pods: dict[str, Holding] = field(default_factory=dict)

    def add_node(self, node: Node) -> None:
        self.nodes[node.name] = node

    def clone(self) -> ClusterState:
        return ClusterState({n: node.copy() for n, node in self.nodes.items()}, dict(self.pods))

    def place(self, pod: PodRequest, placement: Placement, charged: dict[int, tuple[int, int, bool]]) -> None:
        """Record a pod; `charged` is the per-GPU usage from :func:`gpupack.core.fit.pod_charge`.

        Checks every invariant again, so a caller bug can never over-commit a GPU.
        """
        if pod.key in self.pods:
            raise PlacementError(f"pod {pod.key} is already placed")
        node = self.nodes.get(placement.node)
        if node is None:
            raise PlacementError(f"unknown node {placement.node}")
        if node.cpu_milli and pod.cpu_milli > node.free_cpu:
            raise PlacementError(f"node {node.name}: CPU over-commit")
        if node.ram_mib and pod.ram_mib > node.free_ram:
            raise PlacementError(f"node {node.name}: RAM over-commit")
        for idx, (mem, milli, ex) in charged.items():
            g = node.gpus[idx]
            if ex:
                if not g.empty:
                    raise PlacementError(f"{node.name} GPU {idx}: exclusive use of a GPU that is in use")
            else:
                if g.exclusive:
                    raise PlacementError(f"{node.name} GPU {idx}: GPU is held exclusively")
                if g.pod_class is not None and g.pod_class != pod.pod_class:
                    raise PlacementError(f"{node.name} GPU {idx}: {pod.pod_class} pod on a {g.pod_class} GPU")
                if mem > g.free_mem or milli > g.free_milli:
                    raise PlacementError(f"{node.name} GPU {idx}: over-commit")
        for idx, (mem, milli, ex) in charged.items():
            node.gpus[idx].charge(pod.key, mem, milli, ex, pod.pod_class)
        node.cpu_used += pod.cpu_milli
        node.ram_used += pod.ram_mib
        self.pods[pod.key] = (pod, placement, charged)

    def release(self, key: str) -> PodRequest | None:
        entry = self.pods.pop(key, None)
        if entry is None:
            return None
        pod, placement, charged = entry
        node = self.nodes.get(placement.node)
        if node is None:
            return pod
        for idx in charged:
            g = node.gpus[idx]
            mem, milli = g.holders.pop(key, (0, 0))
            if g.exclusive:
                g.exclusive = False
                g.mem_used = 0
                g.milli_used = 0
            else:
                g.mem_used -= mem
                g.milli_used -= milli
            if not g.holders:
                g.pod_class = None
                g.mem_used = 0
                g.milli_used = 0
        node.cpu_used -= pod.cpu_milli
        node.ram_used -= pod.ram_mib
        return pod


def invariant_violations(state: ClusterState) -> list[str]:
    """Every broken packing invariant in `state`, as sentences; empty when the state is sound.

    The invariants: no GPU over-committed in memory or SM; an exclusive GPU holds one pod; online
    and offline pods never share a GPU; each GPU's usage is the sum of its holders'; every placed
    pod is a holder of the GPUs it was charged on, and only on GPU models it allows.
    """
    out: list[str] = []
    classes = {k: pod.pod_class for k, (pod, _, _) in state.pods.items()}
    for node in state.nodes.values():
        for g in node.gpus:
            where = f"{node.name} GPU {g.index}"
            if g.mem_used > g.mem_mib:
                out.append(f"{where}: memory over-committed ({g.mem_used} > {g.mem_mib} MiB)")
            if g.milli_used > FULL:
                out.append(f"{where}: SM over-committed ({g.milli_used} milli)")
            if g.exclusive and len(g.holders) != 1:
                out.append(f"{where}: exclusive GPU held by {len(g.holders)} pods")
            if not g.exclusive and (
                sum(m for m, _ in g.holders.values()) != g.mem_used
                or sum(k for _, k in g.holders.values()) != g.milli_used
            ):
                out.append(f"{where}: usage differs from the sum of its holders")
            held = {classes.get(k) for k in g.holders}
            if len(held) > 1:
                out.append(f"{where}: online and offline pods share a GPU")
            if g.holders and g.pod_class not in held:
                out.append(f"{where}: class {g.pod_class} does not match its pods")
    for key, (pod, placement, charged) in state.pods.items():
        on = state.nodes.get(placement.node)
        if on is None:
            out.append(f"{key}: placed on unknown node {placement.node}")
            continue
        node = on
        for i in charged:
            g = node.gpus[i]
            if key not in g.holders:
                out.append(f"{key}: charged on {node.name} GPU {i} but not among its holders")
            if pod.gpu_models is not None and g.model not in pod.gpu_models:
                out.append(f"{key}: on a {g.model}, not among its allowed models")
    return out
