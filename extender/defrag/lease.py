"""A coordination.k8s.io/v1 Lease so that two defrag runs never overlap.

Acquire: create the Lease, or take it over when its holder let it expire (renewTime +
leaseDurationSeconds in the past). Every write carries the resourceVersion it read, so two
runs racing for an expired lease cannot both win (the loser gets 409 Conflict). The run renews
between moves and gives the lease up at the end; a crashed run's lease expires on its own.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("gpupack.defrag.lease")


class LeaseHeld(RuntimeError):
    """Another run holds the lease."""


def _fmt(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(v: Any) -> datetime | None:
    if v is None:
        return None
    if isinstance(v, datetime):
        return v if v.tzinfo else v.replace(tzinfo=UTC)
    try:
        t = datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


class RunLease:
    def __init__(
        self, api: client.ApiClient, namespace: str, name: str, holder: str, duration_s: int
    ) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name, self.holder, self.duration_s = namespace, name, holder, duration_s
        self.held = False

    def _body(self, now: datetime, rv: str | None, acquire_time: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv is not None:
            meta["resourceVersion"] = rv
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": acquire_time or _fmt(now),
                "renewTime": _fmt(now),
            },
        }

    def acquire(self, now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        try:
            cur = self.coord.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                self.coord.create_namespaced_lease(self.namespace, self._body(now, None))
            except ApiException as e2:
                if e2.status == 409:
                    raise LeaseHeld(
                        f"lease {self.namespace}/{self.name} was just taken by another run"
                    ) from None
                raise
            self.held = True
            return
        spec = cur.spec
        holder = spec.holder_identity if spec else None
        renewed = _parse(spec.renew_time if spec else None)
        duration = (spec.lease_duration_seconds if spec else None) or 0
        if holder and holder != self.holder and renewed is not None:
            until = renewed + timedelta(seconds=duration)
            if until > now:
                raise LeaseHeld(
                    f"another defrag run ({holder}) holds lease {self.namespace}/{self.name} until "
                    f"{_fmt(until)}"
                )
        try:
            self.coord.replace_namespaced_lease(
                self.name, self.namespace, self._body(now, cur.metadata.resource_version)
            )
        except ApiException as e:
            if e.status == 409:
                raise LeaseHeld(f"lease {self.namespace}/{self.name} was just taken by another run") from None
            raise
        self.held = True

    def renew(self, now: datetime | None = None) -> None:
        """Extend the lease; LeaseHeld if someone else took it (the run must stop)."""
        now = now or datetime.now(UTC)
        cur = self.coord.read_namespaced_lease(self.name, self.namespace)
        if cur.spec is None or cur.spec.holder_identity != self.holder:
            self.held = False
            raise LeaseHeld(f"lease {self.namespace}/{self.name} is no longer ours")
        acquired = _parse(cur.spec.acquire_time)
        body = self._body(now, cur.metadata.resource_version, _fmt(acquired) if acquired else None)
        try:
            self.coord.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                self.held = False
                raise LeaseHeld(f"lease {self.namespace}/{self.name} changed under us") from None
            raise

    def release(self) -> None:
        """Give the lease up (holder cleared) so the next run need not wait for expiry."""
        if not self.held:
            return
        self.held = False
        try:
            cur = self.coord.read_namespaced_lease(self.name, self.namespace)
            if cur.spec is None or cur.spec.holder_identity != self.holder:
                return
            body = client.ApiClient().sanitize_for_serialization(cur)
            body["spec"]["holderIdentity"] = None
            body["spec"]["leaseDurationSeconds"] = 1
            self.coord.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            log.warning("could not release lease %s/%s: %s %s", self.namespace, self.name, e.status, e.reason)
