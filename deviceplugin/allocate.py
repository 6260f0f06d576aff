"""Allocate: hand a container the GPU(s) the scheduler assigned to it (the bind -> Allocate handoff).

The kubelet says only how many device IDs it wants. The pod is found as the one pod on this node
whose handoff is pending (the extender lets at most one exist per node); the container is the
next GPU container of that pod in kubelet order. The pod is annotated before the answer is
returned, so what the container gets is always what the pod's annotations say.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kubernetes.client.rest import ApiException

from deviceplugin.health import DeviceState
from deviceplugin.kube import Kube
from deviceplugin.metrics import Metrics
from gpupack import handoff
from gpupack.handoff import HandoffError

log = logging.getLogger("gpupack.deviceplugin.allocate")

CONFLICT_RETRIES = 5


@dataclass(frozen=True)
class Served:
    pod_uid: str
    pod_key: str
    container: str
    device_ids: frozenset[str]
    env: dict[str, str]


class Allocator:
    def __init__(
        self, kube: Kube, node: str, state: DeviceState, metrics: Metrics | None = None,
        enforcement: str = handoff.ENFORCE_BOTH,
    ) -> None:
        self.kube = kube
        self.node = node
        self.state = state
        self.metrics = metrics
        self.enforcement = enforcement
        # Recent answers, to answer a kubelet retry for the same container identically.
        self._served: OrderedDict[tuple[str, str], Served] = OrderedDict()
        self._lock = threading.Lock()  # the kubelet is serial; this guards against anything else

    def allocate(self, device_ids: list[str]) -> dict[str, str]:
        """The env for one container; HandoffError (operator-readable) when it must fail."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                env = self._allocate(device_ids)
        except HandoffError as e:
            if self.metrics:
                self.metrics.handoff_failures.labels(reason=_reason(str(e))).inc()
            log.error("Allocate(%d device(s)) failed: %s", len(device_ids), e)
            raise
        finally:
            if self.metrics:
                self.metrics.allocate_latency.observe(time.perf_counter() - t0)
        return env

    def _allocate(self, device_ids: list[str]) -> dict[str, str]:
        ids = frozenset(device_ids)
        for attempt in range(CONFLICT_RETRIES):
            try:
                pods = self.kube.pods_on_node(self.node)
            except (ApiException, OSError) as e:
                raise HandoffError(f"cannot list pods on node {self.node} from the Kubernetes API: {e}") from e
            retry = self._retried(pods, ids)
            if retry is not None:
                log.info("Allocate retry for %s/%s: same answer", retry.pod_key, retry.container)
                return retry.env
            pod = handoff.select_pending_pod(pods, self.node)
            try:
                plan = handoff.plan_allocate(
                    pod, self.node, len(device_ids), self.state.health_map(), self.enforcement
                )
            except HandoffError:
                self._mark_failed(pod)
                raise
            try:
                self.kube.patch_pod_annotations(
                    plan.pod.namespace, plan.pod.name, plan.patch, resource_version=plan.pod.resource_version
                )
            except ApiException as e:
                if e.status == 409:
                    log.info("pod %s changed while allocating (attempt %d); re-reading", plan.pod.key, attempt + 1)
                    continue
                if e.status == 404:
                    raise HandoffError(f"pod {plan.pod.key} was deleted during Allocate") from e
                raise HandoffError(f"cannot record the allocation on pod {plan.pod.key}: {e.status} {e.reason}") from e
            except OSError as e:
                raise HandoffError(f"cannot record the allocation on pod {plan.pod.key}: {e}") from e
            self._remember(Served(plan.pod.uid, plan.pod.key, plan.container, ids, plan.env))
            log.info(
                "Allocate: pod %s container %s -> %s%s", plan.pod.key, plan.container,
                plan.env["NVIDIA_VISIBLE_DEVICES"], " (handoff done)" if plan.completes else "",
            )
            return plan.env
        raise HandoffError(f"node {self.node}: the pending pod kept changing during Allocate; try again")

    def _mark_failed(self, pod: handoff.PodView) -> None:
        """The kubelet rejects a pod whose Allocate fails (phase Failed); say so on the pod at once,
        so its assignment stops blocking binds to this node. Best effort: the Failed phase that
        follows unblocks the node too."""
        try:
            self.kube.patch_pod_annotations(
                pod.namespace, pod.name, handoff.failed_annotations(),
                resource_version=pod.resource_version,
            )
        except (ApiException, OSError) as e:
            log.warning("cannot mark the handoff of pod %s failed: %s", pod.key, e)

    def _retried(self, pods: list[dict], ids: frozenset[str]) -> Served | None:
        """A kubelet retry: same device IDs as a container already served for a live pod."""
        live = {p.uid: p for p in map(handoff.pod_view, pods) if p.live}
        for s in reversed(self._served.values()):
            p = live.get(s.pod_uid)
            if p is not None and s.device_ids == ids:
                try:
                    if s.container in p.allocated():
                        return s
                except handoff.ContractError:
                    return None
        return None

    def _remember(self, s: Served) -> None:
        self._served[(s.pod_uid, s.container)] = s
        while len(self._served) > 256:
            self._served.popitem(last=False)

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """Prefer slots of the GPUs assigned to the next container, so the kubelet's NUMA view matches."""
        chosen = list(must_include)[:size]
        want: list[str] = []
        try:
            pod = handoff.select_pending_pod(self.kube.pods_on_node(self.node), self.node)
            nxt = handoff.next_container(pod)
            if nxt is not None:
                want = [s.uuid for s in pod.assignment().containers.get(nxt.name, ())]
        except (HandoffError, handoff.ContractError, ApiException, OSError):
            want = []
        # one slot on each assigned GPU, in assignment order, then anything to make up the count
        for uuid in want:
            if len(chosen) >= size:
                break
            slot = next((d for d in available if d.split("::")[0] == uuid and d not in chosen), None)
            if slot is not None:
                chosen.append(slot)
        chosen += [d for d in available if d not in chosen][: max(0, size - len(chosen))]
        return chosen


def _reason(msg: str) -> str:
    """A small, fixed set of metric label values."""
    for key, label in (
        ("no pending gpupack assignment", "no_pending"),
        ("refusing to guess", "ambiguous"),
        ("asked for", "count_mismatch"),
        ("unhealthy", "unhealthy_gpu"),
        ("is not on node", "unknown_gpu"),
        ("Kubernetes API", "api_error"),
        ("cannot record", "api_error"),
        ("deleted", "pod_deleted"),
    ):
        if key in msg:
            return label
    return "invalid_assignment"
