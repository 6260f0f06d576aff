"""Defrag reservations as the extender honours them (pure; no I/O, the clock is passed in).

A reservation on a node holds GPU shares for the replacement of an evicted pod, or for the pod a
preemption evicted others for. Unexpired and not yet consumed, it counts as used for every pod
except one that matches it (same namespace, same controlling owner kind and name, same class; a
preemption's, owner kind `Pod`: that pod by name). A matching pod is steered onto exactly the
reserved GPUs; its Assignment then names the reservation, which marks it consumed. A
preemption's hold also holds the preemptor's host room (CPU, memory, a pod slot) from the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from gpupack.contract import Reservation
from gpupack.core.model import Node, PodRequest
from gpupack.handoff import parse_rfc3339

from .hostuse import MIB, HostUse

HOLDER_PREFIX = "reservation:"


def is_active(r: Reservation, now: datetime, consumed: set[str] | frozenset[str] = frozenset()) -> bool:
    """Unexpired and not consumed. An unreadable expiry holds nothing: a reservation must say
    until when it blocks capacity, or a typo would block a GPU forever."""
    if r.id in consumed:
        return False
    t = parse_rfc3339(r.expires)
    return t is not None and now < t


def active(
    reservations: Iterable[Reservation], now: datetime, consumed: set[str] | frozenset[str] = frozenset()
) -> list[Reservation]:
    return [r for r in reservations if is_active(r, now, consumed)]


def matches(r: Reservation, pod: PodRequest) -> bool:
    if r.owner_kind == "Pod":  # a preemption's hold: for that one pod (extender/controllers/preemption.py)
        return pod.key == f"{r.namespace}/{r.owner_name}" and r.pod_class == pod.pod_class
    return (
        pod.owner is not None
        and r.namespace == pod.namespace
        and (r.owner_kind, r.owner_name) == pod.owner
        and r.pod_class == pod.pod_class
    )


def per_gpu(r: Reservation) -> dict[str, tuple[int, int, bool]]:
    """GPU uuid -> (mem MiB, milli, exclusive) the reservation holds, all containers summed."""
    out: dict[str, tuple[int, int, bool]] = {}
    for shares in r.containers.values():
        for s in shares:
            m, k, e = out.get(s.uuid, (0, 0, False))
            out[s.uuid] = (m + s.mem_mib, k + s.sm_pct * 10, e or s.exclusive)
    return out


def hold(node: Node, held: Iterable[Reservation]) -> Node:
    """A copy of `node` on which the reservations' shares count as used.

    Conservative by design: a share that collides with what is already there is charged
    anyway, so the GPU looks full rather than double-booked.
    """
    out = node.copy()
    by_uuid = {g.uuid: g for g in out.gpus}
    for r in held:
        for uuid, (mem, milli, ex) in per_gpu(r).items():
            g = by_uuid.get(uuid)
            if g is not None:
                g.charge(HOLDER_PREFIX + r.id, mem, milli, ex, r.pod_class)
        if out.cpu_milli:
            out.cpu_used += r.host_cpu_milli
        if out.ram_mib:
            out.ram_used += -(-r.host_mem_bytes // MIB)
    return out


def held_host(held: Iterable[Reservation], pod: PodRequest) -> tuple[HostUse, int]:
    """The host room (CPU, memory; pod slots) that reservations other than `pod`'s own hold."""
    cpu = mem = pods = 0
    for r in held:
        if not matches(r, pod):
            cpu, mem, pods = cpu + r.host_cpu_milli, mem + r.host_mem_bytes, pods + r.host_pods
    return HostUse(cpu, mem), pods


def steer(node: Node, mine: Reservation, others: Iterable[Reservation]) -> Node:
    """A copy of `node` where only `mine`'s GPUs are usable and the other reservations hold."""
    out = hold(node, others)
    reserved = set(per_gpu(mine))
    for g in out.gpus:
        if g.uuid not in reserved:
            g.healthy = False
    return out


def candidates(
    node: Node, reservations: Iterable[Reservation], pod: PodRequest, now: datetime, consumed: set[str]
) -> list[tuple[Node, Reservation | None]]:
    """The node views `pod` may be placed on, best first.

    First the pod's own reservations (steered onto their GPUs), then the node with every
    reservation holding. Without active reservations: the node itself, uncopied.
    """
    act = active(reservations, now, consumed)
    if not act:
        return [(node, None)]
    mine = [r for r in act if matches(r, pod)]
    out: list[tuple[Node, Reservation | None]] = [
        (steer(node, r, [o for o in act if o is not r]), r) for r in mine
    ]
    out.append((hold(node, act), None))
    return out
