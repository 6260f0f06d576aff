"""Evictions through the Eviction API as defrag makes them: waiting for every PodDisruptionBudget
covering the pod to allow a disruption, retrying the API server's load shedding (a 429 that names
no budget), and waiting for the controller's replacement to be Ready."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kubernetes import client

from gpupack.contract import selector_matches
from gpupack.core.defrag import Move
from gpupack.kubeclient import ApiException, KubeClient

log = logging.getLogger("gpupack.defrag")

EVICT_THROTTLE_RETRIES = 3


def _owned_by(pod: dict[str, Any], kind: str, name: str) -> bool:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (
            isinstance(ref, dict)
            and ref.get("controller")
            and ref.get("kind") == kind
            and ref.get("name") == name
        ):
            return True
    return False


def budget_refusal(e: ApiException) -> str | None:
    """Why a PodDisruptionBudget refused an eviction (the Eviction API's 429 names the budget in a
    `DisruptionBudget` cause), or None when the 429 is not a budget's."""
    try:
        status = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        return None
    causes = (status.get("details") or {}).get("causes") if isinstance(status, dict) else None
    for c in causes or []:
        if isinstance(c, dict) and c.get("reason") == "DisruptionBudget":
            return str(c.get("message") or status.get("message") or "DisruptionBudget")
    return None


def _retry_after(e: ApiException) -> float:
    try:
        return min(10.0, max(0.1, float((e.headers or {}).get("Retry-After") or 1)))
    except (TypeError, ValueError):
        return 1.0


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


# The cluster autoscaler's "status taint" convention: a node carrying a taint with this prefix is
# ready but must not take pods for now; CA keeps it out of scale-up (never copies the taint into a
# node template) and may still remove it once it is empty.


def _budget_state(pdb: dict[str, Any]) -> tuple[bool, str]:
    """(allows a disruption now, a description) from a PodDisruptionBudget as the disruption
    controller last computed it; a budget whose spec changed since is not trusted yet."""
    meta, st = pdb.get("metadata") or {}, pdb.get("status") or {}
    name = meta.get("name")
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False, f"{name}: not yet computed for its current spec"
    allowed = int(st.get("disruptionsAllowed") or 0)
    desc = (
        f"{name}: {allowed} disruption(s) allowed, {st.get('currentHealthy', '?')} healthy of "
        f"{st.get('expectedPods', '?')}, {st.get('desiredHealthy', '?')} desired"
    )
    return allowed >= 1, desc


class Evictor:
    def __init__(self, kc: KubeClient, poll_s: float) -> None:
        self.kc = kc
        self.core = kc.core
        self.policy = kc.policy
        self.poll_s = poll_s
        self.budget_waited = 0.0  # seconds spent waiting for disruption budgets

    def evict(self, namespace: str, name: str, uid: str) -> None:
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        self.kc.json(self.core.create_namespaced_pod_eviction, name, namespace, body)

    def evict_retrying(self, namespace: str, name: str, uid: str) -> None:
        """Evict; a 429 that is not a budget's refusal is the API server shedding load (priority
        and fairness): wait as it asks and try again a few times."""
        for attempt in range(EVICT_THROTTLE_RETRIES + 1):
            try:
                self.evict(namespace, name, uid)
                return
            except ApiException as e:
                if e.status != 429 or budget_refusal(e) is not None or attempt == EVICT_THROTTLE_RETRIES:
                    raise
                wait = _retry_after(e)
                log.info("eviction of %s/%s throttled (429); retrying in %gs", namespace, name, wait)
                time.sleep(wait)

    def pods_of(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        raw = self.kc.json(self.core.list_namespaced_pod, namespace)
        return [p for p in raw.get("items") or [] if _owned_by(p, kind, name)]

    def wait_replacement(
        self, move: Move, before: set[str], timeout_s: float
    ) -> tuple[dict[str, Any] | None, str]:
        """The moved pod's replacement once it is bound, Running and Ready (None and the last state
        seen when `timeout_s` passes first): a pod of the same owner not in `before`."""
        deadline = time.monotonic() + timeout_s
        last = "no replacement pod yet"
        while True:
            for p in self.pods_of(move.namespace, move.owner_kind, move.owner_name):
                meta = p.get("metadata") or {}
                if meta.get("uid") in before or meta.get("deletionTimestamp"):
                    continue
                node = (p.get("spec") or {}).get("nodeName")
                phase = (p.get("status") or {}).get("phase")
                # Running is not serving: until readiness passes the workload is one replica short
                # (its PodDisruptionBudget does not count the pod either), so the move is not over.
                if node and phase == "Running" and _ready(p):
                    return p, ""
                state = "Running but not Ready" if phase == "Running" else (phase or "?")
                last = f"replacement {meta.get('name')} is {state}" + (f" on {node}" if node else ", unbound")
            if time.monotonic() >= deadline:
                return None, last
            time.sleep(self.poll_s)

    def budgets_for(self, pod: dict[str, Any]) -> list[dict[str, Any]]:
        meta = pod.get("metadata") or {}
        ns, labels = str(meta.get("namespace")), meta.get("labels") or {}
        raw = self.kc.json(self.policy.list_namespaced_pod_disruption_budget, ns)
        return [
            b
            for b in raw.get("items") or []
            if selector_matches((b.get("spec") or {}).get("selector"), labels)
        ]

    def wait_budget(self, pod: dict[str, Any], deadline: float) -> str:
        """Wait until every PodDisruptionBudget covering `pod` allows a disruption; '' when they do,
        else why not once `deadline` (monotonic) passes. Waiting here, not collecting 429s, is what
        lets a PDB-protected workload move one replica after another in one run: the budget comes
        back as soon as the previous replacement is Ready and the disruption controller saw it."""
        t0 = time.monotonic()
        try:
            while True:
                blocked = [d for ok, d in (_budget_state(b) for b in self.budgets_for(pod)) if not ok]
                if not blocked:
                    return ""
                if time.monotonic() >= deadline:
                    return "; ".join(blocked)
                time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())) or self.poll_s)
        finally:
            self.budget_waited += time.monotonic() - t0
