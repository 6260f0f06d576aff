"""Admission webhook core (pure): mutate and validate pods that use gpupack resources.

Mutating: a container that sets gpupack.io/gpu-mem or gpu-sm without gpupack.io/gpu gets
gpupack.io/gpu: 1 (the kubelet only calls the device plugin for a resource the container names);
with `set_scheduler_name`, the pod gets gpupack's scheduler name.
Validating: requests equal limits; gpu-sm in 1..100; gpu-mem positive and no larger than the
largest GPU in the cluster; a known class label; placed by gpupack's scheduler (no preset
spec.nodeName, no other scheduler). A denial names the rule and the value.
State: on CREATE and UPDATE of any pod, and on a pod's Binding (whose annotations the API server
copies onto the pod), gpupack's own annotations and the managed label may be written by gpupack's
ServiceAccounts only (deploy/webhook/webhooks.yaml sends only requests that
change them, so gpupack's own patches never wait on this webhook).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_GPU_MODELS,
    ANN_HANDOFF,
    CLASSES,
    DOMAIN,
    LABEL_CLASS,
    LABEL_MANAGED,
    MANAGED_RESOURCES,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    SCHEDULER_NAME,
    ContractError,
    parse_int_quantity,
    parse_quantity,
)
from gpupack.core.request import RequestError, parse_pod

from ..api.wire import WireError

log = logging.getLogger("gpupack.extender.webhook")

EXTENDER_SA = "gpupack-extender"
DEVICE_PLUGIN_SA = "gpupack-device-plugin"
# The device plugin's whole say in a pod's state: it records Allocate, nothing else.
PLUGIN_KEYS = frozenset({ANN_HANDOFF, ANN_ALLOCATED})


def _own_namespace() -> str:
    # the namespace gpupack runs in: its ServiceAccounts are the trusted writers
    return os.environ.get("POD_NAMESPACE") or "gpupack-system"


CLAIM_NODE = "authentication.kubernetes.io/node-name"  # in pod-bound tokens from Kubernetes 1.30
CLAIM_POD = "authentication.kubernetes.io/pod-name"  # in pod-bound tokens since 1.21
CLAIM_POD_UID = "authentication.kubernetes.io/pod-uid"  # with the pod's name


@dataclass(frozen=True)
class WebhookConfig:
    scheduler_name: str = SCHEDULER_NAME
    set_scheduler_name: bool = False
    namespace: str = field(default_factory=_own_namespace)
    # (namespace, name) -> pod object; raises on failure. Finds the node of the device plugin pod
    # a token is bound to, where the token does not name its node itself.
    pod_lookup: Callable[[str, str], dict[str, Any]] | None = field(default=None, compare=False)

    def user(self, sa: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{sa}"


def _esc(s: str) -> str:
    return s.replace("~", "~0").replace("/", "~1")


def _containers(spec: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    out = []
    for key in ("initContainers", "containers"):
        lst = spec.get(key) or []
        if not isinstance(lst, list):
            continue
        for i, c in enumerate(lst):
            if isinstance(c, dict):
                out.append((key, i, c))
    return out


def _res(c: dict[str, Any], which: str) -> dict[str, Any]:
    res = c.get("resources") or {}
    d = res.get(which) if isinstance(res, dict) else None
    return d if isinstance(d, dict) else {}


def uses_gpupack(pod: dict[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    for _, _, c in _containers(spec if isinstance(spec, dict) else {}):
        keys = set(_res(c, "limits")) | set(_res(c, "requests"))
        if keys & set(MANAGED_RESOURCES):
            return True
    return False


def mutate(pod: dict[str, Any], cfg: WebhookConfig) -> list[dict[str, Any]]:
    """JSON Patch operations for `pod` (empty when nothing changes)."""
    ops: list[dict[str, Any]] = []
    spec = pod.get("spec") or {}
    if not isinstance(spec, dict) or not uses_gpupack(pod):
        return ops
    for key, i, c in _containers(spec):
        limits, requests = _res(c, "limits"), _res(c, "requests")
        wants = {RES_GPU_MEM, RES_GPU_SM} & (set(limits) | set(requests))
        if wants and RES_GPU not in limits and RES_GPU not in requests:
            # limits only: the API server fills requests of extended resources from limits
            base = f"/spec/{key}/{i}/resources"
            if not isinstance(c.get("resources"), dict):
                ops.append({"op": "add", "path": base, "value": {}})
                c["resources"] = {}
            if not isinstance(c["resources"].get("limits"), dict):
                ops.append({"op": "add", "path": f"{base}/limits", "value": {}})
                c["resources"]["limits"] = {}
            ops.append({"op": "add", "path": f"{base}/limits/{_esc(RES_GPU)}", "value": "1"})
    if cfg.set_scheduler_name and spec.get("schedulerName") in (None, "", "default-scheduler"):
        op = "replace" if "schedulerName" in spec else "add"
        ops.append({"op": op, "path": "/spec/schedulerName", "value": cfg.scheduler_name})
    return ops


def _where(key: str, c: dict[str, Any]) -> str:
    return f"{'init container' if key == 'initContainers' else 'container'} {c.get('name', '?')!r}"


def requests_limits_errors(pod: dict[str, Any]) -> list[str]:
    """gpupack resources whose requests are missing from, or differ from, their limits.

    The mutating webhook refuses these too: the API server validates a pod only after mutating
    admission and before validating admission, and its own message for a request without a
    limit ("Limit must be set for non overcommitable resources") names neither the resource nor
    the value, so the validating webhook's clearer one would never be seen."""
    errors: list[str] = []
    spec = pod.get("spec") or {}
    for key, _, c in _containers(spec if isinstance(spec, dict) else {}):
        where = _where(key, c)
        limits, requests = _res(c, "limits"), _res(c, "requests")
        for r in MANAGED_RESOURCES:
            if r in requests and r not in limits:
                errors.append(
                    f"{where}: {r} must be set in limits (requests must equal limits); requests={requests[r]}"
                )
            elif r in requests and r in limits:
                try:
                    if parse_quantity(requests[r], r) != parse_quantity(limits[r], r):
                        errors.append(
                            f"{where}: requests must equal limits for {r}; requests={requests[r]} limits={limits[r]}"
                        )
                except ContractError as e:
                    errors.append(f"{where}: {e}")
    return errors


def _str_map(obj: Any, key: str) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    d = meta.get(key) if isinstance(meta, dict) else None
    return d if isinstance(d, dict) else {}


def is_state_key(key: str) -> bool:
    """A gpupack.io/ pod annotation only gpupack writes (all but the user-facing gpu-models)."""
    return isinstance(key, str) and key.startswith(f"{DOMAIN}/") and key != ANN_GPU_MODELS


def changed_state(pod: Any, old: Any) -> list[str]:
    """gpupack state keys that `pod` adds, changes or removes relative to `old` (None on CREATE)."""
    new_a, old_a = _str_map(pod, "annotations"), _str_map(old, "annotations")
    keys = sorted(k for k in set(new_a) | set(old_a) if is_state_key(k) and new_a.get(k) != old_a.get(k))
    new_l, old_l = _str_map(pod, "labels"), _str_map(old, "labels")
    if new_l.get(LABEL_MANAGED) != old_l.get(LABEL_MANAGED):
        keys.append(f"label {LABEL_MANAGED}")
    return keys


def state_errors(pod: Any, old: Any, username: Any, cfg: WebhookConfig) -> list[str]:
    """Why this user may not make this change to gpupack's state; empty when it may."""
    if username == cfg.user(EXTENDER_SA):
        return []
    changed = changed_state(pod, old)
    if username == cfg.user(DEVICE_PLUGIN_SA) and old is not None:
        changed = [k for k in changed if k not in PLUGIN_KEYS]
    if not changed:
        return []
    return [
        f"{', '.join(changed)} may be set, changed or removed by gpupack only (its scheduler and device "
        "plugin write them); remove them from the pod or its template and let "
        f"{cfg.scheduler_name} place the pod"
    ]


def _claim(user_info: dict[str, Any], key: str) -> str:
    extra = user_info.get("extra")
    values = extra.get(key) if isinstance(extra, dict) else None
    return values[0] if isinstance(values, list) and values and isinstance(values[0], str) else ""


def plugin_node_errors(req: dict[str, Any], cfg: WebhookConfig) -> list[str]:
    """The device plugin touches only its own Node and the pods on it. Its RBAC cannot say so; where
    its token names its node (Kubernetes >= 1.30) the admission policy checks it in CEL, and here
    the node is that of the pod the token is bound to (1.28-1.29: the token names the pod)."""
    raw_info, raw_obj = req.get("userInfo"), req.get("object")
    info: dict[str, Any] = raw_info if isinstance(raw_info, dict) else {}
    if info.get("username") != cfg.user(DEVICE_PLUGIN_SA) or req.get("operation") != "UPDATE":
        return []
    obj: dict[str, Any] = raw_obj if isinstance(raw_obj, dict) else {}
    kind = (req.get("kind") or {}).get("kind") if isinstance(req.get("kind"), dict) else None
    if kind == "Pod":
        target = str((obj.get("spec") or {}).get("nodeName") or "")
        what = f"pod {req.get('namespace')}/{req.get('name')} on node {target or '(none)'}"
    elif kind == "Node":
        target = str((obj.get("metadata") or {}).get("name") or "")
        what = f"node {target}"
    else:
        return []
    node = _claim(info, CLAIM_NODE)
    if node:
        if target != node:
            return [
                f"gpupack device plugin on node {node}: may touch only its own node and the pods on it, not {what}"
            ]
        return []
    pod, pod_uid = _claim(info, CLAIM_POD), _claim(info, CLAIM_POD_UID)
    if not pod or not pod_uid:
        return [
            "gpupack device plugin: its token names neither its pod nor its node; use the pod's own token"
        ]
    if cfg.pod_lookup is None:
        return []
    # Anyone who reaches this port can send a review with any userInfo: the answer must tell them
    # nothing they did not send (no node, no pod's existence, no API error). The pod's UID, which
    # only its real token carries, must match, and every refusal reads the same; the details go
    # to the log.
    try:
        found = cfg.pod_lookup(cfg.namespace, pod) or {}
        node = str((found.get("spec") or {}).get("nodeName") or "")
        uid = str((found.get("metadata") or {}).get("uid") or "")
    except Exception as e:  # unknown: refuse (the plugin retries), never guess
        log.warning("plugin-node: cannot read pod %s/%s to learn its node: %s", cfg.namespace, pod, e)
        node = uid = ""
    if not node or uid != pod_uid or target != node:
        log.info("plugin-node: refused %s for pod %s/%s (uid %s) on node %r", what, cfg.namespace, pod,
                 "matches" if uid == pod_uid else "differs", node)  # fmt: skip
        return [f"gpupack device plugin: may touch only its own node and the pods on it, not {what}"]
    return []


def placement_errors(pod: dict[str, Any], scheduler_name: str) -> list[str]:
    """A GPU pod must be placed by gpupack's scheduler: only it writes the assignment the device
    plugin serves, so a preset node or another scheduler would get no GPU (or, before the device
    plugin checked, any GPU)."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, dict):
        return []
    errors = []
    node = spec.get("nodeName")
    if node:
        errors.append(
            f"spec.nodeName is preset ({str(node)[:253]!r}): pods that request gpupack resources are placed "
            f"by {scheduler_name}; remove spec.nodeName and use a nodeSelector or node affinity on "
            "kubernetes.io/hostname to pin a node"
        )
    sched = spec.get("schedulerName")
    if sched not in (None, "", scheduler_name):
        errors.append(
            f"spec.schedulerName is {str(sched)[:253]!r}: pods that request gpupack resources must set "
            f"schedulerName: {scheduler_name}"
        )
    return errors


def validate(pod: dict[str, Any], largest_gpu_mib: int, scheduler_name: str | None = None) -> list[str]:
    """Rule violations, each naming the container, the rule and the value; empty when valid.

    With `scheduler_name`, a pod that presets spec.nodeName or names another scheduler is refused."""
    if not uses_gpupack(pod):
        return []
    errors: list[str] = []
    if scheduler_name:
        errors += placement_errors(pod, scheduler_name)
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {} if isinstance(meta, dict) else {}
    cls = labels.get(LABEL_CLASS) if isinstance(labels, dict) else None
    if cls is not None and cls not in CLASSES:
        errors.append(f"label {LABEL_CLASS} must be one of {', '.join(CLASSES)}; got {cls!r}")
    errors += requests_limits_errors(pod)
    spec = pod.get("spec") or {}
    for key, _, c in _containers(spec if isinstance(spec, dict) else {}):
        where = _where(key, c)
        limits = _res(c, "limits")
        if RES_GPU_SM in limits:
            try:
                sm = parse_int_quantity(limits[RES_GPU_SM], f"{where} {RES_GPU_SM}")
                if not 1 <= sm <= 100:
                    errors.append(f"{where}: {RES_GPU_SM} must be a whole percent in 1..100; got {sm}")
            except ContractError as e:
                errors.append(f"{where}: {RES_GPU_SM} must be a whole percent in 1..100; {e}")
        if RES_GPU_MEM in limits:
            try:
                mem = parse_int_quantity(limits[RES_GPU_MEM], f"{where} {RES_GPU_MEM}")
                # the parsed number, not the string: the API server hands us 30000 as "30k"
                if mem <= 0:
                    errors.append(f"{where}: {RES_GPU_MEM} must be a positive number of MiB; got {mem}")
                elif largest_gpu_mib and mem > largest_gpu_mib:
                    # not the size: the webhook's callers are unauthenticated (an operator reads
                    # the GPU sizes with `gpupack status`)
                    errors.append(
                        f"{where}: {RES_GPU_MEM} must be at most the largest GPU in the cluster; got {mem} MiB"
                    )
            except ContractError as e:
                errors.append(f"{where}: {RES_GPU_MEM} must be a positive number of MiB; {e}")
    if not errors:
        try:
            parse_pod(pod)
        except (RequestError, ContractError) as e:
            errors.append(str(e))
    return errors


def review(body: Any, kind: str, cfg: WebhookConfig, largest_gpu_mib: int) -> dict[str, Any]:
    """Answer an admission.k8s.io/v1 AdmissionReview; WireError on a malformed one."""
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise WireError("expected an AdmissionReview object with a request")
    req = body["request"]
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise WireError("AdmissionReview request.uid must be a non-empty string")
    resp: dict[str, Any] = {"uid": uid, "allowed": True}
    out = {
        "apiVersion": body.get("apiVersion") or "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": resp,
    }
    obj = req.get("object")
    kind_ = (req.get("kind") or {}).get("kind") if isinstance(req.get("kind"), dict) else None
    op = req.get("operation")
    if kind == "validate" and isinstance(obj, dict):
        errors = plugin_node_errors(req, cfg)
        if not errors and kind_ == "Binding" and op == "CREATE":
            # the API server copies a Binding's annotations onto the pod it binds
            errors = state_errors(obj, None, _username(req), cfg)
        if errors:
            return _deny(out, errors)
    if op not in ("CREATE", "UPDATE", None) or kind_ not in ("Pod", None) or not isinstance(obj, dict):
        return out
    if kind == "mutate":
        if op == "UPDATE":
            return out
        errors = requests_limits_errors(obj) if uses_gpupack(obj) else []
        if errors:
            return _deny(out, errors)
        ops = mutate(obj, cfg)
        if ops:
            resp["patchType"] = "JSONPatch"
            resp["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
        return out
    user = _username(req)
    old = req.get("oldObject") if op == "UPDATE" else None
    errors = state_errors(obj, old if isinstance(old, dict) else {}, user, cfg) if op == "UPDATE" else []
    if op != "UPDATE":
        errors = state_errors(obj, None, user, cfg) + validate(obj, largest_gpu_mib, cfg.scheduler_name)
    return _deny(out, errors) if errors else out


def _username(req: dict[str, Any]) -> Any:
    info = req.get("userInfo")
    return info.get("username") if isinstance(info, dict) else None


def _deny(out: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    forbidden = "gpupack only" in errors[0] or errors[0].startswith("gpupack device plugin")
    out["response"]["allowed"] = False
    out["response"]["status"] = {"code": 403 if forbidden else 422, "reason": "Forbidden" if forbidden else "Invalid",
                                 "message": "gpupack: " + "; ".join(errors)}  # fmt: skip
    return out
