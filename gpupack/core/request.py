"""Turn a pod (Kubernetes JSON, camelCase keys) into a :class:`PodRequest`.

Rules (docs/contract.md §1):
- Resources are read from `limits`; if `requests` also name a gpupack resource it must be equal.
- `gpupack.io/gpu` defaults to 1 when `gpu-mem` or `gpu-sm` is set; with neither, the container
  holds its `gpu` GPUs whole.
- Class: the pod's `gpupack.io/class` label, else the namespace's, else `online`.
"""

from __future__ import annotations

from typing import Any

from gpupack.contract import (
    ANN_GPU_MODELS,
    CLASS_ONLINE,
    CLASSES,
    LABEL_CLASS,
    RES_GPU,
    RES_GPU_MEM,
    RES_GPU_SM,
    ContractError,
)
from gpupack.contract import parse_int_quantity as _parse_int
from gpupack.core.model import ContainerRequest, PodRequest


class RequestError(ContractError):
    """A pod whose gpupack request breaks a rule; the message names the container and value."""


def parse_int_quantity(value: Any, what: str) -> int:
    try:
        return _parse_int(value, what)
    except RequestError:
        raise
    except ContractError as e:
        raise RequestError(str(e)) from None


def _field(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    """d[key] if present and not null, else an empty `typ`; any other type is an error."""
    v = d.get(key)
    if v is None:
        return typ()
    if not isinstance(v, typ):
        raise RequestError(f"{where}: {key} must be {'an object' if typ is dict else 'a list'}")
    return v


def _resources(c: dict[str, Any], where: str) -> dict[str, Any]:
    res = _field(c, "resources", dict, where)
    limits = _field(res, "limits", dict, where)
    requests = _field(res, "requests", dict, where)
    out: dict[str, Any] = {}
    for name in (RES_GPU, RES_GPU_MEM, RES_GPU_SM):
        lim, req = limits.get(name), requests.get(name)
        if lim is None and req is not None:
            raise RequestError(
                f"{where}: {name} is in requests but not in limits (extended resources need limits)"
            )
        if lim is not None and req is not None:
            a = parse_int_quantity(lim, f"{where} limits {name}")
            b = parse_int_quantity(req, f"{where} requests {name}")
            if a != b:
                raise RequestError(f"{where}: requests {name}={req} must equal limits {name}={lim}")
        if lim is not None:
            out[name] = lim
    return out


def parse_container(c: Any, init: bool, where: str) -> ContainerRequest | None:
    if not isinstance(c, dict):
        raise RequestError(f"{where}: container must be an object")
    name = c.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: container has no name")
    where = f"{where} {'init container' if init else 'container'} {name!r}"
    res = _resources(c, where)
    if not res:
        return None
    mem = parse_int_quantity(res[RES_GPU_MEM], f"{where} {RES_GPU_MEM}") if RES_GPU_MEM in res else None
    sm = parse_int_quantity(res[RES_GPU_SM], f"{where} {RES_GPU_SM}") if RES_GPU_SM in res else None
    if RES_GPU in res:
        gpus = parse_int_quantity(res[RES_GPU], f"{where} {RES_GPU}")
        if gpus == 0:
            if mem is not None or sm is not None:
                raise RequestError(f"{where}: {RES_GPU}=0 with {RES_GPU_MEM}/{RES_GPU_SM} set")
            return None
    else:
        gpus = 1
    if mem is not None and mem <= 0:
        raise RequestError(f"{where}: {RES_GPU_MEM} must be a positive number of MiB, got {mem}")
    if sm is not None and not 1 <= sm <= 100:
        raise RequestError(f"{where}: {RES_GPU_SM} must be a percent in 1..100, got {sm}")
    if gpus > 64:
        raise RequestError(f"{where}: {RES_GPU}={gpus} is more GPUs than any node has")
    return ContainerRequest(
        name=name, gpus=gpus, mem_mib=mem, milli=None if sm is None else sm * 10, init=init
    )


def pod_class_of(pod: dict[str, Any], namespace_labels: dict[str, str] | None = None) -> str:
    meta = _field(pod, "metadata", dict, "pod")
    labels = _field(meta, "labels", dict, "pod metadata")
    value = labels.get(LABEL_CLASS)
    source = "pod label"
    if value is None and namespace_labels:
        value, source = namespace_labels.get(LABEL_CLASS), "namespace label"
    if value is None:
        return CLASS_ONLINE
    if not isinstance(value, str) or value not in CLASSES:
        raise RequestError(f"{source} {LABEL_CLASS}={value!r} is not one of {', '.join(CLASSES)}")
    return value


def parse_pod(pod: Any, namespace_labels: dict[str, str] | None = None) -> PodRequest:
    """Parse a pod; a pod without gpupack resources gives a request with no containers."""
    if not isinstance(pod, dict):
        raise RequestError("pod must be a JSON object")
    meta = _field(pod, "metadata", dict, "pod")
    spec = _field(pod, "spec", dict, "pod")
    ns = meta.get("namespace") or "default"
    name = meta.get("name") or meta.get("generateName") or ""
    if not isinstance(ns, str) or not isinstance(name, str):
        raise RequestError("pod metadata.name/namespace must be strings")
    where = f"pod {ns}/{name}"
    containers: list[ContainerRequest] = []
    inits: list[ContainerRequest] = []
    for key, init, out in (("initContainers", True, inits), ("containers", False, containers)):
        for c in _field(spec, key, list, f"{where} spec"):
            req = parse_container(c, init, where)
            if req is not None:
                out.append(req)
    models = None
    anns = _field(meta, "annotations", dict, f"{where} metadata")
    if anns.get(ANN_GPU_MODELS):
        raw = str(anns[ANN_GPU_MODELS]).replace(",", "|")
        models = frozenset(m.strip() for m in raw.split("|") if m.strip()) or None
    owner = None
    for ref in _field(meta, "ownerReferences", list, f"{where} metadata"):
        if isinstance(ref, dict) and ref.get("controller"):
            owner = (str(ref.get("kind", "")), str(ref.get("name", "")))
    return PodRequest(
        key=f"{ns}/{name}",
        pod_class=pod_class_of(pod, namespace_labels),
        containers=tuple(containers),
        init_containers=tuple(inits),
        gpu_models=models,
        uid=str(meta.get("uid") or ""),
        namespace=ns,
        owner=owner,
    )
