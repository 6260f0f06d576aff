"""Pod identity at the GPU: the pure decision of the device plugin's PreStartContainer.

`Allocate` names no pod: the plugin hands the kubelet's container the assignment of the one
pending pod on the node, whichever pod the kubelet is admitting. By PreStartContainer the kubelet
has checkpointed which pod and container hold the device IDs, and its PodResources API says so.
A container may start only when that pod's own allocation record (`gpupack.io/allocated`) says
this container was served with exactly these device IDs, for this node and this pod's UID, and its
handoff was not given up (`failed`: the extender released its claim). Anything else is refused,
and the record of the pod whose assignment the wrong pod consumed is repaired, so the rightful
pod is still handed its GPU when the kubelet admits it.

No I/O here: the device plugin (deviceplugin/prestart.py) asks PodResources and the API server.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupack import contract
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_HANDOFF,
    HANDOFF_FAILED,
    HANDOFF_PENDING,
    RES_GPU,
    Assignment,
    ContractError,
)
from gpupack.handoff import PodView, device_gpu, pod_view

# metric label values of gpupack_deviceplugin_prestart_refusals_total{reason}
REASON_PODRESOURCES = "podresources_unavailable"  # the kubelet's PodResources API did not answer
REASON_NO_HOLDER = "no_holder"  # PodResources names no container holding exactly these IDs
REASON_AMBIGUOUS = "ambiguous"  # more than one pod holds them, or no IDs
REASON_NOT_PLACED = "not_placed"  # the holder is no pod gpupack placed on this node
REASON_HANDOFF_FAILED = "handoff_failed"  # the holder's handoff was given up (claim released)
REASON_NOT_RECORDED = "not_recorded"  # the holder's record does not claim these IDs for it
REASON_API = "api_error"  # the pods could not be read or a repair could not be written
REASONS = (
    REASON_PODRESOURCES,
    REASON_NO_HOLDER,
    REASON_AMBIGUOUS,
    REASON_NOT_PLACED,
    REASON_HANDOFF_FAILED,
    REASON_NOT_RECORDED,
    REASON_API,
)


@dataclass(frozen=True)
class Holder:
    """One container's `gpupack.io/gpu` devices as the kubelet's PodResources API lists them."""

    namespace: str
    name: str
    container: str
    device_ids: frozenset[str]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Repair:
    """A merge patch (with the pod's resourceVersion) that takes `containers` out of the allocation
    record of a pod whose assignment another pod consumed, and hands its GPU back."""

    pod: PodView
    containers: tuple[str, ...]
    patch: dict[str, str | None]
    handoff: str  # the handoff the patch sets

    def describe(self) -> str:
        then = (
            "it is handed its GPU when the kubelet admits it"
            if self.handoff == HANDOFF_PENDING
            else "another pod's handoff is pending on the node, so it cannot wait again: delete it "
            "so its controller re-creates it"
        )
        return (
            f"the allocation record of pod {self.pod.key} no longer claims container(s) "
            f"{', '.join(self.containers)} (handoff {self.handoff}: {then})"
        )


@dataclass(frozen=True)
class Decision:
    accept: bool
    reason: str = ""  # one of REASONS when refused
    message: str = ""  # operator-readable: who holds which GPU, why refused, what to do
    holder: str = ""  # namespace/name of the pod the kubelet says holds the IDs
    repairs: tuple[Repair, ...] = field(default=())


def refused(reason: str, message: str, holder: str = "", repairs: Sequence[Repair] = ()) -> Decision:
    return Decision(False, reason, message, holder, tuple(repairs))


def holders_of(answer: Iterable[Holder], device_ids: Collection[str]) -> list[Holder]:
    """The containers holding exactly `device_ids` (the kubelet calls PreStartContainer with the
    whole device set of one container; an init container's set may be held again by the app
    container after it, so one pod can list several)."""
    want = frozenset(device_ids)
    return [h for h in answer if h.device_ids == want]


def _gpus(ids: Collection[str]) -> str:
    return ", ".join(sorted({device_gpu(d) or d for d in ids}))


def decide(answer: Iterable[Holder], pods: Iterable[Any], node: str, device_ids: Collection[str]) -> Decision:
    """Accept the container about to start with `device_ids`, or refuse it (and say which other
    pods' records to repair). `answer` is PodResources' List for `gpupack.io/gpu`; `pods` the pods
    bound to `node` as the API server has them now."""
    ids = frozenset(device_ids)
    if not ids:
        return refused(REASON_AMBIGUOUS, f"PreStartContainer was called without {RES_GPU} device IDs")
    holders = holders_of(answer, ids)
    what = f"{RES_GPU} devices {', '.join(sorted(ids))} (GPU {_gpus(ids)})"
    if not holders:
        return refused(
            REASON_NO_HOLDER,
            f"the kubelet's PodResources API names no container holding exactly {what}; refusing "
            "to start a container whose pod gpupack cannot identify (fail closed). Check that the "
            "device plugin reads the kubelet's pod-resources socket (--pod-resources-socket)",
        )
    keys = sorted({h.key for h in holders})
    if len(keys) > 1:
        return refused(
            REASON_AMBIGUOUS,
            f"the kubelet's PodResources API lists {what} for several pods ({', '.join(keys)}); "
            "refusing to guess which one is starting (fail closed)",
        )
    views = [pod_view(p) for p in pods]
    by_key = {p.key: p for p in views if p.node_name == node}
    key = keys[0]
    containers = sorted(h.container for h in holders)
    who = f"pod {key} container {'/'.join(containers)} holds {what}"
    pod = by_key.get(key)
    if pod is None:
        return _refuse_with_repairs(
            REASON_NOT_PLACED,
            f"{who}, but the API server has no such pod bound to node {node}; gpupack hands GPUs only "
            "to pods its scheduler placed (a static pod or a pod of another scheduler is refused)",
            key, "", views, node, ids,
        )  # fmt: skip
    return _judge(pod, containers, who, views, node, ids)


def _judge(
    pod: PodView,
    containers: list[str],
    who: str,
    views: list[PodView],
    node: str,
    ids: frozenset[str],
) -> Decision:
    def no(reason: str, why: str) -> Decision:
        return _refuse_with_repairs(reason, f"{who}, but {why}", pod.key, pod.uid, views, node, ids)

    try:
        record = pod.allocation_record()
        held = record.held
        if held is None and contract.ANN_ASSIGNMENT in pod.annotations:
            held = pod.assignment()  # a record of the older form: names only
    except ContractError as e:
        return no(REASON_NOT_PLACED, f"its gpupack annotations cannot be read ({e}). {_NOT_PLACED_FIX}")
    if held is None:
        return no(
            REASON_NOT_PLACED,
            f"gpupack never placed this pod (no assignment, no allocation record). {_NOT_PLACED_FIX}",
        )
    if held.pod_uid != pod.uid or held.node != node:
        return no(
            REASON_NOT_PLACED,
            f"its gpupack record is for pod UID {held.pod_uid} on node {held.node}, this pod is UID "
            f"{pod.uid} on node {node}. {_NOT_PLACED_FIX}",
        )
    if pod.handoff == HANDOFF_FAILED:
        return no(
            REASON_HANDOFF_FAILED,
            "its GPU handoff was marked failed (the kubelet admitted it too late, or Allocate failed), "
            "so gpupack released its claim and may have given that GPU to another pod. Delete the pod; "
            "its controller re-creates it and gpupack places it again",
        )
    for c in containers:
        why = _record_mismatch(record, held, c, ids)
        if why:
            return no(
                REASON_NOT_RECORDED,
                f"{why}: the device plugin served these devices for another pod's assignment. Delete "
                "this pod; its controller re-creates it and gpupack places it again",
            )
    return Decision(True, holder=pod.key)


_NOT_PLACED_FIX = (
    f"gpupack hands a GPU only to a pod its scheduler placed (schedulerName {contract.SCHEDULER_NAME}, "
    "bound through its extender, in a namespace its webhook serves); re-create the pod that way, or "
    f"request another resource than {RES_GPU}"
)


def _record_mismatch(
    record: contract.AllocationRecord, held: Assignment, container: str, ids: frozenset[str]
) -> str:
    """Why the record does not claim `ids` for `container` ("" when it does)."""
    if container not in record.served:
        return f"its allocation record does not list container {container} as served"
    got = record.ids.get(container)
    if got is not None:
        if got != ids:
            return (
                f"its allocation record says container {container} was served devices "
                f"{', '.join(sorted(got))}, not these"
            )
        return ""
    # served by a plugin that did not record device IDs yet: the IDs must at least be slots of
    # the container's assigned GPUs
    assigned = {s.uuid for s in held.containers.get(container, ())}
    if not assigned or any(device_gpu(d) not in assigned for d in ids):
        return f"these are not slots of the GPU(s) its record holds for container {container}"
    return ""


def _refuse_with_repairs(
    reason: str,
    message: str,
    holder_key: str,
    holder_uid: str,
    views: list[PodView],
    node: str,
    ids: frozenset[str],
) -> Decision:
    repairs = repairs_for(views, node, ids, holder_key, holder_uid)
    if repairs:
        message += ". Repaired: " + "; ".join(r.describe() for r in repairs)
    return refused(reason, message, holder_key, repairs)


def consumed_repairs(answer: Iterable[Holder], pods: Iterable[Any], node: str) -> list[Repair]:
    """Patches for the live pods on `node` whose records claim device IDs that the kubelet says
    another pod holds. Asked after a failed Allocate: the kubelet rejects the pod it was admitting,
    so the records that pod's earlier containers consumed must be handed back now; PreStartContainer,
    which would have repaired them, is never called for a rejected pod."""
    held_by: dict[str, set[str]] = {}
    for h in answer:
        for d in h.device_ids:
            held_by.setdefault(d, set()).add(h.key)
    return _repairs(
        [pod_view(p) for p in pods], node, "", "",
        lambda p, claimed: any(held_by.get(d, set()) - {p.key} for d in claimed),
    )  # fmt: skip


def repairs_for(
    views: Iterable[PodView], node: str, ids: frozenset[str], holder_key: str, holder_uid: str = ""
) -> list[Repair]:
    """Patches for the live pods on `node`, other than the holder, whose records claim any of
    `ids`: the kubelet gives a device ID to one pod at a time, so such a claim was consumed by the
    holder. Their containers are taken out of the record and their handoff set back to pending,
    unless another pod's handoff is pending on the node (the extender lets one wait per node):
    then it is set failed."""
    return _repairs(views, node, holder_key, holder_uid, lambda p, claimed: bool(claimed & ids))


def _repairs(
    views: Iterable[PodView],
    node: str,
    holder_key: str,
    holder_uid: str,
    taken: Callable[[PodView, frozenset[str]], bool],
) -> list[Repair]:
    """Repairs of the pods on `node` not yet started, but the holder, for each served container
    whose recorded device IDs another pod took (`taken(pod, ids)`)."""
    pods = [p for p in views if p.node_name == node]
    out: list[Repair] = []
    for p in pods:
        if (p.key == holder_key and (not holder_uid or p.uid == holder_uid)) or not _awaiting_start(p):
            continue
        try:
            record = p.allocation_record()
        except ContractError:
            continue
        lost = tuple(c for c in record.served if taken(p, record.ids.get(c, frozenset())))
        if lost and record.held is not None:
            out.append(_repair(p, record, lost, pods, holder_key))
    return out


def _repair(
    p: PodView, record: contract.AllocationRecord, lost: tuple[str, ...], pods: list[PodView], holder_key: str
) -> Repair:
    others_pending = any(
        q.uid != p.uid and q.key != holder_key and q.live and q.handoff == HANDOFF_PENDING for q in pods
    )
    state = HANDOFF_FAILED if others_pending or p.handoff == HANDOFF_FAILED else HANDOFF_PENDING
    return Repair(p, lost, repair_patch(record, lost, state), state)


def _awaiting_start(p: PodView) -> bool:
    """Only a pod the kubelet has not started can have had its assignment consumed by another pod:
    a pod whose assignment another pod took is refused at its own admission (its Allocate finds no
    pending handoff), so it never runs. A Running pod's record is its own, even where a device ID
    it claims was handed out again (its kubelet already let go of it)."""
    return p.live and p.phase in ("", "Pending")


def repair_patch(
    record: contract.AllocationRecord, lost: Collection[str], handoff: str = HANDOFF_PENDING
) -> dict[str, str | None]:
    """metadata.annotations merge patch: the record without `lost`, and the handoff `handoff`."""
    assert record.held is not None
    served = [c for c in record.served if c not in set(lost)]
    patch: dict[str, str | None] = {ANN_HANDOFF: handoff}
    if served:
        ids = {c: v for c, v in record.ids.items() if c in served}
        patch[ANN_ALLOCATED] = contract.encode_allocated(served, record.held, ids)
    else:
        patch[ANN_ALLOCATED] = None
    return patch
