"""Where a gated pod's gpupack claims go: gpupack's own policy (the extender's, gpupack.core) over
the DRA devices. Pure, no I/O.

The cluster as the core sees it: each node with gpupack devices, its GPUs charged with what the
allocated claims consume (devices.charge_claims), its CPU and memory with the requests of the pods
on it or allocated to it; the pod as a PodRequest with one container per claim request (the core's
rule that two containers of one pod may share a GPU is the DRA one: two requests, two results,
possibly one device). The core's fit keeps online and offline off one GPU (a GPU's class is the
class of what is allocated on it, or the `holds` the plugin publishes), never overfills memory or
SMs, and the policy scores and breaks ties as the extender does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupack.core import node_rules as nr
from gpupack.core.fit import FitFailure
from gpupack.core.model import FULL, GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policy_base import Policy, schedule

from .claims import Ask
from .devices import Device, consumed

CLASSES = ("online", "offline")


@dataclass(frozen=True)
class HostUse:
    cpu_milli: int = 0
    mem_bytes: int = 0
    pods: int = 0

    def plus(self, needs: nr.HostNeeds) -> HostUse:
        """This use with one more pod asking `needs` on the node."""
        return HostUse(self.cpu_milli + needs.cpu_milli, self.mem_bytes + needs.mem_bytes, self.pods + 1)


@dataclass(frozen=True)
class Chosen:
    node: str
    # claim name -> its results (driver/pool/device/request/consumedCapacity; shareID added by the writer)
    results: dict[str, list[dict[str, Any]]]


def _gpu(d: Device) -> GPU:
    # positional: a placement builds one GPU per device of the cluster, keywords cost a third more
    g = GPU(d.name, d.index, d.model, d.mem_mib, 0, d.healthy, min(d.mem_used, d.mem_mib),
            min(d.sm_used * 10, FULL), d.pod_class, d.whole, dict(d.holders))  # fmt: skip
    if d.holds and d.holds != (d.pod_class or d.holds):
        g.pod_class = "mixed"  # prepared claims of a class the claims here disagree with: neither fits
    elif d.holds:
        g.pod_class = d.holds if d.holds in CLASSES else "mixed"
        g.holders.setdefault("prepared", (0, 0))
    return g


def pod_request(key: str, asks: Sequence[Ask], needs: nr.HostNeeds) -> PodRequest:
    models: frozenset[str] | None = None
    for a in asks:
        if a.models is not None:
            models = a.models if models is None else models & a.models
    containers = tuple(
        ContainerRequest(name=str(i), gpus=a.count)
        if a.mem_mib is None  # no memory asked: the default, all of it (a whole GPU, sm recorded)
        else ContainerRequest(name=str(i), gpus=a.count, mem_mib=a.mem_mib, milli=(a.sm_pct or 0) * 10)
        for i, a in enumerate(asks)
    )
    return PodRequest(key=key, pod_class=asks[0].pod_class, containers=containers,
                      cpu_milli=needs.cpu_milli, ram_mib=nr.ceil_mib(needs.mem_bytes), gpu_models=models)  # fmt: skip


def build_state(
    devices: Mapping[str, list[Device]],
    nodes: Mapping[str, nr.NodeFacts],
    used: Mapping[str, HostUse],
    terms: nr.PodTerms,
) -> tuple[ClusterState, dict[str, str]]:
    """The nodes the pod's own rules (nodeSelector, affinity, taints) and pod count allow, as the
    core's state; and why each other node with devices was left out."""
    state, refused = ClusterState(), {}
    for name, devs in devices.items():
        facts = nodes.get(name)
        if facts is None:
            refused[name] = "node not found"
            continue
        why = nr.rule_refusal(terms, facts)
        u = used.get(name, HostUse())
        if why is None and facts.pods is not None and u.pods + 1 > facts.pods:
            why = "too many pods"
        if why:
            refused[name] = why
            continue
        node = Node(name, [_gpu(d) for d in devs], labels=dict(facts.labels))
        if facts.cpu_milli is not None:
            node.cpu_milli, node.cpu_used = max(facts.cpu_milli, 1), u.cpu_milli
        if facts.mem_bytes is not None:
            node.ram_mib, node.ram_used = max(facts.mem_bytes // nr.MIB, 1), nr.ceil_mib(u.mem_bytes)
        state.add_node(node)
    return state, refused


def place(
    pod_key: str,
    asks: Sequence[Ask],
    devices: Mapping[str, list[Device]],
    nodes: Mapping[str, nr.NodeFacts],
    used: Mapping[str, HostUse],
    terms: nr.PodTerms,
    policy: Policy,
    only_node: str | None = None,
) -> Chosen | str:
    """The node and devices for `asks` (one pod's unallocated gpupack requests), or why none fits.
    `only_node`: the node another of the pod's claims is already allocated on."""
    if terms.problem:
        return terms.problem
    if len({a.pod_class for a in asks}) > 1:
        return "the pod asks both online and offline GPUs"
    devs = devices if only_node is None else {k: v for k, v in devices.items() if k == only_node}
    if not devs:
        return (
            "no node publishes gpupack GPUs"
            if only_node is None
            else f"node {only_node} publishes no gpupack GPUs"
        )
    state, refused = build_state(devs, nodes, used, terms)
    pod = pod_request(pod_key, asks, terms.needs)
    decision = schedule(state, pod, policy, commit=False)
    if decision.fit is None or decision.node is None:
        return _why(decision.failures, refused)
    node = state.nodes[decision.node]
    by_device = {d.name: d for d in devs[decision.node]}
    results: dict[str, list[dict[str, Any]]] = {a.claim: [] for a in asks}
    for cname, shares in decision.fit.placement.containers.items():
        a = asks[int(cname)]
        for s in shares:
            dev = by_device[node.gpus[s.gpu_index].uuid]
            results[a.claim].append({
                "request": a.request, "driver": "gpu.gpupack.io", "pool": dev.node, "device": dev.name,
                "consumedCapacity": consumed(dev, a.mem_mib, a.sm_pct),
            })  # fmt: skip
    return Chosen(decision.node, results)


def place_host(
    pod_key: str,
    devices: Mapping[str, list[Device]],
    nodes: Mapping[str, nr.NodeFacts],
    used: Mapping[str, HostUse],
    terms: nr.PodTerms,
    policy: Policy,
) -> str | None:
    """The node gpupack's policy picks for a pod that asks no GPU (the one whose CPU and memory
    strand the fewest GPUs, as the extender scores such pods), among the nodes with gpupack
    devices; None when none fits (kube-scheduler then places it as it would)."""
    if terms.problem:
        return None
    state, _ = build_state(devices, nodes, used, terms)
    decision = schedule(state, PodRequest(key=pod_key, cpu_milli=terms.needs.cpu_milli,
                                          ram_mib=nr.ceil_mib(terms.needs.mem_bytes)), policy, commit=False)  # fmt: skip
    return decision.node


def _why(failures: Mapping[str, FitFailure], refused: Mapping[str, str]) -> str:
    """One line: how many nodes refused and the commonest reasons (as kube-scheduler words it)."""
    counts: dict[str, int] = {}
    for f in failures.values():
        counts[f.code] = counts.get(f.code, 0) + 1
    for r in refused.values():
        counts[r[:60]] = counts.get(r[:60], 0) + 1
    total = len(failures) + len(refused)
    if not total:
        return "no node publishes gpupack GPUs"
    parts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
    return f"0/{total} nodes have room for the pod's GPU claims: {parts}"
