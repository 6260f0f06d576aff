"""kube-scheduler's NodeResourcesFit filter, as the extender runs it for gpupack's profile.

The shipped profile disables that plugin's Filter (deploy/scheduler/config.yaml): for a pod that
requests gpupack resources it costs kube-scheduler 5-10 µs a node (v1.28 matches every requested
extended resource name against a regular expression on every node before `ignoredResourceGroups`
lets it pass), on its serial cycle and on every node. The extender already keeps each node's
allocatable and what every pod on it requests, including the pods it is binding, so it answers the
same question here, with kube-scheduler's words: "Too many pods", "Insufficient cpu", ...

Pure: the view supplies the numbers (extender/state/host_ledger.py, `track_host`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpupack.core.fit import FitFailure
from gpupack.core.model import PodRequest

from .hostuse import NO_HOST_USE, HostUse, host_plus, ram_mib
from .records import NodeInfo

# kube-scheduler's reason strings (pkg/scheduler/framework/plugins/noderesources/fit.go), so that
# kubectl describe reads as it does without gpupack and equal reasons aggregate in its event
TOO_MANY_PODS = "Too many pods"


@dataclass(frozen=True)
class HostedPodRequest(PodRequest):
    """A pod's request with the host resources kube-scheduler counts for it, exactly (the core's
    `cpu_milli`/`ram_mib` are what the policy weighs; memory there is in whole MiB)."""

    host: HostUse = NO_HOST_USE


def hosted(req: PodRequest, host: HostUse) -> HostedPodRequest:
    """`req` with `host`, and the core's CPU and memory (whole MiB, rounded up) taken from it."""
    base = {f.name: getattr(req, f.name) for f in fields(PodRequest)}
    base.update(cpu_milli=host.cpu_milli, ram_mib=ram_mib(host.mem_bytes))
    return HostedPodRequest(**base, host=host)


def node_resources_fit(
    info: NodeInfo, want: HostUse, held: HostUse = NO_HOST_USE, held_pods: int = 0
) -> FitFailure | None:
    """Whether a pod requesting `want` fits next to the pods already on the node, resource by
    resource as NodeResourcesFit's fitsRequest compares them (allocatable minus requested), or why
    not: every resource short, joined, the first one's code for the metrics. Unresolvable when the
    pod asks for more than the node has at all (no pod leaving would help). A resource the pod
    does not request is not compared. `held`, `held_pods`: room that reservations hold for
    other pods (a preemptor's), counted as requested."""
    alloc, used, count = info.allocatable, info.requested, info.pod_count
    if held_pods or held != NO_HOST_USE:
        used, count = host_plus(used, held), count + held_pods
    # The common answer first, the same comparisons without building the reasons: this runs for
    # every node the first time a pod shape is filtered (1,000 nodes on kube-scheduler's cycle).
    if (
        info.pods_allowed - count >= 1
        and (want.cpu_milli <= 0 or want.cpu_milli <= alloc.cpu_milli - used.cpu_milli)
        and (want.mem_bytes <= 0 or want.mem_bytes <= alloc.mem_bytes - used.mem_bytes)
        and (want.eph_bytes <= 0 or want.eph_bytes <= alloc.eph_bytes - used.eph_bytes)
        and not want.other
    ):
        return None
    short: list[tuple[str, str]] = []
    never = False

    def check(need: int, have: int, taken: int, reason: str, code: str) -> None:
        nonlocal never
        if need > 0 and need > have - taken:
            short.append((reason, code))
            never = never or need > have

    check(1, info.pods_allowed, count, TOO_MANY_PODS, "pods")
    check(want.cpu_milli, alloc.cpu_milli, used.cpu_milli, "Insufficient cpu", "cpu")
    check(want.mem_bytes, alloc.mem_bytes, used.mem_bytes, "Insufficient memory", "ram")
    check(
        want.eph_bytes, alloc.eph_bytes, used.eph_bytes, "Insufficient ephemeral-storage", "ephemeral-storage"
    )
    if want.other:
        have, taken = dict(alloc.other), dict(used.other)
        for name, amount in want.other:
            check(amount, have.get(name, 0), taken.get(name, 0), f"Insufficient {name}", "extended-resource")
    if not short:
        return None
    return FitFailure(", ".join(r for r, _ in short), short[0][1], never)
