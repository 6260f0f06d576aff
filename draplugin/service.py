"""The DRA service the kubelet calls: NodePrepareResources / NodeUnprepareResources (v1 and
v1beta1, the same messages) and the devices' health stream (v1alpha1.DRAResourceHealth).

Each claim of a request is handled on its own: an API error, a claim UID that does not match, a
claim not allocated or allocated against rules (claims.plan) fails that claim only, with its
error in the answer; the kubelet retries it. Prepare and unprepare hold one lock: the online /
offline exclusion compares a claim with every claim prepared on the node, read from the CDI
directory (the plugin's only state), so two prepares never decide on the same view at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from kubernetes import client

from deviceplugin.health import DeviceState
from draplugin import cdi, claims
from draplugin.api import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
)
from draplugin.slices import device_name
from gpupack import handoff, kubeclient

log = logging.getLogger("gpupack.draplugin.service")
API_TIMEOUT_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 60


class ClassConflict(claims.ClaimError):
    """The claim's GPU holds a prepared claim of the other class (online / offline)."""


@dataclass
class Driver:
    node: str
    cdi_dir: str
    state: DeviceState
    kube: kubeclient.KubeClient | None
    enforcement: str = handoff.ENFORCE_BOTH
    offline_classes: frozenset[str] = claims.DEFAULT_OFFLINE_CLASSES
    # called after a claim was prepared or unprepared (the slice's `holds` attributes follow)
    on_change: Callable[[], None] | None = None
    # called once per claim handled: (prepare|unprepare, outcome, seconds) (draplugin.metrics)
    observe: Callable[[str, str, float], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gpus(self) -> dict[str, Any]:
        return {device_name(g.index): g for g in self.state.gpus()}

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if self.kube is None:
            raise kubeclient.ApiException(status=503, reason="no API client")
        api = client.ResourceV1Api(self.kube.api)
        return self.kube.json(api.read_namespaced_resource_claim, name, namespace)

    def prepare_one(self, namespace: str, name: str, uid: str) -> cdi.PreparedClaim:
        """Prepare one claim (ClaimError, or BadUID, with the reason)."""
        what = f"ResourceClaim {namespace[:63]}/{name[:253]}"
        uid = cdi.check_uid(uid)  # before anything else: it names the file
        try:
            obj = self.read_claim(namespace, name)
        except kubeclient.ApiException as e:
            raise claims.ClaimError(f"get {what}: {kubeclient.api_reason(e)}"[:1000]) from e
        planned = claims.plan(
            obj,
            uid=uid,
            node=self.node,
            gpus=self.gpus(),
            enforcement=self.enforcement,
            offline_classes=self.offline_classes,
        )
        with self._lock:
            others, bad = cdi.prepared(self.cdi_dir)
            for b in bad:
                log.warning("CDI spec not readable, ignored: %s", b)
            why = claims.conflict(planned, others)
            if why:
                raise ClassConflict(f"{what}: {why}")
            cdi.write(self.cdi_dir, planned)
        if self.on_change:
            self.on_change()
        return planned

    def observed(self, op: str, outcome: str, since: float) -> None:
        if self.observe is not None:
            self.observe(op, outcome, time.monotonic() - since)

    def unprepare_one(self, uid: str) -> bool:
        with self._lock:
            was = cdi.remove(self.cdi_dir, uid)
        if was and self.on_change:
            self.on_change()
        return was


def servicer(pb2: Any, pb2_grpc: Any, version: str, driver: Driver) -> Any:
    has_share_id = "share_id" in pb2.Device.DESCRIPTOR.fields_by_name

    class DRA(pb2_grpc.DRAPluginServicer):  # type: ignore[misc]
        def NodePrepareResources(self, request: Any, context: Any) -> Any:
            resp = pb2.NodePrepareResourcesResponse()
            for c in request.claims:
                out = resp.claims[c.uid]
                t0 = time.monotonic()
                try:
                    prepared = driver.prepare_one(c.namespace, c.name, c.uid)
                except (claims.ClaimError, cdi.BadUID, OSError) as e:
                    out.error = str(e)[:2000]
                    log.warning("%s prepare %s/%s (%s): %s", version, c.namespace, c.name, c.uid, out.error)
                    outcome = (
                        "conflict"
                        if isinstance(e, ClassConflict)
                        else "failed"
                        if isinstance(e, OSError)
                        else "refused"
                    )
                    driver.observed("prepare", outcome, t0)
                    continue
                except Exception as e:  # one claim's surprise must not fail the others
                    out.error = f"internal error: {type(e).__name__}: {e}"[:2000]
                    log.exception("%s prepare %s/%s (%s)", version, c.namespace, c.name, c.uid)
                    driver.observed("prepare", "failed", t0)
                    continue
                driver.observed("prepare", "prepared", t0)
                ids = prepared.cdi_ids()
                for d, cdi_id in zip(prepared.devices, ids, strict=True):
                    dev = out.devices.add(
                        request_names=[d.request],
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=[cdi_id],
                    )
                    if d.share_id and has_share_id:  # v1beta1's Device has no share_id
                        dev.share_id = d.share_id
                log.info("%s prepared %s/%s (%s): %s", version, c.namespace, c.name, c.uid, ids)
            return resp

        def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
            resp = pb2.NodeUnprepareResourcesResponse()
            for c in request.claims:
                out = resp.claims[c.uid]
                t0 = time.monotonic()
                try:
                    was = driver.unprepare_one(c.uid)
                except cdi.BadUID:
                    was = False  # no file can have that name: nothing to undo
                except OSError as e:
                    out.error = f"remove the CDI spec of claim {c.uid[:40]}: {e}"[:2000]
                    driver.observed("unprepare", "failed", t0)
                    continue
                driver.observed("unprepare", "unprepared" if was else "not_prepared", t0)
                log.info(
                    "%s unprepared %s/%s (%s)%s",
                    version,
                    c.namespace,
                    c.name,
                    c.uid,
                    "" if was else " (not prepared)",
                )
            return resp

    return DRA()


class Health(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    """Every GPU's health, sent again whenever one changes (DeviceState's version)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def _message(self) -> Any:
        pb = dra_health_v1alpha1_pb2
        now = int(time.time())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=self.driver.node, device_name=device_name(g.index)),
                    health=pb.HEALTHY if g.healthy else pb.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_CHECK_TIMEOUT_S,
                )
                for g in self.driver.state.gpus()
            ]
        )

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        seen = self.driver.state.version
        yield self._message()
        last = time.monotonic()
        while context.is_active():
            v = self.driver.state.wait_change(seen, 1.0)
            # also within the kubelet's timeout when nothing changes: a stream gone quiet is stale
            if v != seen or time.monotonic() - last > HEALTH_CHECK_TIMEOUT_S / 2:
                seen, last = v, time.monotonic()
                yield self._message()


def add_services(server: grpc.Server, driver: Driver) -> None:
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(
        servicer(dra_v1_pb2, dra_v1_pb2_grpc, "v1", driver), server
    )
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
        servicer(dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, "v1beta1", driver), server
    )
    dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(Health(driver), server)
