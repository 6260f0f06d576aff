"""What a preemption pass reads from the extender's cluster view, under its lock: each node as it
will be once the pods already leaving are gone (reservations held), the preemption holds in
place, and whether a preemptor fits a node as it is now. Plain copies out, so the pass decides
without holding the view's lock (extender/controllers/preemption.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpupack.contract import Reservation
from gpupack.core.model import Node
from gpupack.core.pod_filters import NodeFacts
from gpupack.core.preemption import Admit, Preemptor, Victim, choose, without

from ..state import preempt_inputs as pin
from ..state import reservations as resv
from ..state.hostuse import ram_mib
from ..state.view import ClusterView


def node_facts(view: ClusterView) -> dict[str, NodeFacts]:
    """Each node's labels and taints, as the feasibility filters read them."""
    with view.lock:
        return {n: NodeFacts(n, info.labels, info.taints) for n, info in view.nodes.items()}


def own_reservations(view: ClusterView, now: datetime) -> dict[str, list[Reservation]]:
    """The preemption holds on each node (consumed ones too), by node."""
    with view.lock:
        out: dict[str, list[Reservation]] = {}
        for name, info in view.nodes.items():
            # consumed ones too: the hold of a pod bound there is removed like any other
            mine = [
                r
                for r in resv.active(info.reservations, now)
                if r.owner_kind == "Pod" and r.id.startswith(pin.PREEMPT_PREFIX)
            ]
            if mine:
                out[name] = mine
        return out


def pass_nodes(
    view: ClusterView, now: datetime, taken: set[str], running: list[dict[str, Any]]
) -> tuple[
    dict[str, Node],
    set[str],
    dict[str, frozenset[tuple[str, str, str]]],
    dict[str, str],
    dict[str, tuple[int, int]],
    dict[str, int],
    set[str],
]:
    """Copies of the view's schedulable nodes as they will be: the pods already on their way
    out (`taken` victims, pods being deleted) gone, their host room too, and every active
    reservation held; the nodes a GPU pod can start on (the device plugin registered); each
    node's taints; the class each pod holds its GPUs for; the host CPU (milli) and memory
    (MiB) each pod frees when it goes; and, with host tracking, the pods each node can still
    take; the nodes pods are leaving. Counting the leavers as gone lets a second preemptor use the room a first one's
    victims leave beyond its hold (two 40 GB shares on one GPU: one GPU's victims, not two)."""
    leaving: dict[str, set[str]] = {}
    for p in running:
        where = str((p.get("spec") or {}).get("nodeName") or "")
        k = pin.key_of(p)
        if where and (k in taken or (p.get("metadata") or {}).get("deletionTimestamp")):
            leaving.setdefault(where, set()).add(k)
    with view.lock:
        track = view.track_host
        for k, gp in view.pods.items():
            if k in taken or gp.deleting:
                leaving.setdefault(gp.node, set()).add(k)
        host: dict[str, tuple[int, int]] = {}
        if track:
            for k, hp in view.host.pods.items():
                host[k] = (hp.use.cpu_milli, ram_mib(hp.use.mem_bytes))
        for k, gp in view.pods.items():
            host.setdefault(k, (gp.host.cpu_milli, ram_mib(gp.host.mem_bytes)))
        freed = {k: Victim(k, cpu_milli=c, ram_mib=m) for k, (c, m) in host.items()}
        nodes: dict[str, Node] = {}
        gpu_nodes: set[str] = set()
        taints: dict[str, frozenset[tuple[str, str, str]]] = {}
        room: dict[str, int] = {}
        for name, node in view.state.nodes.items():
            info = view.nodes.get(name)
            if info is None or info.unschedulable:
                continue
            if info.slots > 0 and node.gpus:
                gpu_nodes.add(name)
            elif not track:
                continue  # no device plugin there: no GPU pod can start on it
            gone = leaving.get(name, set())
            base = without(node, gone, freed) if gone else node
            nodes[name] = resv.hold(base, view.active_reservations(name, now))
            taints[name] = info.taints
            if track and info.pods_allowed > 0:
                held = sum(r.host_pods for r in view.active_reservations(name, now))
                room[name] = info.pods_allowed - info.pod_count + len(gone) - held
        classes = {k: p.assignment.pod_class for k, p in view.pods.items()}
        return nodes, gpu_nodes, taints, classes, host, room, {n for n, ks in leaving.items() if ks}


def fits_now(view: ClusterView, name: str, pre: Preemptor, now: datetime, admit: Admit | None = None) -> bool:
    """Whether `pre` fits on the node as the view has it, the pods on their way out still there
    (and, with `admit`, the policy does not refuse it there)."""
    with view.lock:
        node = view.state.nodes.get(name)
        if node is None:
            return False
        held = resv.hold(node, view.active_reservations(name, now))
    return choose([held], pre, {}, admit=admit) is not None
