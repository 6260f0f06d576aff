"""Allocate: hand a container the GPU(s) the scheduler assigned to it (the bind -> Allocate handoff).

The kubelet says only which device IDs it picked. The pod is found as the one pod on this node
whose handoff is pending (the extender lets at most one exist per node); the container is the
next GPU container of that pod in kubelet order not yet in `gpupack.io/allocated`. The kubelet
calls Allocate exactly once per container (it checkpoints what it got and never asks again), also
for an app container that receives a preceding init container's device IDs again, so there is no
"retry" to recognise by device IDs. The IDs are checked against the assignment
(:func:`gpupack.handoff.plan_allocate`), and the pod is annotated before the answer is returned, so
what the container gets is always what the pod's annotations say.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kubernetes.client.rest import ApiException

from deviceplugin.health import DeviceState
from deviceplugin.kube import Kube, webhook_refusal
from deviceplugin.metrics import Metrics
from gpupack import handoff
from gpupack.contract import ContractError
from gpupack.handoff import HandoffError

log = logging.getLogger("gpupack.deviceplugin.allocate")

CONFLICT_RETRIES = 5
# On Kubernetes 1.28-1.29 the API server refuses the plugin's writes while gpupack's plugin-node
# webhook is down or stalled (failurePolicy Fail: it is the only check that the plugin writes its
# own node's pods). Allocate tries again for this long (a scheduler pod restarting) before it
# fails the container's admission; the kubelet waits on Allocate, admitting nothing else meanwhile.
WEBHOOK_WAIT_S = 8.0
WEBHOOK_RETRY_S = 0.5


class Allocator:
    def __init__(
        self,
        kube: Kube,
        node: str,
        state: DeviceState,
        metrics: Metrics | None = None,
        enforcement: str = handoff.ENFORCE_BOTH,
        webhook_wait_s: float = WEBHOOK_WAIT_S,
        after_failure: Callable[[], None] | None = None,
    ) -> None:
        self.kube = kube
        self.webhook_wait_s = webhook_wait_s
        # called after a failed Allocate: the kubelet rejects the pod it was admitting, and pending
        # assignments its earlier containers consumed are handed back (PreStart.repair_consumed)
        self.after_failure = after_failure
        self.node = node
        self.state = state
        self.metrics = metrics
        self.enforcement = enforcement
        # pod UID -> init container -> device IDs the kubelet gave it: the kubelet may pass them
        # again for the pod's next containers. Lost on restart; plan_allocate then accepts any slot
        # of that init container's GPUs.
        self._init_ids: OrderedDict[str, dict[str, frozenset[str]]] = OrderedDict()
        self._lock = threading.Lock()  # the kubelet is serial; this guards against anything else

    def allocate(self, device_ids: list[str]) -> dict[str, str]:
        """The env for one container; HandoffError (operator-readable) when it must fail."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                env = self._allocate(device_ids)
        except HandoffError as e:
            if self.metrics:
                self.metrics.handoff_failed(_reason(str(e)))
            log.error("Allocate(%d device(s)) failed: %s", len(device_ids), e, extra={"node": self.node})
            if self.after_failure is not None:
                self.after_failure()
            raise
        finally:
            if self.metrics:
                self.metrics.allocate_latency.observe(time.perf_counter() - t0)
        return env

    def _allocate(self, device_ids: list[str]) -> dict[str, str]:
        ids = frozenset(device_ids)
        conflicts = 0
        webhook_deadline: float | None = None
        while conflicts < CONFLICT_RETRIES:
            try:
                pods = self.kube.pods_on_node(self.node)
            except (ApiException, OSError) as e:
                raise HandoffError(
                    f"cannot list pods on node {self.node} from the Kubernetes API: {e}"
                ) from e
            pod = handoff.select_pending_pod(pods, self.node)
            try:
                plan = handoff.plan_allocate(
                    pod,
                    self.node,
                    ids,
                    self.state.health_map(),
                    self.enforcement,
                    init_device_ids=self._init_ids.get(pod.uid, {}),
                )
            except handoff.NotThisPod:
                raise
            except HandoffError:
                self._mark_failed(pod)
                raise
            try:
                self.kube.patch_pod_annotations(
                    plan.pod.namespace, plan.pod.name, plan.patch, resource_version=plan.pod.resource_version
                )
            except ApiException as e:
                if e.status == 409:
                    conflicts += 1
                    log.info(
                        "pod %s changed while allocating (attempt %d); re-reading", plan.pod.key, conflicts
                    )
                    continue
                hook = webhook_refusal(e)
                if hook:
                    now = time.monotonic()
                    webhook_deadline = webhook_deadline or now + self.webhook_wait_s
                    if now < webhook_deadline:
                        log.warning(
                            "cannot record the allocation on pod %s yet: the API server cannot call admission"
                            " webhook %s (gpupack-scheduler's webhook port down or stalled); retrying",
                            plan.pod.key, hook, extra={"node": self.node, "pod": plan.pod.key},
                        )  # fmt: skip
                        time.sleep(WEBHOOK_RETRY_S)
                        continue
                    raise HandoffError(
                        f"cannot record the allocation on pod {plan.pod.key}: the API server refuses the device"
                        f" plugin's writes while admission webhook {hook} is unavailable (tried for"
                        f" {self.webhook_wait_s:g} s); bring gpupack-scheduler's webhook back"
                    ) from e
                if e.status == 404:
                    raise HandoffError(f"pod {plan.pod.key} was deleted during Allocate") from e
                raise HandoffError(
                    f"cannot record the allocation on pod {plan.pod.key}: {e.status} {e.reason}"
                ) from e
            except OSError as e:
                raise HandoffError(f"cannot record the allocation on pod {plan.pod.key}: {e}") from e
            if any(c.init and c.name == plan.container for c in plan.pod.containers):
                self._remember_init(plan.pod.uid, plan.container, ids)
            log.info(
                "Allocate: pod %s container %s (devices %s) -> %s%s",
                plan.pod.key,
                plan.container,
                ",".join(sorted(ids)),
                plan.env["NVIDIA_VISIBLE_DEVICES"],
                " (handoff done)" if plan.completes else "",
                extra={
                    "node": self.node,
                    "pod": plan.pod.key,
                    "container": plan.container,
                    "gpu": plan.env["NVIDIA_VISIBLE_DEVICES"],
                },  # fmt: skip
            )
            return plan.env
        raise HandoffError(f"node {self.node}: the pending pod kept changing during Allocate; try again")

    def _mark_failed(self, pod: handoff.PodView) -> None:
        """The kubelet rejects a pod whose Allocate fails (phase Failed); say so on the pod at once,
        so its assignment stops blocking binds to this node. Best effort: the Failed phase that
        follows unblocks the node too."""
        try:
            self.kube.fail_handoff(pod)
        except (ApiException, OSError) as e:
            log.warning(
                "cannot mark the handoff of pod %s failed: %s",
                pod.key,
                e,
                extra={"node": self.node, "pod": pod.key},
            )

    def _remember_init(self, pod_uid: str, container: str, ids: frozenset[str]) -> None:
        self._init_ids.setdefault(pod_uid, {})[container] = ids
        self._init_ids.move_to_end(pod_uid)
        while len(self._init_ids) > 64:
            self._init_ids.popitem(last=False)

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """Prefer slots of the GPUs assigned to the next container, so the kubelet's NUMA view matches."""
        chosen = list(must_include)[:size]
        want: list[str] = []
        try:
            pod = handoff.select_pending_pod(self.kube.pods_on_node(self.node), self.node)
            nxt = handoff.next_container(pod)
            if nxt is not None:
                want = [s.uuid for s in pod.assignment().containers.get(nxt.name, ())]
        except (HandoffError, ContractError, ApiException, OSError):
            want = []
        # one slot on each assigned GPU not yet covered by the IDs the kubelet must include (those
        # reused from an init container), in assignment order, then anything to make up the count
        covered = {handoff.device_gpu(d) for d in chosen}
        for uuid in want:
            if len(chosen) >= size:
                break
            if uuid in covered:
                continue
            covered.add(uuid)
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
        ("neither a slot", "device_mismatch"),
        ("unhealthy", "unhealthy_gpu"),
        ("is not on node", "unknown_gpu"),
        ("admission webhook", "webhook_unavailable"),
        ("Kubernetes API", "api_error"),
        ("cannot record", "api_error"),
        ("deleted", "pod_deleted"),
    ):
        if key in msg:
            return label
    return "invalid_assignment"
