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

from gpupack.kubeclient import ApiException, KubeClient

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


def _rv(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class RunLease:
    def __init__(self, kc: KubeClient, namespace: str, name: str, holder: str, duration_s: int) -> None:
        self.kc = kc
        self.coord = kc.coordination
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
            cur = self.kc.json(self.coord.read_namespaced_lease, self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                self.kc.json(self.coord.create_namespaced_lease, self.namespace, self._body(now, None))
            except ApiException as e2:
                if e2.status == 409:
                    raise LeaseHeld(
                        f"lease {self.namespace}/{self.name} was just taken by another run"
                    ) from None
                raise
            self.held = True
            return
        spec = cur.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime"))
        duration = int(spec.get("leaseDurationSeconds") or 0)
        if holder and holder != self.holder and renewed is not None:
            until = renewed + timedelta(seconds=duration)
            if until > now:
                raise LeaseHeld(
                    f"another defrag run ({holder}) holds lease {self.namespace}/{self.name} until "
                    f"{_fmt(until)}"
                )
        try:
            self.kc.json(
                self.coord.replace_namespaced_lease, self.name, self.namespace, self._body(now, _rv(cur))
            )
        except ApiException as e:
            if e.status == 409:
                raise LeaseHeld(f"lease {self.namespace}/{self.name} was just taken by another run") from None
            raise
        self.held = True

    def renew(self, now: datetime | None = None) -> None:
        """Extend the lease; LeaseHeld if someone else took it (the run must stop)."""
        now = now or datetime.now(UTC)
        cur = self.kc.json(self.coord.read_namespaced_lease, self.name, self.namespace)
        spec = cur.get("spec") or {}
        if spec.get("holderIdentity") != self.holder:
            self.held = False
            raise LeaseHeld(f"lease {self.namespace}/{self.name} is no longer ours")
        acquired = _parse(spec.get("acquireTime"))
        body = self._body(now, _rv(cur), _fmt(acquired) if acquired else None)
        try:
            self.kc.json(self.coord.replace_namespaced_lease, self.name, self.namespace, body)
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
            cur = self.kc.json(self.coord.read_namespaced_lease, self.name, self.namespace)
            spec = cur.get("spec") or {}
            if spec.get("holderIdentity") != self.holder:
                return
            spec["holderIdentity"] = None
            spec["leaseDurationSeconds"] = 1
            cur["spec"] = spec
            self.kc.json(self.coord.replace_namespaced_lease, self.name, self.namespace, cur)
        except ApiException as e:
            log.warning("could not release lease %s/%s: %s %s", self.namespace, self.name, e.status, e.reason)
