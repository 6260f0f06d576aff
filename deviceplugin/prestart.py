"""PreStartContainer: start a container only if it is the pod gpupack assigned those GPUs to.

The kubelet calls PreStartContainer (the plugin registers with `pre_start_required`) before every
start of a container holding `gpupack.io/gpu` devices: after Allocate, after it has checkpointed
which pod and container hold the device IDs, also on a container restart and after a kubelet
restart. An error stops the container from being created. The plugin asks the kubelet's
PodResources API which pod holds the IDs, reads that pod from the API server and lets
:func:`gpupack.identity.decide` judge; when it refuses, the records of pods whose assignment the
wrong pod consumed are repaired (resourceVersion-conditional; a conflict re-reads everything).
Fail closed: no answer from PodResources or the API server refuses the start.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc
from kubernetes.client.rest import ApiException

from deviceplugin.api import podresources_pb2, podresources_pb2_grpc
from deviceplugin.kube import Kube
from deviceplugin.metrics import Metrics
from gpupack import handoff, identity
from gpupack.contract import HANDOFF_PENDING, RES_GPU

log = logging.getLogger("gpupack.deviceplugin.prestart")

CONFLICT_RETRIES = 5
# The kubelet gives PreStartContainer its own deadline (30 s in v1.28); stay well inside it.
TIMEOUT_S = 5.0


class PreStartRefused(Exception):
    """The container must not start; the message is for the operator (it reaches the pod's events)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PodResourcesUnavailable(Exception):
    pass


class PodResourcesClient:
    """The kubelet's PodResources v1 `List`, reduced to the `gpupack.io/gpu` devices per container."""

    def __init__(self, socket_path: str, timeout_s: float = TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def _stub(self) -> podresources_pb2_grpc.PodResourcesListerStub:
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(f"unix:{self.socket_path}")
            return podresources_pb2_grpc.PodResourcesListerStub(self._channel)

    def gpu_holders(self) -> list[identity.Holder]:
        if not os.path.exists(self.socket_path):
            raise PodResourcesUnavailable(
                f"the kubelet's pod-resources socket {self.socket_path} does not exist (mount the host's "
                "/var/lib/kubelet/pod-resources into the device plugin; --pod-resources-socket)"
            )
        try:
            resp = self._stub().List(
                podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise PodResourcesUnavailable(
                f"the kubelet's PodResources API on {self.socket_path} did not answer List: "
                f"{e.code().name}: {e.details()}"
            ) from e
        out = []
        for pod in resp.pod_resources:
            for c in pod.containers:
                ids = [d for dev in c.devices if dev.resource_name == RES_GPU for d in dev.device_ids]
                if ids:
                    out.append(identity.Holder(pod.namespace, pod.name, c.name, frozenset(ids)))
        return out

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


class PreStart:
    def __init__(
        self, kube: Kube, node: str, podresources: PodResourcesClient, metrics: Metrics | None = None
    ) -> None:
        self.kube = kube
        self.node = node
        self.podresources = podresources
        self.metrics = metrics

    def check(self, device_ids: list[str]) -> None:
        """Return when the container may start; PreStartRefused (operator-readable) when not."""
        try:
            decision = self._check(frozenset(device_ids))
        except PreStartRefused as e:
            self._refused(e.reason, str(e), device_ids)
            raise
        if not decision.accept:
            self._refused(decision.reason, decision.message, device_ids)
            raise PreStartRefused(decision.reason, decision.message)
        log.info(
            "PreStartContainer: pod %s may start with %s",
            decision.holder,
            ",".join(sorted(device_ids)),
            extra={"node": self.node, "pod": decision.holder},
        )

    def repair_consumed(self) -> None:
        """After a failed Allocate (the kubelet rejects the pod it was admitting, and never calls
        PreStartContainer for it): hand back the assignments that pod's earlier containers consumed,
        i.e. records claiming device IDs the kubelet says another pod holds. Best effort."""
        try:
            holders = self.podresources.gpu_holders()
            pods = self.kube.pods_on_node(self.node)
        except (PodResourcesUnavailable, ApiException, OSError) as e:
            log.warning("cannot check for consumed assignments after a failed Allocate: %s", e)
            return
        repairs = identity.consumed_repairs(holders, pods, self.node)
        if repairs:
            self._repair(
                identity.refused(identity.REASON_NOT_RECORDED, "", "a pod the kubelet rejected", repairs), 0
            )

    def _refused(self, reason: str, message: str, device_ids: list[str]) -> None:
        if self.metrics:
            self.metrics.prestart_refusals.labels(node=self.node, reason=reason).inc()
        log.error(
            "PreStartContainer(%s) refused: %s",
            ",".join(sorted(device_ids)),
            message,
            extra={"node": self.node},
        )

    def _check(self, ids: frozenset[str]) -> identity.Decision:
        for attempt in range(CONFLICT_RETRIES):
            try:
                holders = self.podresources.gpu_holders()
            except PodResourcesUnavailable as e:
                raise PreStartRefused(
                    identity.REASON_PODRESOURCES,
                    f"{e}; refusing to start a container whose pod gpupack cannot identify (fail closed)",
                ) from e
            try:
                pods = self.kube.pods_on_node(self.node)
            except (ApiException, OSError) as e:
                raise PreStartRefused(
                    identity.REASON_API,
                    f"cannot list pods on node {self.node} from the Kubernetes API: {e}; refusing to "
                    "start the container (fail closed); the kubelet retries",
                ) from e
            decision = identity.decide(holders, pods, self.node, ids)
            if decision.accept or self._repair(decision, attempt):
                return decision
        raise PreStartRefused(
            identity.REASON_API,
            f"node {self.node}: the pods kept changing during PreStartContainer; try again",
        )

    def _repair(self, decision: identity.Decision, attempt: int) -> bool:
        """Apply the decision's repairs; False when one conflicted (re-read and decide again)."""
        for r in decision.repairs:
            try:
                patched = self.kube.patch_pod_annotations(
                    r.pod.namespace, r.pod.name, r.patch, resource_version=r.pod.resource_version
                )
            except ApiException as e:
                if e.status == 409:
                    log.info(
                        "pod %s changed while repairing (attempt %d); re-reading", r.pod.key, attempt + 1
                    )
                    return False
                if e.status == 404:
                    continue  # gone: nothing left to hand back
                log.warning(
                    "cannot repair the allocation record of pod %s: %s %s", r.pod.key, e.status, e.reason
                )
                continue
            except OSError as e:
                log.warning("cannot repair the allocation record of pod %s: %s", r.pod.key, e)
                continue
            log.warning(
                "repaired pod %s: container(s) %s handed back (handoff %s): %s had taken its GPU",
                r.pod.key,
                ",".join(r.containers),
                r.handoff,
                f"pod {decision.holder}" if "/" in decision.holder else decision.holder,
                extra={"node": self.node, "pod": r.pod.key},
            )
            if r.handoff == HANDOFF_PENDING:
                self._one_pending(r.pod.key, patched)
        return True

    def _one_pending(self, key: str, patched: dict) -> None:
        """The extender may have bound another pod to the node between our read and the repair
        (the pod was `done` then): the node must not have two pending handoffs (Allocate refuses to
        guess between them), so the repaired pod gives way (handoff failed; it is re-created)."""
        try:
            pending = handoff.pending_pods_on_node(self.kube.pods_on_node(self.node), self.node)
        except (ApiException, OSError) as e:
            log.warning("cannot check the node's pending handoffs after repairing pod %s: %s", key, e)
            return
        if len(pending) < 2 or key not in {p.key for p in pending}:
            return
        try:
            self.kube.fail_handoff(handoff.pod_view(patched))
        except (ApiException, OSError) as e:
            log.warning("cannot set the handoff of pod %s failed: %s", key, e)
            return
        log.warning(
            "pod %s: another pod's handoff became pending on the node meanwhile; handoff set failed "
            "(delete the pod so its controller re-creates it)",
            key,
            extra={"node": self.node, "pod": key},
        )
