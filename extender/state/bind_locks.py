"""What keeps a node from taking another GPU pod right now: the pending GPU handoff of a pod the
kubelet may admit there (one per node), a bind of this process in progress, or a pod
kube-scheduler is about to bind there; and the Bindings whose outcome is not known yet."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from gpupack import handoff

from .records import PodInfo
from .view_shared import ViewShared

# `expected` is swept of expired entries when it grows past this many (see BindLocks.expect).
EXPECTED_SWEEP = 256


class BindLocks:
    """Part of the cluster view (ClusterView.locks); its lock guards it."""

    def __init__(self, view: ViewShared) -> None:
        self.view = view
        # node -> keys of its pods whose handoff is pending; only nodes that have one (an empty set is
        # dropped), so its size is the number of pending handoffs, not of nodes that ever had one
        self.pending: dict[str, set[str]] = {}
        self.inflight: set[str] = set()  # pods this process is binding now (assumed, Binding not answered)
        # Pods whose Binding got no answer and whose fate could not be found out yet: pod key ->
        # (uid, the Binding's resourceVersion precondition, its assignment). It stays charged, and
        # counts as a pending handoff, until the janitor settles them (Settler.settle_doubtful).
        self.doubtful: dict[str, tuple[str, str, str]] = {}  # key -> (uid, rv, assignment held)
        # node -> pod key -> uid of every bind request this process holds, from its arrival on (before
        # it reads the pod, queues for the node or writes anything): filter steers the next pods
        # away from these nodes at once, not only once the assignment is written.
        self.claims: dict[str, dict[str, str]] = {}
        # keys of the claims whose room the view charges already (the bind holds its assignment, or
        # its CPU/memory): the others are about to take room that no fit sees yet (see unsettled)
        self.charged: set[str] = set()
        # pod uid -> (until when, key, nodes): where kube-scheduler will most likely bind a pod this
        # process has just prioritized (its top-scored nodes, when only a few share the top). The
        # scheduler starts the bind and its next pod's filter at the same moment, so that filter
        # can overtake the bind; it steers away from these nodes as from a bind in progress.
        self.expected: dict[str, tuple[float, str, tuple[str, ...]]] = {}
        self._sweep_at = EXPECTED_SWEEP

    def may_be_admitted(self, p: PodInfo) -> bool:
        """Whether the kubelet may admit this assigned pod on its node: bound there, or being bound
        by this process, or its Binding's fate unknown. A pod with an assignment but no node (left
        by an extender before the one-write Binding) never will, and locks nothing."""
        return bool(p.bound_node) or p.key in self.inflight or p.key in self.doubtful

    def blocking_handoff(self, node: str, exclude_uid: str) -> handoff.PodView | None:
        """The pending handoff that keeps another pod off `node`. Only a pod the kubelet may admit
        there counts (see may_be_admitted)."""
        with self.view.lock:
            views = [
                p.pod_view()
                for k in self.pending.get(node, ())
                if (p := self.view.pods.get(k)) is not None and self.may_be_admitted(p)
            ]
        return handoff.blocking_handoff(views, node, exclude_uid=exclude_uid)

    def claim(self, node: str, key: str, uid: str) -> None:
        """A bind of pod `key` to `node` has arrived (see `claims`)."""
        with self.view.lock:
            self.claims.setdefault(node, {})[key] = uid
            self.expected.pop(uid, None)

    def expect(self, uid: str, key: str, nodes: tuple[str, ...], until: float) -> None:
        """Pod `uid` will most likely be bound to one of `nodes` before `until` (see `expected`)."""
        with self.view.lock:
            if nodes:
                self.expected[uid] = (until, key, nodes)
                if len(self.expected) > self._sweep_at:
                    # The filters' lock checks drop expired expectations as they pass them; with
                    # none coming (prioritize alone, or a burst of pods never filtered again) they
                    # are dropped here, so the map holds the last EXPECT_S's pods, not history.
                    # The next sweep waits for twice what is left: amortised O(1) an expectation.
                    now = time.monotonic()  # the callers' `until` is on this clock
                    for u in [u for u, e in self.expected.items() if e[0] <= now]:
                        del self.expected[u]
                    self._sweep_at = max(EXPECTED_SWEEP, 2 * len(self.expected))
            else:
                self.expected.pop(uid, None)

    def forget_pod(self, uid: str) -> None:
        """The pod `uid` is gone (deleted, or bound: the watch showed it): no bind is to be
        expected for it. View lock held."""
        if uid:
            self.expected.pop(uid, None)

    def tracked_sizes(self) -> dict[str, int]:
        """Entries per map and set (nested ones counted); view lock held."""
        return {
            "locks.pending": len(self.pending) + sum(map(len, self.pending.values())),
            "locks.inflight": len(self.inflight),
            "locks.doubtful": len(self.doubtful),
            "locks.claims": len(self.claims) + sum(map(len, self.claims.values())),
            "locks.charged": len(self.charged),
            "locks.expected": len(self.expected),
        }

    def settle_claim(self, key: str) -> None:
        """The claim of `key` holds its room in the view now (see `charged`)."""
        with self.view.lock:
            self.charged.add(key)
            self.view.changed.notify_all()  # a filter waiting for this room (Filter._await_room)

    def unsettled(self, exclude_uid: str) -> dict[str, str]:
        """node -> key of a pod about to take room there that no fit sees yet: a bind that has
        arrived and holds nothing yet. A fit on such a node may be refused by the bind that
        follows it. (A pod only expected on a node is not counted: see `coming`.)"""
        out: dict[str, str] = {}
        with self.view.lock:
            for node, binds in self.claims.items():
                for k, uid in binds.items():
                    if k not in self.charged and (uid != exclude_uid or not uid):
                        out.setdefault(node, k)
                        break
        return out

    def coming(self, exclude_uid: str, now: float) -> dict[str, str]:
        """node -> key of a pod expected to be bound there any moment (see `expected`) whose bind
        has not arrived: kube-scheduler starts that bind and its next pod's filter together, so
        the filter can overtake it. Unlike `unsettled`, the pod may never be bound (another node
        chosen, a later plugin failing it), so a filter waits for it only briefly."""
        out: dict[str, str] = {}
        with self.view.lock:
            for uid, (until, key, nodes) in list(self.expected.items()):
                if until <= now:
                    del self.expected[uid]
                elif uid != exclude_uid:
                    for n in nodes:
                        out.setdefault(n, key)
        return out

    def about_to_take(self, exclude_uid: str, now: float | None) -> tuple[dict[str, str], dict[str, str]]:
        """`unsettled` and, with `now`, `coming` (else nothing), read under one hold of the lock:
        what a filter's settle stage weighs."""
        with self.view.lock:
            return self.unsettled(exclude_uid), {} if now is None else self.coming(exclude_uid, now)

    def unclaim(self, node: str, key: str) -> None:
        with self.view.lock:
            self.charged.discard(key)
            c = self.claims.get(node)
            if c is not None:
                c.pop(key, None)
                if not c:
                    del self.claims[node]

    def locked_nodes(
        self, exclude_uid: str, now: float | None = None, handoffs: bool = True
    ) -> dict[str, str]:
        """node -> key of the pod whose pending handoff blocks a bind there (see blocking_handoff;
        not with `handoffs` false: a CPU-only pod's bind never waits for one), of a bind that has
        arrived for it and is still in progress (see `claims`), or of a pod expected to be bound
        there any moment (see `expected`, with `now` on time.monotonic())."""
        out: dict[str, str] = {}
        with self.view.lock:
            if self.expected and now is not None:
                for uid, (until, key, nodes) in list(self.expected.items()):
                    if until <= now:
                        del self.expected[uid]
                    elif uid != exclude_uid:
                        out.update(dict.fromkeys(nodes, key))
            for node, binds in self.claims.items():
                for k, uid in binds.items():
                    if uid != exclude_uid or not uid:
                        out[node] = k
                        break
            for node, keys in self.pending.items() if handoffs else ():
                for k in keys:
                    p = self.view.pods.get(k)
                    if p is not None and p.pending and p.uid != exclude_uid and self.may_be_admitted(p):
                        out[node] = k
                        break
        return out

    def lock_check(
        self, exclude_uid: str, now: float | None = None, handoffs: bool = True
    ) -> Callable[[str], str | None]:
        """What `locked_nodes` would say of one node, asked node by node: the key of the pod that
        locks it, or None. Its cost per node does not depend on how many handoffs are pending
        elsewhere, so a filter asks only about the nodes it would answer with. View lock held
        while the check is used."""
        expected: dict[str, str] = {}
        if self.expected and now is not None:
            for uid, (until, key, nodes) in list(self.expected.items()):
                if until <= now:
                    del self.expected[uid]
                elif uid != exclude_uid:
                    expected.update(dict.fromkeys(nodes, key))
        pending = self.pending if handoffs else {}
        claims, pods = self.claims, self.view.pods

        def check(node: str) -> str | None:
            # the same precedence as locked_nodes: a pending handoff, then a bind, then an expectation
            for k in pending.get(node, ()):
                p = pods.get(k)
                if p is not None and p.pending and p.uid != exclude_uid and self.may_be_admitted(p):
                    return k
            for k, uid in claims.get(node, {}).items():
                if uid != exclude_uid or not uid:
                    return k
            return expected.get(node)

        return check

    def index_pending(self, p: PodInfo) -> None:
        if p.pending:
            self.pending.setdefault(p.node, set()).add(p.key)
        else:
            self.unindex(p.node, p.key)

    def hold_doubtful(self, key: str, uid: str, rv: str) -> None:
        """Keep the assumed assignment of `key` charged: its Binding may yet have taken effect."""
        with self.view.lock:
            p = self.view.pods.get(key)
            if p is not None and p.uid == uid:
                self.doubtful[key] = (uid, rv, p.assignment_raw)

    def doubtful_items(self) -> list[tuple[str, str, str]]:
        """(pod key, uid, the doubtful Binding's resourceVersion precondition) of each doubt held."""
        with self.view.lock:
            return [(k, uid, rv) for k, (uid, rv, _raw) in self.doubtful.items()]

    def pending_bound(self) -> list[PodInfo]:
        """Pods bound to a node whose handoff is still pending."""
        with self.view.lock:
            return [
                replace(p)
                for keys in self.pending.values()
                for k in keys
                if (p := self.view.pods.get(k)) is not None and p.pending and p.bound_node
            ]

    def unindex(self, node: str, key: str) -> None:
        """A pod's record left `node` (its handoff no longer locks it)."""
        pend = self.pending.get(node)
        if pend is not None:
            pend.discard(key)
            if not pend:
                del self.pending[node]
