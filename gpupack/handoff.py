"""Pure helpers for the bind -> Allocate handoff, shared by the extender and the device plugin.

The design (one pending handoff per node; the pod itself is the "lock") is described in the
project docs. Everything here is pure: no I/O, no clock unless passed in. Pods may be given as
API JSON dicts (camelCase keys, as a watch or `kubectl get -o json` returns them) or as objects of
the official `kubernetes` client (snake_case attributes); :func:`pod_view` normalises both.

Who uses what:
- extender at bind: :func:`blocking_handoff` (is node N blocked by a pending handoff?),
  :func:`binding_annotations`.
- device plugin at Allocate: :func:`pending_pods_on_node`, :func:`plan_allocate`,
  :func:`container_env`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpupack import contract
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    HANDOFF_DONE,
    HANDOFF_FAILED,
    HANDOFF_PENDING,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    Assignment,
    ContractError,
    GPUShare,
)

TERMINAL_PHASES = ("Succeeded", "Failed")

# Enforcement modes: which env a shared container is handed.
ENFORCE_HAMI = "hami-core"
ENFORCE_MPS = "mps"
ENFORCE_BOTH = "both"
ENFORCEMENT_MODES = (ENFORCE_HAMI, ENFORCE_MPS, ENFORCE_BOTH)


# --- normalised pod view ----------------------------------------------------------------------
@dataclass(frozen=True)
class ContainerView:
    name: str
    init: bool
    limits: Mapping[str, Any]
    requests: Mapping[str, Any]

    def gpu_count(self) -> int:
        """GPUs the kubelet will ask the device plugin for (the `gpupack.io/gpu` count).

        Only an explicit `gpupack.io/gpu` makes the kubelet call Allocate for this container: it
        calls the plugin only for resources the plugin registered. Raises ContractError on junk.
        """
        raw = self.limits.get(RES_GPU, self.requests.get(RES_GPU))
        if raw is None:
            return 0
        return contract.parse_int_quantity(raw, f"container {self.name!r} {RES_GPU}")

    def wants_gpupack(self) -> bool:
        keys = set(self.limits) | set(self.requests)
        return any(r in keys for r in (RES_GPU, RES_GPU_MEM, RES_GPU_SM))


@dataclass(frozen=True)
class PodView:
    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str
    deleting: bool
    annotations: Mapping[str, str]
    containers: tuple[ContainerView, ...] = field(default=())  # init containers first, spec order
    resource_version: str = ""
    scheduler_name: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def live(self) -> bool:
        """Still able to be admitted by a kubelet: not terminal and not being deleted."""
        return not self.deleting and self.phase not in TERMINAL_PHASES

    @property
    def handoff(self) -> str:
        return self.annotations.get(ANN_HANDOFF, "")

    def assignment(self) -> Assignment:
        """The decoded assignment; ContractError (naming the pod) when missing or corrupt."""
        raw = self.annotations.get(ANN_ASSIGNMENT)
        if raw is None:
            raise ContractError(f"pod {self.key}: no {ANN_ASSIGNMENT} annotation")
        return contract.decode_assignment(raw, pod=self.key)

    def allocated(self) -> list[str]:
        return self.allocation_record().served

    def allocation_record(self) -> contract.AllocationRecord:
        """The decoded `gpupack.io/allocated` record (empty when absent); ContractError when corrupt."""
        raw = self.annotations.get(ANN_ALLOCATED)
        if raw in (None, ""):
            return contract.AllocationRecord([], None, {})
        return contract.decode_allocation_record(raw, pod=self.key)


def _get(obj: Any, camel: str, snake: str | None = None, default: Any = None) -> Any:
    if obj is None:
        return default
    v = obj.get(camel, default) if isinstance(obj, Mapping) else getattr(obj, snake or camel, default)
    return default if v is None else v


def _containers(spec: Any) -> tuple[ContainerView, ...]:
    out: list[ContainerView] = []
    for key, snake, init in (
        ("initContainers", "init_containers", True),
        ("containers", "containers", False),
    ):
        for c in _get(spec, key, snake, []) or []:
            res = _get(c, "resources", default={})
            out.append(
                ContainerView(
                    name=str(_get(c, "name", default="")),
                    init=init,
                    limits=dict(_get(res, "limits", default={}) or {}),
                    requests=dict(_get(res, "requests", default={}) or {}),
                )
            )
    return tuple(out)


def pod_view(pod: Any) -> PodView:
    """Normalise an API dict or a kubernetes-client V1Pod into a PodView."""
    if isinstance(pod, PodView):
        return pod
    meta = _get(pod, "metadata", default={})
    spec = _get(pod, "spec", default={})
    status = _get(pod, "status", default={})
    return PodView(
        namespace=str(_get(meta, "namespace", default="")),
        name=str(_get(meta, "name", default="")),
        uid=str(_get(meta, "uid", default="")),
        node_name=str(_get(spec, "nodeName", "node_name", "")),
        phase=str(_get(status, "phase", default="")),
        deleting=_get(meta, "deletionTimestamp", "deletion_timestamp") is not None,
        annotations=dict(_get(meta, "annotations", default={}) or {}),
        containers=_containers(spec),
        resource_version=str(_get(meta, "resourceVersion", "resource_version", "")),
        scheduler_name=str(_get(spec, "schedulerName", "scheduler_name", "")),
    )


# --- the per-node predicate -------------------------------------------------------------------
def is_pending_handoff(pod: Any) -> bool:
    """A pod whose GPUs the device plugin has not yet handed out completely, and that a kubelet may
    still be admitting. A bound pod being deleted stays pending until it is gone or terminal: its
    kubelet may be in the middle of admitting it (the real device manager goes on calling Allocate
    for its containers), and serving the next pod's assignment there would hand out the wrong GPU."""
    p = pod_view(pod)
    if p.phase in TERMINAL_PHASES or p.handoff != HANDOFF_PENDING:
        return False
    return not p.deleting or bool(p.node_name)


def pending_pods_on_node(pods: Iterable[Any], node: str) -> list[PodView]:
    """Live pods bound to `node` with handoff=pending, oldest bind first (by assignment bound_at)."""
    out = [p for p in map(pod_view, pods) if p.node_name == node and is_pending_handoff(p)]
    out.sort(key=lambda p: (_bound_at_text(p), p.key))
    return out


def blocking_handoff(pods: Iterable[Any], node: str, exclude_uid: str = "") -> PodView | None:
    """The pod whose pending handoff blocks another bind to `node`, or None when the node is free.

    The extender calls this under its per-node bind mutex with its cluster view. `exclude_uid`
    is the pod being bound (a retried bind of the same pod must not block itself).
    """
    for p in pending_pods_on_node(pods, node):
        if p.uid != exclude_uid:
            return p
    return None


def _bound_at_text(p: PodView) -> str:
    try:
        return p.assignment().bound_at
    except ContractError:
        return ""


def parse_rfc3339(text: str) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def handoff_age_s(pod: Any, now: datetime) -> float | None:
    """Seconds since the pod's assignment was written (its bound_at), None when unknown."""
    t = parse_rfc3339(_bound_at_text(pod_view(pod)))
    return None if t is None else (now - t).total_seconds()


def blocking_message(node: str, blocker: PodView) -> str:
    since = _bound_at_text(blocker) or "an unknown time"
    return (
        f"node {node}: waiting for the kubelet to admit pod {blocker.key} (GPU handoff pending since {since})"
    )


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def handoff_annotations_for_bind(assignment: Assignment) -> dict[str, str | None]:
    """The same annotations as :func:`binding_annotations`, as a merge patch that also drops an earlier
    allocation record (for tools and tests that write an assignment onto a pod themselves)."""
    return {**binding_annotations(assignment), ANN_ALLOCATED: None}


def binding_annotations(assignment: Assignment) -> dict[str, str]:
    """metadata.annotations of the extender's Binding: the API server copies them onto the pod in
    the write that binds it, so a bound pod carries its assignment from its first moment on a node.
    (A Binding can set annotations, not remove them: a pod to bind must carry no earlier allocation
    record; see :func:`rollback_annotations`.)"""
    return {ANN_ASSIGNMENT: assignment.to_json(), ANN_HANDOFF: HANDOFF_PENDING}


def failed_annotations() -> dict[str, str]:
    """Patch the device plugin writes when Allocate cannot serve the pending pod: the kubelet
    rejects that pod, so its assignment must stop blocking binds to the node."""
    return {ANN_HANDOFF: HANDOFF_FAILED}


def rollback_annotations() -> dict[str, str | None]:
    """metadata.annotations patch that undoes :func:`handoff_annotations_for_bind`."""
    return {ANN_ASSIGNMENT: None, ANN_HANDOFF: None, ANN_ALLOCATED: None}


# --- which container is next --------------------------------------------------------------------
def gpu_containers(pod: Any) -> list[ContainerView]:
    """Containers the kubelet calls Allocate for, in its order: init containers, then containers."""
    return [c for c in pod_view(pod).containers if c.gpu_count() > 0]


def next_container(pod: Any) -> ContainerView | None:
    """The next GPU container (kubelet order) not yet recorded in `gpupack.io/allocated`."""
    p = pod_view(pod)
    done = set(p.allocated())
    for c in gpu_containers(p):
        if c.name not in done:
            return c
    return None


# --- env handed to a container ------------------------------------------------------------------
def container_env(
    shares: tuple[GPUShare, ...] | list[GPUShare], enforcement: str = ENFORCE_BOTH
) -> dict[str, str]:
    """Environment for a container's GPU shares. GPU i = position in NVIDIA_VISIBLE_DEVICES."""
    if enforcement not in ENFORCEMENT_MODES:
        raise ValueError(f"enforcement must be one of {', '.join(ENFORCEMENT_MODES)}, got {enforcement!r}")
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(s.uuid for s in shares),
        "GPUPACK_ASSIGNMENT": json.dumps(
            [
                {"uuid": s.uuid, "mem_mib": s.mem_mib, "sm_pct": s.sm_pct, "exclusive": s.exclusive}
                for s in shares
            ],
            separators=(",", ":"),
        ),
    }
    if all(s.exclusive for s in shares):
        return env
    sm = min(s.sm_pct for s in shares)
    if enforcement in (ENFORCE_HAMI, ENFORCE_BOTH):
        for i, s in enumerate(shares):
            env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{s.mem_mib}m"
        env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
    if enforcement in (ENFORCE_MPS, ENFORCE_BOTH):
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={s.mem_mib}M" for i, s in enumerate(shares))
    return env


# --- the Allocate decision ------------------------------------------------------------------------
class HandoffError(Exception):
    """Allocate must fail; the message is for the operator (it reaches `kubectl describe pod`)."""


class NotThisPod(HandoffError):
    """The Allocate does not match the pending pod's next container (device count or IDs): it may
    be for another pod, so the pending pod is left as it is."""


@dataclass(frozen=True)
class AllocatePlan:
    pod: PodView
    container: str
    shares: tuple[GPUShare, ...]
    env: dict[str, str]
    # metadata.annotations patch to apply (with the pod's resourceVersion) before answering
    patch: dict[str, str]
    completes: bool  # true when this was the pod's last GPU container


def no_pending_message(node: str) -> str:
    return (
        f"no pending gpupack assignment for a pod on node {node}: was the pod scheduled by "
        f"{contract.SCHEDULER_NAME} (schedulerName) and bound through the extender?"
    )


def select_pending_pod(pods: Iterable[Any], node: str) -> PodView:
    """The one pod Allocate serves on `node`; HandoffError when there is none or more than one."""
    pending = pending_pods_on_node(pods, node)
    if not pending:
        raise HandoffError(no_pending_message(node))
    if len(pending) > 1:
        names = ", ".join(p.key for p in pending)
        raise HandoffError(
            f"node {node}: {len(pending)} pods have a pending GPU handoff ({names}); refusing to guess "
            "which one the kubelet is admitting. Delete or re-schedule all but one."
        )
    return pending[0]


def plan_allocate(
    pod: Any,
    node: str,
    device_ids: Collection[str],
    gpus: Mapping[str, bool],
    enforcement: str = ENFORCE_BOTH,
    *,
    init_device_ids: Mapping[str, Collection[str]] | None = None,
) -> AllocatePlan:
    """Decide what Allocate answers for the next container of `pod`.

    The container served is the next GPU container in kubelet order not yet recorded in
    `gpupack.io/allocated`: the kubelet calls Allocate once per container and never again for a
    container it has devices for (it checkpoints them), so there is no retry to recognise.
    `device_ids` are the IDs the kubelet passes. Each must be a slot of the container's assigned
    GPUs (GetPreferredAllocation steers the kubelet there) or an ID an earlier init container of
    the pod received: the kubelet hands an init container's devices to the next containers again
    (`devicesToAllocate` reuses them), and still calls Allocate. `init_device_ids` maps an
    allocated init container to the IDs it received, where known; for one not listed (the plugin
    restarted mid-admission) any slot of its assigned GPUs is accepted as reused.

    `gpus` maps every GPU UUID on this node to its health. Raises HandoffError with an
    operator-readable reason when the handoff cannot be served safely.
    """
    p = pod_view(pod)
    try:
        a = p.assignment()
        record = p.allocation_record()
        allocated = record.served
        containers = gpu_containers(p)
    except ContractError as e:
        raise HandoffError(f"pod {p.key}: {e}") from e
    _check_placed_here(p, a, node)
    nxt = _unallocated_container(p, containers, allocated)
    shares = _assigned_shares(p, a, nxt, len(device_ids))
    _check_gpus_served(p, nxt.name, shares, gpus, node)
    _check_device_ids(p, nxt.name, shares, device_ids, _reusable(p, a, allocated, init_device_ids or {}))
    env = container_env(shares, enforcement)
    new_allocated = [*allocated, nxt.name]
    completes = len(new_allocated) >= len(containers)
    served_ids = {**record.ids, nxt.name: frozenset(device_ids)}
    patch = {ANN_ALLOCATED: contract.encode_allocated(new_allocated, a, served_ids)}
    if completes:
        patch[ANN_HANDOFF] = HANDOFF_DONE
    return AllocatePlan(pod=p, container=nxt.name, shares=shares, env=env, patch=patch, completes=completes)


def _check_placed_here(p: PodView, a: Assignment, node: str) -> None:
    """The assignment is this pod's, written by gpupack's scheduler, for this plugin's node."""
    if p.scheduler_name != contract.SCHEDULER_NAME:
        raise HandoffError(
            f"pod {p.key}: schedulerName is {p.scheduler_name!r}, not {contract.SCHEDULER_NAME!r}; "
            "gpupack serves only pods its scheduler placed"
        )
    if a.pod_uid != p.uid:
        raise HandoffError(
            f"pod {p.key}: assignment was written for pod UID {a.pod_uid!r}, this pod is {p.uid!r}"
        )
    if a.node != node:
        raise HandoffError(
            f"pod {p.key}: assignment is for node {a.node!r}, this device plugin serves {node!r}"
        )


def _unallocated_container(
    p: PodView, containers: list[ContainerView], allocated: list[str]
) -> ContainerView:
    """The first GPU container, in kubelet order, that has no devices yet."""
    nxt = next((c for c in containers if c.name not in set(allocated)), None)
    if nxt is None:
        raise HandoffError(f"pod {p.key}: every GPU container is already allocated ({', '.join(allocated)})")
    return nxt


def _assigned_shares(
    p: PodView, a: Assignment, nxt: ContainerView, device_count: int
) -> tuple[GPUShare, ...]:
    """The container's assigned GPUs, as many as it requests and as the kubelet passes IDs."""
    want = nxt.gpu_count()
    if device_count != want:
        raise NotThisPod(
            f"pod {p.key} container {nxt.name}: the kubelet asked for {device_count} {RES_GPU} device(s) "
            f"but the container requests {want}; kubelet and gpupack disagree on container order"
        )
    shares = a.containers.get(nxt.name)
    if not shares:
        raise HandoffError(f"pod {p.key}: assignment has no GPUs for container {nxt.name}")
    if len(shares) != want:
        raise HandoffError(
            f"pod {p.key} container {nxt.name}: assignment lists {len(shares)} GPU(s), container requests {want}"
        )
    return shares


def _check_gpus_served(
    p: PodView, container: str, shares: tuple[GPUShare, ...], gpus: Mapping[str, bool], node: str
) -> None:
    """Every assigned GPU is on this node and healthy."""
    for s in shares:
        if s.uuid not in gpus:
            raise HandoffError(
                f"pod {p.key} container {container}: assigned GPU {s.uuid} is not on node {node}"
            )
        if not gpus[s.uuid]:
            raise HandoffError(f"pod {p.key} container {container}: assigned GPU {s.uuid} is unhealthy")


def device_gpu(device_id: str) -> str:
    """The GPU UUID of a device ID `<uuid>::<slot>` ("" when it is not one of ours)."""
    uuid, sep, slot = device_id.rpartition("::")
    return uuid if sep and slot.isdigit() else ""


def _reusable(
    p: PodView, a: Assignment, allocated: list[str], init_device_ids: Mapping[str, Collection[str]]
) -> tuple[frozenset[str], frozenset[str]]:
    """(exact IDs, GPU UUIDs) the kubelet may pass again from the pod's allocated init containers."""
    ids: set[str] = set()
    gpus: set[str] = set()
    done = set(allocated)
    for c in p.containers:
        if not c.init or c.name not in done:
            continue
        if c.name in init_device_ids:
            ids.update(init_device_ids[c.name])
        else:
            gpus.update(s.uuid for s in a.containers.get(c.name, ()))
    return frozenset(ids), frozenset(gpus)


def _check_device_ids(
    p: PodView,
    container: str,
    shares: tuple[GPUShare, ...],
    device_ids: Collection[str],
    reusable: tuple[frozenset[str], frozenset[str]],
) -> None:
    assigned = {s.uuid for s in shares}
    ids, gpus = reusable
    for d in sorted(device_ids):
        g = device_gpu(d)
        if g in assigned or d in ids or (g and g in gpus):
            continue
        raise NotThisPod(
            f"pod {p.key} container {container}: the kubelet passed device {d}, which is neither a slot "
            f"of its assigned GPU(s) {', '.join(sorted(assigned))} nor a device an earlier init container "
            f"of the pod received; refusing to hand out a GPU for an Allocate that does not match the "
            f"pending pod (another pod asking for {RES_GPU} without {contract.SCHEDULER_NAME}, or every "
            f"slot of the assigned GPU in use?)"
        )
