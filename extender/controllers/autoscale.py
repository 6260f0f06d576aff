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
- counts a pod toward a group only if a node of that group would take it: its nodeSelector,
  required node affinity and tolerations against the template's labels and taints, its CPU,
  memory and pod count against the template's allocatable (`gpupack.core.node_rules`), then its
  GPUs. A pod no group can take gets one Event saying why, per group, and no placeholder;
- backs a group off (exponentially, capped) when the autoscaler says it will not add a node for
  one of its placeholders (its `NotTriggerScaleUp` Event on the placeholder) or when a placeholder
  waits past `scale_up_timeout_s` (its node never came): the placeholder goes and none of that
  group is made until the backoff ends; a node of the group made after the failure ends it;
- marks `cluster-autoscaler.kubernetes.io/scale-down-disabled` on nodes holding a pod with no
  other place (`pinned_nodes`), and unmarks them (only its own marks) once the pods could move.

State lives in the API: after a restart the placeholders found are the state, the counts are
recomputed, never added to, and the backoffs are read back from the placeholders' owner ConfigMap
(key `backoff`: bounded by the node groups). In memory: which pods were told they fit no group
(pruned every pass to the unbound pods that exist).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpupack.contract import ContractError
from gpupack.core.autoscale import NodeGroup, pinned_nodes, plan_scale_up
from gpupack.core.model import PodRequest
from gpupack.core.node_rules import PodTerms, node_facts, pod_terms
from gpupack.core.request import RequestError, parse_pod
from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient, api_reason

from ..api.kube import ASSIGNED_PODS
from .autoscale_groups import (
    ANN_PINNED,
    ANN_SCALE_DOWN_DISABLED,
    LABEL_PLACEHOLDER,
    OWNER_CONFIGMAP,
    placeholder_host,
    placeholder_pod,
    read_templates,
    unschedulable_condition,
    with_node_allocatable,
)
from .defrag.snapshot import build_snapshot

log = logging.getLogger("gpupack.extender.autoscale")
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# what the cluster autoscaler writes on a pending pod it found no node group for (also when the
# group is at its maximum or in the autoscaler's own backoff after a failed scale-up)
CA_NO_SCALE_UP = "NotTriggerScaleUp"
REASON_NO_GROUP = "NoNodeGroupFits"
REASON_BACKOFF = "ScaleUpBackoff"
BACKOFF_KEY = "backoff"  # the owner ConfigMap's key holding each group's backoff
MAX_FAILURES = 30  # beyond it the doubling is capped anyway; keeps 2**n small


@dataclass(frozen=True)
class AutoscaleConfig:
    templates: str  # NAMESPACE/NAME of the ConfigMap whose key `templates` lists the node templates
    namespace: str  # where the placeholders live (gpupack's own)
    group_label: str = "gpupack.io/node-group"
    scheduler_name: str = "gpupack-scheduler"
    interval_s: float = 10.0
    backoff_s: float = 60.0  # a group's first backoff; doubled per failure in a row
    backoff_max_s: float = 1800.0
    # a placeholder older than this has had no node: longer than the autoscaler's own
    # --max-node-provision-time (15 min by default), after which it gives up on a node itself
    scale_up_timeout_s: float = 1200.0


@dataclass
class PassResult:
    wanted: dict[str, int] = field(default_factory=dict)  # group -> placeholders wanted
    created: int = 0
    deleted: int = 0
    pinned: dict[str, str] = field(default_factory=dict)
    unplaceable: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # placeholder -> why its scale-up failed
    backing_off: dict[str, float] = field(default_factory=dict)  # group -> seconds left


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.passes = Counter(
            "gpupack_autoscale_passes_total", "Autoscale controller passes completed", registry=r
        )
        self.unplaceable = Gauge(
            "gpupack_autoscale_unplaceable_pods", "Pending gpupack pods no node group can take", registry=r
        )
        self.failures = Counter(
            "gpupack_autoscale_scale_up_failures_total",
            "Placeholders the cluster autoscaler added no node for, by node group",
            ["group"],
            registry=r,
        )
        self.backoff = Gauge(
            "gpupack_autoscale_backoff_seconds",
            "Seconds until a node group gets placeholders again after failed scale-ups",
            ["group"],
            registry=r,
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(ts: Any) -> float | None:
    try:
        return datetime.strptime(str(ts), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


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


def read_backoff(raw: Any) -> dict[str, dict[str, float]]:
    """Each group's backoff record from the owner ConfigMap: failures in a row, `until` (epoch
    seconds), `at` (the last failure), and `cpu` (milli) / `mem` (MiB): when the autoscaler
    refused a placeholder for too little CPU or memory, only placeholders asking that much or more
    are held back (0: the whole group is). Anything unreadable counts as no backoff."""
    try:
        doc = json.loads(str(raw or "{}"))
    except ValueError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for g, rec in doc.items() if isinstance(doc, dict) else ():
        try:
            vals = {k: float(rec[k]) for k in ("failures", "until", "at")}
            vals.update({k: max(0.0, float(rec.get(k, 0))) for k in ("cpu", "mem")})
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if all(math.isfinite(v) for v in vals.values()):
            vals["failures"] = min(max(vals["failures"], 0), MAX_FAILURES)
            out[str(g)] = vals
    return out


def _capped(group: NodeGroup, cap: tuple[int, int] | None) -> NodeGroup:
    """The group as the autoscaler has shown it to be: a node holds less than the CPU (milli) or
    memory (MiB) it refused a placeholder for."""
    if cap is None:
        return group
    f = group.facts
    cpu = f.cpu_milli if not cap[0] else min(f.cpu_milli or cap[0], cap[0] - 1)
    mem = f.mem_bytes if not cap[1] else min(f.mem_bytes or cap[1] << 20, (cap[1] << 20) - 1)
    return replace(group, facts=replace(f, cpu_milli=cpu, mem_bytes=mem))


def backoff_delay(failures: int, base_s: float, cap_s: float) -> float:
    return float(min(cap_s, base_s * 2 ** (min(max(failures, 1), MAX_FAILURES) - 1)))


class AutoscaleController:
    def __init__(
        self,
        kube: KubeClient,
        config: AutoscaleConfig,
        leading: Callable[[], str] | None = None,
        events: EventRecorder | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.config = kube, config
        self.leading = leading  # "" when this extender may write (LeaseFence.problem); None: always
        self.events = events or EventRecorder(kube, socket.gethostname(), "gpupack-extender")
        self.metrics = AutoscaleMetrics(registry)
        self.clock = clock
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._owner: dict[str, str] | None = None
        self._unplaceable: set[str] = set()  # logged when it changes, not every pass
        # uid of a pending pod -> the reason it was told it fits no group (one Event per pod);
        # pruned every pass to the unbound gpupack pods that exist
        self.told: dict[str, str] = {}

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
        unbound = self.kube.list_all(core.list_pod_for_all_namespaces, field_selector=sel)
        waiting = [p for p in unbound if _unschedulable(p)]
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
        newest: dict[str, float] = {}  # group -> its newest node's creation (ends a backoff)
        seen: dict[str, dict[str, Any]] = {}  # group -> a Ready node of it (its allocatable)
        for n in sorted(nodes, key=lambda n: str((n.get("metadata") or {}).get("name"))):
            meta = n.get("metadata") or {}
            g = (meta.get("labels") or {}).get(label)
            if g is None or meta.get("deletionTimestamp"):
                continue
            members[g] = members.get(g, 0) + 1
            newest[g] = max(newest.get(g, 0.0), _epoch(meta.get("creationTimestamp")) or 0.0)
            if _ready(n):
                seen.setdefault(g, n)
            if meta.get("name") not in state.nodes:
                upcoming[g] = upcoming.get(g, 0) + 1
        sized: list[NodeGroup] = []
        slots: dict[str, int] = {}
        for group, node_slots, _ in groups:
            slots[group.name] = node_slots
        out = PassResult()
        owner = self._owner_cm()
        backoff = read_backoff((owner.get("data") or {}).get(BACKOFF_KEY))
        changed = self._failures(holders, backoff, slots, newest, out)
        now = self.clock()
        caps: dict[str, tuple[int, int]] = {}  # group -> the CPU / memory its placeholders stay below
        for g, rec in backoff.items():
            if rec["until"] > now:
                out.backing_off[g] = rec["until"] - now
                if rec["cpu"] or rec["mem"]:
                    caps[g] = (int(rec["cpu"]), int(rec["mem"]))
        for g in slots:
            self.metrics.backoff.labels(g).set(round(out.backing_off.get(g, 0.0), 1))
        if changed:
            self._save_backoff(backoff, set(slots))
        for group, _, max_size in groups:
            left = None if max_size is None else max(0, max_size - members.get(group.name, 0))
            sized.append(_capped(replace(with_node_allocatable(group, seen.get(group.name)), max_new=left),
                                 caps.get(group.name)))  # fmt: skip
        facts = {str((n.get("metadata") or {}).get("name")): node_facts(n) for n in usable}
        facts = {k: v for k, v in facts.items() if k in state.nodes}
        pending, terms, refused = self._requests(waiting)
        plan = plan_scale_up(state, pending, sized, upcoming, terms, facts)
        plan.unplaceable.update(refused)
        out.wanted, out.unplaceable = dict(plan.nodes), plan.unplaceable
        wanted = {g: n for g, n in plan.nodes.items() if g not in out.backing_off or g in caps}
        live = [p for p in holders if (p.get("metadata") or {}).get("name") not in out.failed]
        self._reconcile(wanted, live, slots, plan.host, out, caps)
        note = "".join(f" (group {g}: the autoscaler refused a node for {c}m CPU / {m} MiB; tried again later)"
                       for g, (c, m) in sorted(caps.items()))  # fmt: skip
        self._tell(unbound, waiting, plan.unplaceable, note)
        out.pinned = pinned_nodes(state)
        self._mark(nodes, state.nodes.keys(), out.pinned)
        news = set(plan.unplaceable) != self._unplaceable
        self._unplaceable = set(plan.unplaceable)
        self.metrics.unplaceable.set(len(plan.unplaceable))
        if out.created or out.deleted or news or changed:
            log.info("autoscale: %d pod(s) waiting, upcoming %s, placeholders wanted %s (+%d -%d), backing off %s, %d fit no group: %s",
                     len(pending), upcoming, wanted, out.created, out.deleted, sorted(out.backing_off),
                     len(plan.unplaceable), "; ".join(f"{k}: {v}" for k, v in list(plan.unplaceable.items())[:3]))  # fmt: skip
        self.metrics.passes.inc()
        return out

    def _requests(
        self, pods: list[dict[str, Any]]
    ) -> tuple[list[PodRequest], dict[str, PodTerms], dict[str, str]]:
        """The pending pods' GPU requests and node terms; pods whose spec cannot be read go to the
        third map (pod key -> why), to be told so and placed nowhere."""
        out, terms, refused = [], {}, {}
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
                key = f"{ns}/{(p.get('metadata') or {}).get('name')}"
                refused[key] = f"cannot place: {e}"[:500]
                continue
            if r.needs_gpu:
                out.append(r)
                terms[r.key] = pod_terms(p.get("spec"))
        return out, terms, refused

    # --- what the pods are told -----------------------------------------------------------------
    def _tell(
        self,
        unbound: list[dict[str, Any]],
        waiting: list[dict[str, Any]],
        unplaceable: Mapping[str, str],
        note: str = "",
    ) -> None:
        """One Event on each pod no group can take, with each group's first reason. What was told
        is kept only for pods that are still unbound, so the map never outgrows the pods."""
        live = {str((p.get("metadata") or {}).get("uid")) for p in unbound}
        for uid in [u for u in self.told if u not in live]:
            del self.told[uid]
        for p in waiting:
            meta = p.get("metadata") or {}
            key, uid = f"{meta.get('namespace')}/{meta.get('name')}", str(meta.get("uid"))
            why = unplaceable.get(key)
            if why is None or uid in self.told:
                continue
            self.told[uid] = why
            msg = f"no node group can take this pod, so none is added for it: {why}{note}"
            self.events.pod(
                str(meta.get("namespace")), str(meta.get("name")), uid, REASON_NO_GROUP, msg, True
            )

    # --- failed scale-ups -----------------------------------------------------------------------
    def _failures(
        self,
        holders: list[dict[str, Any]],
        backoff: dict[str, dict[str, float]],
        slots: Mapping[str, int],
        newest: Mapping[str, float],
        out: PassResult,
    ) -> bool:
        """Placeholders the autoscaler will not (or did not) add a node for: each is deleted and
        backs its group off. A node of the group made after a group's last failure ends its
        backoff. Returns whether `backoff` changed."""
        changed = False
        failed: set[str] = set()  # groups a failure was counted for in this pass
        for g in list(backoff):
            if g not in slots or newest.get(g, 0.0) > backoff[g]["at"]:
                del backoff[g]  # the group grew since: the autoscaler can add its nodes again
                changed = True
        live = {
            str(p["metadata"].get("uid")): p for p in holders if not p["metadata"].get("deletionTimestamp")
        }
        if not live:
            return changed
        said: dict[str, str] = {}
        try:
            for e in self.kube.list_all(
                self.kube.core.list_namespaced_event,
                self.config.namespace,
                field_selector=f"reason={CA_NO_SCALE_UP}",
            ):
                uid = str((e.get("involvedObject") or {}).get("uid"))
                if uid in live:
                    said[uid] = str(e.get("message") or CA_NO_SCALE_UP)[:300]
        except ApiException as e:
            log.warning("autoscale: cannot read the autoscaler's events: %s", api_reason(e))
        now = self.clock()
        for uid, p in live.items():
            meta = p["metadata"]
            age = now - (_epoch(meta.get("creationTimestamp")) or now)
            why = said.get(uid)
            if why is None and age > self.config.scale_up_timeout_s:
                why = f"no node came in {int(age)} s"
            if why is None:
                continue
            group = str(meta["labels"][LABEL_PLACEHOLDER])
            out.failed[str(meta["name"])] = why
            if group not in failed:  # the group's placeholders refused together count once
                failed.add(group)
                changed = True
                self.metrics.failures.labels(group).inc()
                # refused for the host CPU or memory the placeholder carries (one tenant's pod may
                # ask that much): only placeholders asking as much are held back, not the group
                cpu, mem = placeholder_host(p)
                cpu = cpu if "Insufficient cpu" in why else 0
                mem = mem if "Insufficient memory" in why else 0
                n = int(min(backoff.get(group, {"failures": 0.0})["failures"] + 1, MAX_FAILURES))
                delay = backoff_delay(n, self.config.backoff_s, self.config.backoff_max_s)
                backoff[group] = {
                    "failures": float(n),
                    "until": now + delay,
                    "at": now,
                    "cpu": cpu,
                    "mem": mem,
                }
                held = "no placeholder of the group"
                if cpu or mem:
                    held += f" asking {cpu}m CPU or more" if cpu else f" asking {mem} MiB of memory or more"
                msg = (f"group {group}: the autoscaler added no node for this placeholder ({why}); {held} "
                       f"for {delay:g} s (failure {n} in a row)")  # fmt: skip
                log.warning("autoscale: %s", msg)
                self.events.pod(self.config.namespace, str(meta["name"]), uid, REASON_BACKOFF, msg, True)
            try:
                self.kube.json(self.kube.core.delete_namespaced_pod, meta["name"], self.config.namespace,
                               grace_period_seconds=0)  # fmt: skip
                out.deleted += 1
            except ApiException as e:
                if e.status != 404:
                    log.warning("autoscale: cannot delete placeholder %s: %s", meta["name"], api_reason(e))
        return changed

    def _save_backoff(self, backoff: Mapping[str, Mapping[str, float]], groups: set[str]) -> None:
        doc = {g: dict(rec) for g, rec in sorted(backoff.items()) if g in groups}
        body = {"data": {BACKOFF_KEY: json.dumps(doc, sort_keys=True)}}
        try:
            self.kube.merge_patch(self.kube.core.patch_namespaced_config_map, OWNER_CONFIGMAP,
                                  self.config.namespace, body)  # fmt: skip
        except ApiException as e:
            log.warning("autoscale: cannot record the backoff: %s", api_reason(e))

    # --- placeholders ---------------------------------------------------------------------------
    def _owner_cm(self) -> dict[str, Any]:
        """The placeholders' owner ConfigMap (made on first use), read every pass: it holds the
        groups' backoffs, which another replica may have written since."""
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
        return cm

    def _reconcile(
        self,
        wanted: Mapping[str, int],
        holders: list[dict[str, Any]],
        slots: Mapping[str, int],
        host: Mapping[str, tuple[int, int]],
        out: PassResult,
        caps: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        core, ns = self.kube.core, self.config.namespace
        by_group: dict[str, list[dict[str, Any]]] = {}
        for p in holders:
            if not (p.get("metadata") or {}).get("deletionTimestamp"):
                by_group.setdefault(p["metadata"]["labels"][LABEL_PLACEHOLDER], []).append(p)
        for group in sorted(set(wanted) | set(by_group)):
            need = host.get(group, (0, 0))
            cap = (caps or {}).get(group, (0, 0))
            have = sorted(by_group.get(group, []), key=lambda p: p["metadata"].get("creationTimestamp") or "")
            # one asking less host CPU or memory than the planned pods would let the autoscaler
            # add a node its own view says cannot hold them: it is made again, asking enough
            small = [
                p
                for p in have
                if any(a < b for a, b in zip(placeholder_host(p), need, strict=True))
                or any(0 < c <= a for a, c in zip(placeholder_host(p), cap, strict=True))  # refused such
            ]
            have = [p for p in have if p not in small]
            want = wanted.get(group, 0) if group in slots else 0
            for p in have[want:] + small:  # the newest go first: the autoscaler may be acting on the oldest
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
            for _ in range(want - len(have[:want])):
                assert self._owner is not None  # read by _owner_cm earlier in the pass
                body = placeholder_pod(group, slots[group], self.config.group_label, ns, self._owner, need)
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
