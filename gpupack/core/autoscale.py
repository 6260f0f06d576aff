"""What the cluster autoscaler should do for gpupack pods, decided by gpupack's own fit rules.

The autoscaler judges pods with kube-scheduler's in-tree filters, which do not see GPU shares. So
gpupack decides, and the extender's autoscale controller (`extender/controllers/autoscale.py`) turns these
decisions into objects the unmodified autoscaler understands:

- :func:`plan_scale_up`: how many nodes of which node group the pending pods need (pods that fit a
  node that exists, or one that is being added, need none). The controller keeps that many
  placeholder pods, each asking for one whole node of its group.
- :func:`pinned_nodes`: the nodes whose pods could not all be placed elsewhere; the controller
  marks them so that the autoscaler does not remove them.

Both pack first-fit-decreasing with :func:`gpupack.core.fit.fit` over plain data; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .fit import Fit, fit
from .model import GPU, ClusterState, Node, PodRequest
from .node_rules import NodeFacts, PodTerms, ceil_mib, refusal


@dataclass(frozen=True)
class NodeGroup:
    """A node group of the autoscaler as gpupack needs to know it: what one new node holds.

    `max_new` is how many nodes the group may still gain (its max size less the nodes it has);
    None when unknown (no limit is applied). `facts`: the template's labels, taints and allocatable
    host resources, which a pod's rules and requests are judged against (unknown: not checked)."""

    name: str
    model: str
    gpus: int
    mem_mib: int
    max_new: int | None = None
    sm_count: int = 0
    cpu_milli: int = 0  # host CPU and RAM of a node; 0 = not counted (the controller's case)
    ram_mib: int = 0
    facts: NodeFacts = NodeFacts()

    def template(self, name: str) -> Node:
        """An empty node of this group, as its device plugin would publish it."""
        cpu = self.cpu_milli or self.facts.cpu_milli or 0
        ram = self.ram_mib or (self.facts.mem_bytes or 0) >> 20
        return Node(
            name,
            [GPU(f"{name}-gpu-{i}", i, self.model, self.mem_mib, self.sm_count) for i in range(self.gpus)],
            cpu,
            ram,
        )


@dataclass
class ScaleUp:
    """`nodes`: group -> nodes to add. `placed`: pod key -> the node it would go to (an existing
    one, or `<group>/new-<i>`). `unplaceable`: pod key -> why no node, existing or new, can hold it.
    `host`: group -> the most host CPU (milli) and memory (MiB) the pods planned on one of its new
    nodes ask together (what a placeholder carries, so that the autoscaler's own simulation of
    the template agrees that the node would hold them)."""

    nodes: dict[str, int] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)
    unplaceable: dict[str, str] = field(default_factory=dict)
    host: dict[str, tuple[int, int]] = field(default_factory=dict)


def size_key(pod: PodRequest) -> tuple[int, int, int]:
    """Largest first: whole GPUs, then memory and SM over all of the pod's GPUs."""
    cs = (*pod.containers, *pod.init_containers)
    whole = sum(c.gpus for c in cs if c.exclusive)
    return (-whole, -sum(c.gpus * (c.mem_mib or 0) for c in cs), -sum(c.gpus * (c.milli or 0) for c in cs))


def _first_fit(
    state: ClusterState,
    names: Iterable[str],
    pod: PodRequest,
    admits: Callable[[str], bool] | None = None,
) -> Fit | None:
    for name in names:
        if admits is not None and not admits(name):
            continue
        f = fit(state.nodes[name], pod)
        if isinstance(f, Fit):
            state.place(pod, f.placement, f.charged)
            return f
    return None


def plan_scale_up(
    state: ClusterState,
    pending: Sequence[PodRequest],
    groups: Sequence[NodeGroup],
    upcoming: Mapping[str, int] | None = None,
    terms: Mapping[str, PodTerms] | None = None,
    facts: Mapping[str, NodeFacts] | None = None,
) -> ScaleUp:
    """The nodes to add so that every pending pod has a place, first-fit decreasing.

    `state` holds the nodes that take pods now, with what they hold; it is not changed.
    `upcoming`: group -> nodes of that group that exist but do not take pods yet (not Ready, or no
    inventory published): they count as empty nodes of their group, so a pass made while the
    autoscaler's nodes come up asks for no more. Each pod goes to the first existing node it fits,
    else the first new node it fits, else a new node of the first group (in `groups` order) whose
    empty node fits it and that may still grow.

    `terms`: pod key -> its selector, required node affinity, tolerations and host requests
    (`node_rules.pod_terms`); a pod without goes wherever its GPUs fit. Such a pod goes only to
    nodes whose labels and taints it passes and whose allocatable CPU, memory and pod count hold
    it with the pods planned there before it: a group's new and upcoming nodes are judged by the
    group's `facts`, an existing node by `facts[name]` (absent: by its GPUs only)."""
    work = state.clone()
    out = ScaleUp()
    terms = terms or {}
    facts = facts or {}
    by_name = {g.name: g for g in groups}
    existing = list(work.nodes)
    new: list[str] = []
    group_of: dict[str, NodeGroup] = {}  # a new or upcoming node -> its group
    count: dict[str, int] = {}  # a new or upcoming node -> pods planned there
    for gname, n in sorted((upcoming or {}).items()):
        g = by_name.get(gname)
        for i in range(n if g is not None else 0):
            name = f"{gname}/upcoming-{i}"
            work.add_node(g.template(name))  # type: ignore[union-attr]  # g checked above
            existing.append(name)
            group_of[name] = g  # type: ignore[assignment]
    added: dict[str, int] = {}
    for pod in sorted(pending, key=lambda p: (size_key(p), p.key)):
        pt = terms.get(pod.key)
        admits = None
        if pt is not None:
            if pt.problem:
                out.unplaceable[pod.key] = pt.problem
                continue
            pod = dataclasses.replace(pod, cpu_milli=pt.needs.cpu_milli, ram_mib=ceil_mib(pt.needs.mem_bytes))

            def admits(name: str, pt: PodTerms = pt) -> bool:
                g = group_of.get(name)
                if g is None:
                    nf = facts.get(name)
                    return nf is None or refusal(pt, nf, "node") is None
                left = g.facts.pods is None or count.get(name, 0) + pt.needs.pods <= g.facts.pods
                return left and refusal(pt, g.facts) is None

        f = _first_fit(work, existing, pod, admits) or _first_fit(work, new, pod, admits)
        if f is not None:
            out.placed[pod.key] = f.placement.node
            count[f.placement.node] = count.get(f.placement.node, 0) + 1
            continue
        reasons = []
        for g in groups:
            if g.max_new is not None and added.get(g.name, 0) >= g.max_new:
                reasons.append(f"group {g.name}: at its maximum size")
                continue
            why = refusal(pt, g.facts) if pt is not None else None
            if why:
                reasons.append(f"group {g.name}: {why}")
                continue
            name = f"{g.name}/new-{added.get(g.name, 0)}"
            node = g.template(name)
            f0 = fit(node, pod)
            if not isinstance(f0, Fit):
                reasons.append(f"group {g.name}: {f0.reason}")
                continue
            work.add_node(node)
            work.place(pod, f0.placement, f0.charged)
            new.append(name)
            group_of[name] = g
            count[name] = 1
            added[g.name] = added.get(g.name, 0) + 1
            out.placed[pod.key] = name
            break
        else:
            out.unplaceable[pod.key] = "; ".join(reasons) or "no node group"
    out.nodes = {g: n for g, n in added.items() if n}
    for name in new:
        node, g = work.nodes[name], group_of[name]
        cpu, ram = out.host.get(g.name, (0, 0))
        out.host[g.name] = (max(cpu, node.cpu_used), max(ram, node.ram_used))
    return out


def pods_on(state: ClusterState) -> dict[str, list[PodRequest]]:
    """Node -> the pods placed there."""
    out: dict[str, list[PodRequest]] = {}
    for pod, placement, _ in state.pods.values():
        out.setdefault(placement.node, []).append(pod)
    return out


def moves_off(
    state: ClusterState, node: str, pods: Sequence[PodRequest], targets: Iterable[str] | None = None
) -> dict[str, str] | str:
    """Where each of `pods` (those on `node`) would go if `node` went away, first-fit decreasing
    on `targets` (default: every other node): pod key -> node; or, when one has no place, why.
    `state` is left as it was (the trial placements are released again)."""
    others = [n for n in (state.nodes if targets is None else targets) if n != node]
    trial: list[str] = []
    out: dict[str, str] = {}
    try:
        for pod in sorted(pods, key=lambda p: (size_key(p), p.key)):
            moved = dataclasses.replace(pod, key=f"{pod.key}#moved")
            f = _first_fit(state, others, moved)
            if f is None:
                return f"pod {pod.key} fits no other node"
            trial.append(moved.key)
            out[pod.key] = f.placement.node
        return out
    finally:
        for key in trial:
            state.release(key)


def pinned_nodes(state: ClusterState) -> dict[str, str]:
    """Nodes the autoscaler must not remove, with the reason: those holding a pod that would find
    no place on the other nodes that hold pods. Empty nodes are no place: they are the first the
    autoscaler removes, in the same pass perhaps. Each node is judged alone (the autoscaler drains
    one at a time); a node without pods is never pinned. `state` is left as it was."""
    out: dict[str, str] = {}
    held = pods_on(state)
    busy = [n for n in state.nodes if n in held]
    for node, pods in sorted(held.items()):
        if node not in state.nodes:
            continue
        r = moves_off(state, node, pods, busy)
        if isinstance(r, str):
            out[node] = r
    return out
