"""The allocator's loop: one pass after any change in the store (at most every `resync_s` without
one), pods gated by `gpupack.io/dra-allocate` one at a time, oldest first, only while this replica
may write (the extender's leader Lease, when it has one).

Per pod: a pod with no gpupack claims is ungated at once (the gate never strands a pod); one whose
claims are not all made yet waits for them (their creation wakes the loop); one whose claims are
all allocated (a restart after the writes, or a claim shared with a pod placed before) is ungated;
otherwise its unallocated gpupack claims are placed together (on the node its allocated ones are
bound to, if any) and written, then it is ungated. A pod that cannot be placed, or whose claims are
malformed, keeps its gate with an Event naming why (one per new reason) and is tried again after a
change, no sooner than its backoff (1 s doubling to 60 s): never a hot loop. Failures stay with the
pod that caused them.

`node_only` (a measurement, not shipped: gpupack chooses the node, kube-scheduler's in-tree allocator
the GPU on it): the placement is the same, but only the node is written, as a pin (required node
affinity + PIN_ANNOTATION, as for CPU pods), and the claims are left for the scheduler to allocate.
Until it has, the devices the placement planned stay booked in memory (`_planned`, one entry per
pinned pod, dropped once its claims are allocated, the pod is gone, or it was not pinned), so the
next placement does not plan onto capacity the scheduler is about to take; a restart loses these
bookings (a pod pinned just before it then counts only once its claim is allocated).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from gpupack.core import node_rules as nr
from gpupack.core.policy_base import Policy
from gpupack.events import EventRecorder

from .allocator import PIN_ANNOTATION, Writer, placed_node
from .claims import Ask, ClaimError, claim_asks, gated, pod_claim_names
from .devices import Device, Parsed, charge_claims, slice_devices
from .placement import Chosen, HostUse, place_host, pod_request
from .placement import place as place_pod
from .store import Store

log = logging.getLogger("gpupack.extender.dra")
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0
WAIT_S = 0.2


@dataclass
class Snapshot:
    devices: dict[str, list[Device]]
    nodes: dict[str, nr.NodeFacts]
    used: dict[str, HostUse]
    claims: dict[str, dict[str, Any]]


@dataclass
class _Retry:
    at: float = 0.0
    delay: float = BACKOFF_MIN_S
    reason: str = ""


@dataclass
class Counts:
    allocated: int = 0
    ungated: int = 0
    refused: int = 0
    conflicts: int = 0
    passes: int = 0
    last: dict[str, int] = field(default_factory=dict)


def _terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class DraAllocator:
    def __init__(
        self,
        api: client.ApiClient,
        policy: Policy,
        classes: Mapping[str, str],
        events: EventRecorder | None = None,
        fence: Callable[[], str] | None = None,
        resync_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        place_pods: bool = False,
        node_only: bool = False,
    ) -> None:
        self.place_pods, self.node_only = place_pods, node_only
        # pod uid -> its claims as planned (allocation results not written): node_only's bookings
        self._planned: dict[str, list[dict[str, Any]]] = {}
        self.policy, self.classes, self.events, self.fence = policy, dict(classes), events, fence
        self.resync_s, self.clock = resync_s, clock
        self.wake = threading.Event()
        self.store = Store(api, self.wake.set)
        self.writer = Writer(api)
        self.retry: dict[str, _Retry] = {}
        self.counts = Counts()
        self._stop = threading.Event()
        self._observed: set[str] = set()
        self._due = float("inf")
        self._needs_cache: dict[tuple[str, str], nr.HostNeeds] = {}
        self._parsed_cache: dict[tuple[str, str], list[Parsed]] = {}
        self._slice_cache: dict[tuple[str, str], list[Device]] = {}
        self._facts_cache: dict[tuple[str, str], nr.NodeFacts] = {}

    def start(self) -> None:
        self.store.start()
        threading.Thread(target=self.run, name="dra-allocator", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        self.store.stop()

    def run(self) -> None:
        self.store.wait_synced(120)
        while not self._stop.is_set():
            # a pod skipped for its backoff is due again at _due: wake then even if nothing changes
            self.wake.wait(max(0.0, min(self.resync_s, self._due - self.clock())))
            self.wake.clear()
            if self._stop.is_set():
                break
            why = self.fence() if self.fence else ""
            if why:
                self._stop.wait(1.0)
                continue
            try:
                self.one_pass()
            except Exception:  # a bug must not end the loop; the next change tries again
                log.exception("DRA allocator pass failed")
                self._stop.wait(1.0)

    # -- a pass --
    def snapshot(self) -> Snapshot:
        seen_slices: dict[tuple[str, str], list[Device]] = {}
        devices = slice_devices(self.store.slices.values(), self._slice_cache, seen_slices)
        self._slice_cache = seen_slices
        claims = {f"{(c.get('metadata') or {}).get('namespace')}/{(c.get('metadata') or {}).get('name')}": c
                  for c in self.store.claims.values()}  # fmt: skip
        parsed: dict[tuple[str, str], list[Parsed]] = {}
        charge_claims(devices, claims.values(), self.classes, self._parsed_cache, parsed)
        self._parsed_cache = parsed
        if self._planned:
            self._charge_planned(devices, claims)
        nodes: dict[str, nr.NodeFacts] = {}
        facts_seen: dict[tuple[str, str], nr.NodeFacts] = {}
        for n in self.store.nodes.values():
            m = n.get("metadata") or {}
            fkey = (str(m.get("name")), str(m.get("resourceVersion")))
            facts = self._facts_cache.get(fkey) or nr.node_facts(n)
            facts_seen[fkey] = nodes[fkey[0]] = facts
        self._facts_cache = facts_seen  # a node's facts parsed once per version, live nodes only
        used: dict[str, HostUse] = {}
        needs_seen: dict[tuple[str, str], nr.HostNeeds] = {}
        for p in self.store.pods.values():
            if _terminal(p):
                continue
            node = (p.get("spec") or {}).get("nodeName") or self._claims_node(p, claims) or self._pinned(p)
            if not node:
                continue
            needs = self._needs(p, needs_seen)
            used[node] = used.get(node, HostUse()).plus(needs)
        self._needs_cache = needs_seen  # bounded by the live pods: only this pass's are kept
        return Snapshot(devices, nodes, used, claims)

    def _needs(self, pod: Mapping[str, Any], seen: dict[tuple[str, str], nr.HostNeeds]) -> nr.HostNeeds:
        """The pod's effective requests, parsed once per pod version (a pass reads every pod)."""
        m = pod.get("metadata") or {}
        key = (str(m.get("uid")), str(m.get("resourceVersion")))
        got = self._needs_cache.get(key)
        if got is None:
            got = nr.pod_terms(pod.get("spec"), host=True).needs
        seen[key] = got
        return got

    def _claims_node(self, pod: Mapping[str, Any], claims: Mapping[str, dict[str, Any]]) -> str | None:
        ns = (pod.get("metadata") or {}).get("namespace")
        for _, cname in pod_claim_names(pod):
            c = claims.get(f"{ns}/{cname}") if cname else None
            node = placed_node(c) if c else None
            if node:
                return node
        return None

    @staticmethod
    def _pinned(pod: Mapping[str, Any]) -> str | None:
        """The node this allocator pinned an ungated pod to (counted there until it is bound)."""
        spec = pod.get("spec") or {}
        if spec.get("schedulingGates") and gated(pod):
            return None
        v = ((pod.get("metadata") or {}).get("annotations") or {}).get(PIN_ANNOTATION)
        return str(v)[:253] if isinstance(v, str) and v else None

    def one_pass(self) -> None:
        self.counts.passes += 1
        self._due = float("inf")
        pods = [p for p in self.store.pods.values() if gated(p) and not _terminal(p)]
        live = {str(p["metadata"]["uid"]) for p in pods}
        for uid in list(self.retry):
            if uid not in live:
                del self.retry[uid]
        self._observed &= live
        if not pods:
            return
        pods.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
        snap: Snapshot | None = None
        now = self.clock()
        for p in pods:
            r = self.retry.get(str(p["metadata"]["uid"]))
            if r is not None and now < r.at:
                self._due = min(self._due, r.at)
                continue
            if snap is None:
                snap = self.snapshot()
            if self.fence and self.fence():
                return
            self.handle(p, snap)
            r = self.retry.get(str(p["metadata"]["uid"]))
            if r is not None:
                self._due = min(self._due, r.at)

    def handle(self, pod: dict[str, Any], snap: Snapshot) -> None:
        meta = pod["metadata"]
        ns, uid = meta["namespace"], str(meta["uid"])
        try:
            mine: list[tuple[dict[str, Any], list[Ask]]] = []
            for entry, cname in pod_claim_names(pod):
                if cname is None:
                    return self._wait(pod, f"waiting for the claim of {entry[:64]} to be made")
                if not cname:
                    continue
                c = snap.claims.get(f"{ns}/{cname}")
                if c is None:
                    return self._wait(pod, f"waiting for ResourceClaim {cname[:64]}")
                asks = claim_asks(c, self.classes)
                if asks:
                    mine.append((c, asks))
            if len(mine) > 4:
                raise ClaimError(f"the pod names {len(mine)} gpupack claims; at most 4")
            if sum(len(a) for _, a in mine) > 8:
                raise ClaimError("the pod's gpupack claims hold more than 8 requests")
            todo = [(c, a) for c, a in mine if not (c.get("status") or {}).get("allocation")]
            nodes = {placed_node(c) for c, _ in mine if (c.get("status") or {}).get("allocation")}
            if len(nodes) > 1 or None in nodes:
                raise ClaimError(
                    "the pod's gpupack claims are allocated on different nodes, or not on one node"
                )
            if todo and self.node_only:
                return self._pin_only(pod, snap, todo, next(iter(nodes)) if nodes else None)
            if todo:
                self._allocate(pod, snap, todo, next(iter(nodes)) if nodes else None)
            elif not mine and self.place_pods:
                return self._ungate(pod, self._host_node(pod, snap))
            self._ungate(pod)
        except ClaimError as e:
            self._fail(pod, str(e), "GPUClaimRefused")
        except client.ApiException as e:
            if e.status in (404, 409, 422):  # changed or gone since read: the next pass sees it anew
                self.counts.conflicts += 1
                self._fail(pod, f"a write conflicted ({e.status}); trying again", "", quiet=True)
            else:
                self._fail(pod, f"the API server answered {e.status} {e.reason}", "", quiet=True)
        else:
            self.retry.pop(uid, None)

    def _place(
        self,
        pod: dict[str, Any],
        snap: Snapshot,
        todo: list[tuple[dict[str, Any], list[Ask]]],
        node: str | None,
    ) -> tuple[str, nr.PodTerms, Chosen]:
        """gpupack's placement of a pod's claims over this pass's snapshot (the pod's key, its
        terms, the node and devices chosen); the policy learns the pod the first time it is seen."""
        asks = [a for _, cl in todo for a in cl]
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        uid = str(pod["metadata"]["uid"])
        terms = nr.pod_terms(pod.get("spec"), host=True)
        if uid not in self._observed:
            self._observed.add(uid)
            self.policy.observe(pod_request(key, asks, terms.needs))
        chosen = place_pod(key, asks, snap.devices, snap.nodes, snap.used, terms, self.policy, node)
        if isinstance(chosen, str):
            raise ClaimError(chosen)
        return key, terms, chosen

    def _allocate(
        self,
        pod: dict[str, Any],
        snap: Snapshot,
        todo: list[tuple[dict[str, Any], list[Ask]]],
        node: str | None,
    ) -> None:
        key, terms, chosen = self._place(pod, snap, todo, node)
        for c, _ in todo:
            name = c["metadata"]["name"]
            done = self.writer.allocate(c, chosen.results[name], chosen.node, pod)
            self.store.claims.put(done)
            snap.claims[f"{done['metadata']['namespace']}/{name}"] = done
            charge_claims(snap.devices, [done], self.classes)
            self.counts.allocated += 1
        snap.used[chosen.node] = snap.used.get(chosen.node, HostUse()).plus(terms.needs)
        log.info("DRA allocator: %s placed on %s (%s)", key, chosen.node,
                 ", ".join(f"{r['device']}" for rs in chosen.results.values() for r in rs))  # fmt: skip

    def _charge_planned(self, devices: dict[str, list[Device]], claims: Mapping[str, dict[str, Any]]) -> None:
        """Book node_only's planned devices of pinned pods whose claims the scheduler has not yet
        allocated; drop the bookings of pods gone, finished or allocated (bounded by live pods)."""
        pinned = {str(p["metadata"]["uid"]) for p in self.store.pods.values()
                  if not _terminal(p) and not (p.get("spec") or {}).get("nodeName") and self._pinned(p)}  # fmt: skip
        for uid, planned in list(self._planned.items()):
            real = [claims.get(f"{c['metadata']['namespace']}/{c['metadata']['name']}") for c in planned]
            if uid not in pinned or all(not c or (c.get("status") or {}).get("allocation") for c in real):
                del self._planned[uid]
                continue
            charge_claims(devices, planned, self.classes)

    def _pin_only(
        self,
        pod: dict[str, Any],
        snap: Snapshot,
        todo: list[tuple[dict[str, Any], list[Ask]]],
        node: str | None,
    ) -> None:
        """node_only: gpupack's placement, but only the node is written (a pin); the GPU is left to
        the scheduler's allocator. A pod with a required node affinity of its own is not pinned
        (the pin would replace it): it is ungated and left to the scheduler whole."""
        if _own_node_affinity(pod):
            return self._ungate(pod)
        key, terms, chosen = self._place(pod, snap, todo, node)
        uid = str(pod["metadata"]["uid"])
        planned = [{"metadata": c["metadata"], "spec": c.get("spec"),
                    "status": {"allocation": {"devices": {"results": chosen.results[c["metadata"]["name"]]}}}}
                   for c, _ in todo]  # fmt: skip
        self._ungate(pod, chosen.node)  # the snapshot counts the pinned pod's CPU and memory there
        self._planned[uid] = planned
        charge_claims(snap.devices, planned, self.classes)
        snap.used[chosen.node] = snap.used.get(chosen.node, HostUse()).plus(terms.needs)
        self.retry.pop(uid, None)
        log.info("DRA allocator (node only): %s pinned to %s", key, chosen.node)

    def _host_node(self, pod: dict[str, Any], snap: Snapshot) -> str | None:
        """Where gpupack's policy would put a pod that asks no gpupack GPU (None: leave it to the
        scheduler: the pod has node affinity of its own, or no node fits it in this view)."""
        if _own_node_affinity(pod):
            return None
        terms = nr.pod_terms(pod.get("spec"), host=True)
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        node = place_host(key, snap.devices, snap.nodes, snap.used, terms, self.policy)
        if node is not None:
            snap.used[node] = snap.used.get(node, HostUse()).plus(terms.needs)
        return node

    def _ungate(self, pod: dict[str, Any], pin: str | None = None) -> None:
        self.store.pods.put(self.writer.ungate(pod, pin))
        self.counts.ungated += 1

    def _wait(self, pod: dict[str, Any], reason: str) -> None:
        """Waiting for an object another controller makes: a short fixed pause, no backoff, no Event."""
        self.retry[str(pod["metadata"]["uid"])] = _Retry(at=self.clock() + WAIT_S)

    def _fail(self, pod: dict[str, Any], reason: str, event: str, quiet: bool = False) -> None:
        uid = str(pod["metadata"]["uid"])
        r = self.retry.setdefault(uid, _Retry())
        r.at = self.clock() + r.delay
        r.delay = min(r.delay * 2, BACKOFF_MAX_S)
        if quiet:
            return
        self.counts.refused += 1
        if reason != r.reason:
            r.reason = reason
            log.info(
                "DRA allocator: %s/%s stays gated: %s",
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                reason,
            )
            if self.events is not None:
                m = pod["metadata"]
                self.events.pod(m["namespace"], m["name"], uid, event, reason, warning=True)


def _own_node_affinity(pod: dict[str, Any]) -> bool:
    """The pod has a required node affinity of its own: a pin would replace it, so gpupack does not pin."""
    spec = pod.get("spec") or {}
    return bool(
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
    )
