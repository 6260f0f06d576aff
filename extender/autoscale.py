"""The autoscale controller: the real cluster autoscaler, unmodified, grows and shrinks the cluster
as gpupack's fit rules say (`gpupack extender --autoscale`; operator guide, "Running with the
cluster autoscaler").

Each pass (the leader's only) reads Nodes, bound pods, gpupack's unschedulable pods, the node
templates and its own placeholders, all from the API, and then:

- keeps, per node group, as many placeholder pods as `gpupack.core.autoscale.plan_scale_up` says
  nodes of that group are needed (each asks for a whole node of its group, so the autoscaler adds
  exactly that many); nodes of a group that exist but do not take pods yet count as upcoming, so
  their placeholders go once the autoscaler has added them, and the real pods land there when the
  node is Ready and its device plugin has published the inventory;
- marks `cluster-autoscaler.kubernetes.io/scale-down-disabled` on nodes holding a pod with no
  other place (`pinned_nodes`), and unmarks them (only its own marks) once the pods could move.

Nothing is kept between passes: after a restart the placeholders found are the state, and the
counts are recomputed, never added to.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from gpupack.contract import ContractError
from gpupack.core.autoscale import pinned_nodes, plan_scale_up
from gpupack.core.model import PodRequest
from gpupack.core.request import RequestError, parse_pod
from gpupack.kubeclient import KubeClient, api_reason

from .autoscale_groups import (
    ANN_PINNED,
    ANN_SCALE_DOWN_DISABLED,
    LABEL_PLACEHOLDER,
    OWNER_CONFIGMAP,
    placeholder_pod,
    read_templates,
    unschedulable_condition,
)
from .defrag.snapshot import build_snapshot
from .kube import ASSIGNED_PODS

log = logging.getLogger("gpupack.extender.autoscale")
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


@dataclass(frozen=True)
class AutoscaleConfig:
    templates: str  # NAMESPACE/NAME of the ConfigMap whose key `templates` lists the node templates
    namespace: str  # where the placeholders live (gpupack's own)
    group_label: str = "gpupack.io/node-group"
    scheduler_name: str = "gpupack-scheduler"
    interval_s: float = 10.0


@dataclass
class PassResult:
    wanted: dict[str, int] = field(default_factory=dict)  # group -> placeholders wanted
    created: int = 0
    deleted: int = 0
    pinned: dict[str, str] = field(default_factory=dict)
    unplaceable: dict[str, str] = field(default_factory=dict)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready(node: Mapping[str, Any]) -> bool:
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if any(t.get("key") in NOT_READY_TAINTS for t in spec.get("taints") or []):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _unschedulable(pod: Mapping[str, Any]) -> bool:
    """kube-scheduler tried the pod and found no node: the pods the autoscaler acts on too."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


class AutoscaleController:
    def __init__(
        self, kube: KubeClient, config: AutoscaleConfig, leading: Callable[[], str] | None = None
    ) -> None:
        self.kube, self.config = kube, config
        self.leading = leading  # "" when this extender may write (LeaseFence.problem); None: always
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._owner: dict[str, str] | None = None
        self._unplaceable: set[str] = set()  # logged when it changes, not every pass

    # --- the loop -------------------------------------------------------------------------------
    def start(self) -> AutoscaleController:
        self.thread = threading.Thread(target=self.run, name="autoscale", daemon=True)
        self.thread.start()
        return self

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.leading is None or not self.leading():
                    self.run_pass()
            except Exception:
                log.exception("autoscale pass failed")
            self.stop.wait(self.config.interval_s)

    # --- one pass -------------------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        core = self.kube.core
        ns, name = self.config.templates.split("/", 1)
        cm = self.kube.json(core.read_namespaced_config_map, name, ns)
        groups = read_templates(str((cm.get("data") or {}).get("templates") or ""), self.config.group_label)
        nodes = self.kube.list_all(core.list_node)
        bound = self.kube.list_all(core.list_pod_for_all_namespaces, field_selector=ASSIGNED_PODS)
        sel = f"spec.schedulerName={self.config.scheduler_name},spec.nodeName="
        waiting = [p for p in self.kube.list_all(core.list_pod_for_all_namespaces, field_selector=sel)
                   if _unschedulable(p)]  # fmt: skip
        holders = self.kube.list_all(
            core.list_namespaced_pod, self.config.namespace, label_selector=LABEL_PLACEHOLDER
        )

        label = self.config.group_label
        usable = [n for n in nodes if _ready(n)]
        snap = build_snapshot(usable, bound, datetime.now(UTC))
        state = snap.state
        for name in list(state.nodes):
            if not state.nodes[name].gpus:
                del state.nodes[name]  # no inventory (yet): it takes no gpupack pod
        members: dict[str, int] = {}
        upcoming: dict[str, int] = {}
        for n in nodes:
            meta = n.get("metadata") or {}
            g = (meta.get("labels") or {}).get(label)
            if g is None or meta.get("deletionTimestamp"):
                continue
            members[g] = members.get(g, 0) + 1
            if meta.get("name") not in state.nodes:
                upcoming[g] = upcoming.get(g, 0) + 1
        sized = []
        slots: dict[str, int] = {}
        for group, node_slots, max_size in groups:
            slots[group.name] = node_slots
            left = None if max_size is None else max(0, max_size - members.get(group.name, 0))
            sized.append(replace(group, max_new=left))
        pending = self._requests(waiting)
        plan = plan_scale_up(state, pending, sized, upcoming)
        out = PassResult(wanted=dict(plan.nodes), unplaceable=plan.unplaceable)
        self._reconcile(plan.nodes, holders, slots, out)
        out.pinned = pinned_nodes(state)
        self._mark(nodes, state.nodes.keys(), out.pinned)
        news = set(plan.unplaceable) != self._unplaceable
        self._unplaceable = set(plan.unplaceable)
        if out.created or out.deleted or news:
            log.info("autoscale: %d pod(s) waiting, upcoming %s, placeholders wanted %s (+%d -%d), %d fit no group: %s",
                     len(pending), upcoming, plan.nodes, out.created, out.deleted, len(plan.unplaceable),
                     "; ".join(f"{k}: {v}" for k, v in list(plan.unplaceable.items())[:3]))  # fmt: skip
        return out

    def _requests(self, pods: list[dict[str, Any]]) -> list[PodRequest]:
        out = []
        labels: dict[str, dict[str, str]] = {}  # a namespace's label sets its pods' default class
        for p in pods:
            ns = str((p.get("metadata") or {}).get("namespace") or "default")
            if ns not in labels:
                try:
                    meta = self.kube.json(self.kube.core.read_namespace, ns).get("metadata") or {}
                    labels[ns] = dict(meta.get("labels") or {})
                except ApiException as e:
                    log.debug(
                        "autoscale: namespace %s unreadable (%s); its pods count as online", ns, api_reason(e)
                    )
                    labels[ns] = {}
            try:
                r = parse_pod(p, labels[ns])
            except (RequestError, ContractError) as e:
                log.debug("autoscale: skipping a pod: %s", e)
                continue
            if r.needs_gpu:
                out.append(r)
        return out

    # --- placeholders ---------------------------------------------------------------------------
    def _owner_ref(self) -> dict[str, str]:
        if self._owner is None:
            core, ns = self.kube.core, self.config.namespace
            try:
                cm = self.kube.json(core.read_namespaced_config_map, OWNER_CONFIGMAP, ns)
            except ApiException as e:
                if e.status != 404:
                    raise
                body = {"metadata": {"name": OWNER_CONFIGMAP, "namespace": ns},
                        "data": {"about": "owner of gpupack's placeholder pods; deleting it deletes them"}}  # fmt: skip
                cm = self.kube.json(core.create_namespaced_config_map, ns, body)
            self._owner = {"name": OWNER_CONFIGMAP, "uid": str(cm["metadata"]["uid"])}
        return self._owner

    def _reconcile(
        self,
        wanted: Mapping[str, int],
        holders: list[dict[str, Any]],
        slots: Mapping[str, int],
        out: PassResult,
    ) -> None:
        core, ns = self.kube.core, self.config.namespace
        by_group: dict[str, list[dict[str, Any]]] = {}
        for p in holders:
            if not (p.get("metadata") or {}).get("deletionTimestamp"):
                by_group.setdefault(p["metadata"]["labels"][LABEL_PLACEHOLDER], []).append(p)
        for group in sorted(set(wanted) | set(by_group)):
            have = sorted(by_group.get(group, []), key=lambda p: p["metadata"].get("creationTimestamp") or "")
            want = wanted.get(group, 0) if group in slots else 0
            for p in have[want:]:  # the newest go first: the autoscaler may be acting on the oldest
                try:
                    self.kube.json(
                        core.delete_namespaced_pod, p["metadata"]["name"], ns, grace_period_seconds=0
                    )
                    out.deleted += 1
                except ApiException as e:
                    if e.status != 404:
                        log.warning(
                            "autoscale: cannot delete placeholder %s: %s",
                            p["metadata"]["name"],
                            api_reason(e),
                        )
            for p in have[:want]:
                if not _unschedulable(p):  # e.g. created just before a restart
                    self._mark_unschedulable(p["metadata"]["name"])
            for _ in range(want - len(have)):
                body = placeholder_pod(group, slots[group], self.config.group_label, ns, self._owner_ref())
                made = self.kube.json(core.create_namespaced_pod, ns, body)
                self._mark_unschedulable(made["metadata"]["name"])
                out.created += 1

    def _mark_unschedulable(self, name: str) -> None:
        body = {"status": {"conditions": [unschedulable_condition(_now())]}}
        self.kube.json(self.kube.core.patch_namespaced_pod_status, name, self.config.namespace, body)

    # --- scale-down marks -----------------------------------------------------------------------
    def _mark(self, nodes: list[dict[str, Any]], judged: Any, pinned: Mapping[str, str]) -> None:
        judged = set(judged)
        for n in nodes:
            meta = n.get("metadata") or {}
            name, ann = str(meta.get("name")), meta.get("annotations") or {}
            if name in pinned and name in judged:
                if ann.get(ANN_SCALE_DOWN_DISABLED) == "true":
                    continue  # marked already: by us, or by the operator (not claimed as ours)
                patch: dict[str, Any] = {ANN_SCALE_DOWN_DISABLED: "true", ANN_PINNED: pinned[name][:250]}
            elif ANN_PINNED in ann and name in judged:
                patch = {ANN_SCALE_DOWN_DISABLED: None, ANN_PINNED: None}
            else:
                continue
            try:
                self.kube.merge_patch(self.kube.core.patch_node, name, {"metadata": {"annotations": patch}})
                log.info("autoscale: node %s %s", name, "kept from scale-down: " + pinned[name]
                         if name in pinned else "may be scaled down again")  # fmt: skip
            except ApiException as e:
                log.warning("autoscale: cannot mark node %s: %s", name, api_reason(e))


def add_flags(p: argparse.ArgumentParser) -> None:
    """`gpupack extender`'s flags for this controller (off unless --autoscale-templates is given)."""
    p.add_argument(
        "--autoscale-templates",
        default="",
        help="NAMESPACE/NAME of the ConfigMap whose key `templates` lists the cluster autoscaler's "
        "node-group templates (a kind: List of Nodes); turns on the autoscale controller",
    )
    p.add_argument(
        "--autoscale-group-label",
        default="gpupack.io/node-group",
        help="node label whose value is the node group (on the templates and the group's nodes)",
    )
    p.add_argument(
        "--autoscale-namespace",
        default=os.environ.get("POD_NAMESPACE", "gpupack-system"),
        help="namespace of the placeholder pods (default: $POD_NAMESPACE, else gpupack-system)",
    )
    p.add_argument("--autoscale-interval-s", type=float, default=10.0, help="time between passes")


def start_from_args(
    args: argparse.Namespace, api: client.ApiClient, leading: Callable[[], str] | None
) -> None:
    if not args.autoscale_templates:
        return
    if "/" not in args.autoscale_templates:
        raise ValueError("--autoscale-templates must be NAMESPACE/NAME")
    cfg = AutoscaleConfig(args.autoscale_templates, args.autoscale_namespace, args.autoscale_group_label,
                          args.scheduler_name, args.autoscale_interval_s)  # fmt: skip
    AutoscaleController(KubeClient(api, timeout_s=10.0), cfg, leading).start()
    log.info("autoscale controller on: templates %s, group label %s, placeholders in %s",
             cfg.templates, cfg.group_label, cfg.namespace)  # fmt: skip
