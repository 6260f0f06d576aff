"""Whether and how a pod fits each node of the view: the core's fit with defrag reservations,
slots, inventory and host resources, cached per pod shape and node version, and shared by nodes
in the same state."""

from __future__ import annotations

import itertools
from datetime import datetime

from gpupack.contract import RES_GPU, Reservation
from gpupack.core.fit import Fit, FitFailure, host_fit
from gpupack.core.model import Node, Placement, PodRequest
from gpupack.core.policies import Policy

from ..state import reservations as resv
from ..state.hostuse import NO_HOST_USE
from ..state.node_resources import HostedPodRequest, node_resources_fit
from ..state.records import NodeInfo
from ..state.view import ClusterView
from .answers import FilterAnswer, Key, MemoFailure, Tables, VersionedTable, signature

STATE_IDS_MAX = 10_000  # node states numbered (Fitter.state); ~1.2 KB each at 8 GPUs

FitResult = Fit | FitFailure
FitTable = VersionedTable[FitResult]
# node state -> what node_fit answered for the first node in it (see Fitter.node_fit's `memo`)
FitMemo = dict[int | None, Fit | MemoFailure]


def fit_on(f: Fit, node: str) -> Fit:
    """`f` (a fit on another node in the same state: the same GPUs) as a fit on `node`."""
    return Fit(Placement(node, f.placement.containers), f.charged)


class Fitter:
    """A pod's fit on the view's nodes. Every method is called with the view's lock held."""

    def __init__(self, view: ClusterView, policy: Policy) -> None:
        self.view = view
        self.policy = policy
        self.fits: Tables[FitResult] = Tables()  # pod shape -> node -> (version, fit)
        self._states: VersionedTable[int | None] = VersionedTable()
        self._state_ids: dict[Key, int] = {}
        self._state_seq = itertools.count()
        view.gone_hooks.add(self.node_gone)

    def node_gone(self, name: str) -> None:
        """Node `name` was deleted: its entries go from every kept shape's table (view lock held)."""
        self._states.pop(name, None)
        self.fits.forget_node(name)

    def tracked_sizes(self) -> dict[str, int]:
        """Entries kept: pod shapes, their per-node fits, node states (view lock held)."""
        return {
            "fitter.shapes": len(self.fits.data),
            "fitter.fits": self.fits.entries(),
            "fitter.node_states": len(self._states),
            "fitter.state_ids": len(self._state_ids),
        }

    def node_fit(
        self, name: str, pod: PodRequest, now: datetime, table: FitTable | None, memo: FitMemo | None = None
    ) -> tuple[FitResult, Reservation | None]:
        """Fit on one node, honouring defrag reservations; the reservation the fit uses."""
        view = self.view
        info = view.nodes.get(name)
        node = view.state.nodes.get(name)
        if info is None or node is None:
            return FitFailure(
                f"node {name} is not in gpupack's view of the cluster (yet)", "unknown-node"
            ), None
        if view.track_host and isinstance(pod, HostedPodRequest):
            # kube-scheduler's NodeResourcesFit filter, off in the shipped profile (node_resources.py);
            # a preemptor's hold keeps its host room from the others
            kept, held_pods = (
                resv.held_host(view.active_reservations(name, now), pod)
                if info.reservations
                else (NO_HOST_USE, 0)
            )
            short = node_resources_fit(info, pod.host, kept, held_pods)
            if short is not None:
                return short, None
        if not pod.needs_gpu:
            return self.host_only_fit(name, node, pod, now, table), None
        if info.inventory_error:
            return FitFailure(
                f"node {name}: its {('gpupack.io/inventory')} annotation is unreadable ({info.inventory_error})",
                "corrupt-inventory",
                True,
            ), None
        if info.slots <= 0:
            return FitFailure(
                f"node {name}: no {RES_GPU} slots allocatable (the gpupack device plugin is not registered "
                "with its kubelet, or has gone)",
                "no-slots",
            ), None
        if info.inventory_conflict:
            return FitFailure(info.inventory_conflict, "inventory-contradicts-kubelet", True), None
        need = pod.gpu_slots
        free = view.slots_free(name)
        if need > free:
            return FitFailure(
                f"node {name}: {need} {RES_GPU} slot(s) needed, {max(free, 0)} of {info.slots} free "
                "(the kubelet admits no more GPU containers)",
                "slots",
            ), None
        held = view.active_reservations(name, now)
        if not held:
            return self._plain_fit(name, info, node, pod, table, memo), None
        last: FitResult = FitFailure("no fit", "none")
        for cand, reservation in resv.candidates(node, held, pod, now, set()):
            r = self.policy.fit(cand, pod)
            if r:
                return r, reservation
            last = r
        if isinstance(last, FitFailure) and "reservation" not in last.reason:
            last = FitFailure(f"{last.reason} (with {len(held)} defrag reservation(s) held)", last.code)
        return last, None

    def _plain_fit(
        self,
        name: str,
        info: NodeInfo,
        node: Node,
        pod: PodRequest,
        table: FitTable | None,
        memo: FitMemo | None,
    ) -> FitResult:
        """The fit on a node without reservations: from the table, from another node in the same
        state (`memo`: a fresh or evenly filled cluster), or the policy's."""
        if table is not None:
            hit = table.fresh(name, info.version)
            if hit is not None:
                f = hit[1]
                if isinstance(f, Fit) and f.placement.node != name:
                    f = fit_on(f, name)  # a node in the same state's (fit_every_node)
                return f
        r: FitResult | None = None
        sig = None
        if memo is not None:
            sig = self.state(name, info)
            known = memo.get(sig)
            if isinstance(known, Fit):
                r = fit_on(known, name)
            elif known is not None and known.reason.find(known.node) < 0:
                r = known.failure
        if r is None:
            r = self.policy.fit(node, pod)
            if memo is not None:
                memo[sig] = r if isinstance(r, Fit) else MemoFailure(r, name)
        if table is not None:
            table.put(name, info.version, r)
        return r

    def host_only_fit(
        self, name: str, node: Node, pod: PodRequest, now: datetime, table: FitTable | None
    ) -> FitResult:
        """A CPU-only pod's fit: no slots, no handoff, no inventory needed (it never meets the device
        plugin). On a GPU node the policy's own fit, as the simulator's schedule() runs it; defrag
        reservations hold their GPUs there, but none steers it (it takes no GPU)."""
        info = self.view.nodes[name]
        held = self.view.active_reservations(name, now)
        if not held and table is not None:
            hit = table.fresh(name, info.version)
            if hit is not None:
                return hit[1]
        if not node.gpus:
            r = host_fit(node, pod)
        else:
            r = self.policy.fit(resv.hold(node, held) if held else node, pod)
        if not held and table is not None:
            table.put(name, info.version, r)
        return r

    def fit_every_node(
        self, st: FilterAnswer, names: list[str], pod: PodRequest, now: datetime, table: FitTable
    ) -> None:
        """Fill a new filter answer (`st`, nothing in it yet): the first filter of a pod shape, so
        every asked node. node_fit's answer for each, with its work done once per node state
        (`state`) instead of once per node: kube-scheduler waits for this filter, and with a few
        dozen states among 1,000 nodes the per-node cost is what is left (~5 ms a new shape at
        1,000 nodes through node_fit, ~27 ms at 5,000). A failure whose reason names its node is
        not handed on to another; a Fit is, in the fit table only (its placement names the
        state's first node; node_fit copies it for the node asked about)."""
        nodes = self.view.nodes
        states = self._states
        host = pod.host if self.view.track_host and isinstance(pod, HostedPodRequest) else None
        by_state: dict[int, Fit | MemoFailure] = {}  # as node_fit's memo keeps them
        ok, failed, unresolvable = st.ok, st.failed, st.unresolvable
        code_of, codes = st.code_of, st.codes
        for n in names:
            info = nodes.get(n)
            if info is None or info.reservations:
                r, res = self.node_fit(n, pod, now, table)
                st.update(n, r, res)
                continue
            if host is not None:
                short = node_resources_fit(info, host)
                if short is not None:
                    st.update(n, short, None)
                    continue
            hit = table.fresh(n, info.version)
            if hit is not None:
                st.update(n, hit[1], None)
                continue
            sh = states.fresh(n, info.version)
            state = sh[1] if sh is not None else self.state(n, info)
            known = by_state.get(state) if state is not None else None
            if known is None or (known.__class__ is MemoFailure and known.reason.find(known.node) >= 0):
                r, _ = self.node_fit(n, pod, now, table)
                if state is not None and known is None:
                    by_state[state] = r if isinstance(r, Fit) else MemoFailure(r, n)
                st.update(n, r, None)
                continue
            if isinstance(known, Fit):
                r = known  # the table keeps the first node's Fit: node_fit hands out this node's
                ok.add(n)
            else:
                r = known.failure
                (unresolvable if r.unresolvable else failed)[n] = r.reason
                code_of[n] = r.code
                codes[r.code] += 1
            table.put(n, info.version, r)
        st.passed = None

    def state(self, name: str, info: NodeInfo) -> int | None:
        """A number for everything node_fit's answer on a node without reservations depends on,
        apart from the node's name: its signature, its free and allocatable slots, whether its
        inventory reads (None: a node gpupack does not know). Nodes with the same number fit and
        score the same. A number, not the tuple: hashing a node's signature (a tuple per GPU) is
        what a lookup by it costs, ~2 µs a node. Cached per node version, as every input is
        charged under one (a slot's use too)."""
        hit = self._states.fresh(name, info.version)
        if hit is not None:
            return hit[1]
        node = self.view.state.nodes.get(name)
        state = None
        if node is not None:
            key = (signature(node), self.view.slots_free(name), info.slots, bool(info.inventory_error),
                   bool(info.inventory_conflict))  # fmt: skip
            state = self._state_ids.get(key)
            if state is None:
                if len(self._state_ids) >= STATE_IDS_MAX:
                    self._state_ids.clear()  # numbers are never reused: new ones from here on
                state = self._state_ids[key] = next(self._state_seq)
        self._states.put(name, info.version, state)
        return state
