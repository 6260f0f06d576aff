"""Render a kustomization: the real `kubectl kustomize` when a kubectl is found, else a fallback.

kubectl is looked up as `--kubectl`/the `kubectl` argument, then `$GPUPACK_KUBECTL`, then `kubectl`
on PATH (the tests pass the checksum-verified one from ../shared/k8s). The fallback (`render_python`)
is the subset of kustomize v5 that gpupack's manifests use (resources, labels, images, namespace),
for a machine with no kubectl at all (`pip install -e '.[test]'` brings none); any other
kustomization field is an error, never silently ignored. tests/deploy/ checks that the fallback
renders what kubectl renders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
RENDERERS = ("auto", "kubectl", "python")
KUBECTL_ENV = "GPUPACK_KUBECTL"
# libyaml's loader where PyYAML has it: the same safe YAML, about 10 times faster than PyYAML's own
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class RenderError(Exception):
    pass


def find_kubectl(kubectl: str | None = None) -> str | None:
    """The kubectl to run: `kubectl` if given, else $GPUPACK_KUBECTL, else the one on PATH."""
    if kubectl:
        return kubectl
    return os.environ.get(KUBECTL_ENV) or shutil.which("kubectl")


def render(path: Path, renderer: str = "auto", kubectl: str | None = None) -> list[Obj]:
    """The objects `path`'s kustomization renders to. "auto": kubectl when one is found, else the
    fallback; "kubectl" fails without one; "python" is the fallback."""
    if renderer not in RENDERERS:
        raise ValueError(f"renderer {renderer!r}: one of {RENDERERS}")
    if renderer == "kubectl" or (renderer == "auto" and find_kubectl(kubectl)):
        return render_kubectl(path, kubectl)
    return render_python(path)


def render_kubectl(path: Path, kubectl: str | None = None) -> list[Obj]:
    exe = find_kubectl(kubectl)
    if not exe:
        raise RenderError(f"kubectl not found (set ${KUBECTL_ENV} or put kubectl on PATH)")
    try:
        p = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise RenderError(f"kubectl {exe}: {e.strerror or e}") from e
    if p.returncode != 0:
        err = p.stderr.strip()
        raise RenderError(f"kubectl kustomize {path}: {err.splitlines()[-1] if err else p.returncode}")
    return [d for d in yaml.load_all(p.stdout, Loader=_LOADER) if d]


_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_SUPPORTED = {"apiVersion", "kind", "resources", "labels", "images", "namespace"}
# Kinds that are cluster-scoped (kustomize's namespace transformer leaves them alone).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "PriorityClass",
    "CustomResourceDefinition",
    "StorageClass",
    "PersistentVolume",
    "Node",
    "APIService",
    "RuntimeClass",
    "IngressClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def _kustomization(path: Path) -> Path:
    for n in _KUSTOMIZATION_FILES:
        if (path / n).is_file():
            return path / n
    raise RenderError(f"{path}: no kustomization.yaml")


def render_python(path: Path) -> list[Obj]:
    """The fallback: the subset of kustomize v5 that gpupack's manifests use."""
    kfile = _kustomization(path)
    k = yaml.load(kfile.read_text(), Loader=_LOADER) or {}
    unknown = set(k) - _SUPPORTED
    if unknown:
        raise RenderError(f"{kfile}: the python renderer does not support {sorted(unknown)}; use kubectl")
    objs: list[Obj] = []
    for res in k.get("resources") or []:
        target = (path / res).resolve()
        if target.is_dir():
            objs.extend(render_python(target))
        elif target.is_file():
            objs.extend(_documents(target))
        else:
            raise RenderError(f"{kfile}: resource {res!r} not found")
    if k.get("namespace"):
        for o in objs:
            if o.get("kind") not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    for spec in k.get("labels") or []:
        if (
            spec.get("includeSelectors")
            or spec.get("includeTemplates")
            or set(spec) - {"pairs", "includeSelectors", "includeTemplates"}
        ):
            raise RenderError(
                f"{kfile}: labels with selectors/templates are not supported by the python renderer"
            )
        for o in objs:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(spec.get("pairs") or {})
    for img in k.get("images") or []:
        for o in objs:
            for c in all_containers(o):
                c["image"] = _retag(c.get("image", ""), img)
    return objs


def _documents(target: Path) -> list[Obj]:
    try:
        docs = [d for d in yaml.load_all(target.read_text(), Loader=_LOADER) if d]
    except yaml.YAMLError as e:
        raise RenderError(f"{target}: invalid YAML: {e}") from e
    out: list[Obj] = []
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{target}: a document without apiVersion/kind")
        if d.get("kind", "").endswith("List") and "items" in d:
            out.extend(d["items"])
        else:
            out.append(d)
    return out


def split_image(ref: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; "" for a part it lacks."""
    name, digest = (ref.split("@", 1) + [""])[:2]
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest


def _retag(ref: str, img: dict[str, Any]) -> str:
    name, tag, digest = split_image(ref)
    if name != img.get("name"):
        return ref
    name = img.get("newName", name)
    if "digest" in img:
        return f"{name}@{img['digest']}"
    tag = str(img.get("newTag", tag))
    out = f"{name}:{tag}" if tag else name
    return f"{out}@{digest}" if digest and "newTag" not in img else out


def pod_spec(o: Obj) -> Obj | None:
    """The pod spec of a Pod or of a workload's pod template; None for other kinds."""
    kind = o.get("kind")
    spec = o.get("spec") or {}
    if kind == "Pod":
        return spec
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
        return ((spec.get("template") or {}).get("spec")) or {}
    if kind == "CronJob":
        return ((((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
    return None


def all_containers(o: Obj) -> Iterator[Obj]:
    ps = pod_spec(o)
    if ps:
        for key in ("initContainers", "containers"):
            yield from ps.get(key) or []
