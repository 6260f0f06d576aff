"""The Helm chart (charts/gpupack) rendered by a real Helm client, and compared with deploy/.

`render` runs `helm template`; `comparable` strips what only Helm adds, so that the chart's
objects and `kubectl kustomize deploy/`'s can be held equal object by object; `differences` says
how they differ, one unified diff per object, so a change to deploy/ that the chart lacks (or the
other way round) fails with what to change.
"""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import realhelm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gpupack"
DEPLOY = REPO / "deploy"
SHIPPED_NS = "gpupack-system"
# What Helm (and only Helm) puts on each object: the chart's release bookkeeping.
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")
# The scheduler pod template's hash of its configuration: a changed profile rolls the pods under
# Helm, where deploy/ asks for a `kubectl rollout restart`.
CONFIG_CHECKSUM = "checksum/config"

Obj = dict[str, Any]


@pytest.fixture(scope="session")
def helm_assets() -> Path:
    """The Helm binaries' folder; the test is skipped without it, or fails where CI requires it."""
    assets = realhelm.assets_dir()
    if assets is None:
        if realhelm.required():
            pytest.fail(f"GPUPACK_REQUIRE_K8S is set but {realhelm.HOW_TO_GET}")
        pytest.skip(realhelm.HOW_TO_GET)
    return assets


def helm(
    client: str, *args: str, home: Path, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(realhelm.binary(client)), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=realhelm.env(home),
    )
    if check and r.returncode != 0:
        raise AssertionError(f"{client} {' '.join(args)} failed ({r.returncode}):\n{r.stderr or r.stdout}")
    return r


def render(
    client: str,
    *args: str,
    home: Path,
    release: str = "gpupack",
    namespace: str = SHIPPED_NS,
    chart: Path = CHART,
) -> list[Obj]:
    """The objects `helm template` renders (test hooks included unless --skip-tests is passed)."""
    out = helm(client, "template", release, str(chart), "--namespace", namespace, *args, home=home).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def deploy_scheduler_version() -> str:
    """The kube-scheduler version deploy/ pins (its kustomization's `images`), without the `v`."""
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (img,) = [i for i in k["images"] if i["name"] == "registry.k8s.io/kube-scheduler"]
    return str(img["newTag"]).lstrip("v")


def is_hook(o: Obj) -> bool:
    return "helm.sh/hook" in ((o.get("metadata") or {}).get("annotations") or {})


def key(o: Obj) -> tuple[str, str, str]:
    md = o.get("metadata") or {}
    return str(o.get("kind")), str(md.get("namespace") or ""), str(md.get("name"))


def comparable(o: Obj, from_chart: bool) -> Obj:
    """`o` without what only Helm adds (asserted to be there on a chart object, so that nothing
    else is dropped), with every ConfigMap value that is a YAML document compared as data (its
    comments and layout are the chart's own)."""
    o = yaml.safe_load(yaml.safe_dump(o))
    md = o.setdefault("metadata", {})
    if from_chart:
        labels = md.get("labels") or {}
        missing = [k for k in HELM_LABELS if k not in labels]
        assert not missing, f"{key(o)}: the chart object lacks its Helm labels {missing}"
        for k in HELM_LABELS:
            labels.pop(k)
        if o.get("kind") == "Deployment":
            ann = o["spec"]["template"]["metadata"].get("annotations") or {}
            assert CONFIG_CHECKSUM in ann, f"{key(o)}: no {CONFIG_CHECKSUM} on the pod template"
            ann.pop(CONFIG_CHECKSUM)
            if not ann:
                o["spec"]["template"]["metadata"].pop("annotations")
    if o.get("kind") == "ConfigMap":
        for k, v in (o.get("data") or {}).items():
            try:
                parsed = yaml.safe_load(v)
            except yaml.YAMLError:
                continue
            if isinstance(parsed, dict):
                o["data"][k] = parsed
    return o


def differences(chart: list[Obj], deploy: list[Obj]) -> list[str]:
    """What differs between the chart's (non-hook) objects and deploy/'s: objects only one has,
    and a unified diff (deploy/ -> chart) of each object both have but that differ."""
    ours = {key(o): comparable(o, True) for o in chart if not is_hook(o)}
    theirs = {key(o): comparable(o, False) for o in deploy}
    out = [f"only in deploy/: {k}" for k in sorted(set(theirs) - set(ours))]
    out += [f"only in the chart: {k}" for k in sorted(set(ours) - set(theirs))]
    for k in sorted(set(ours) & set(theirs)):
        if ours[k] != theirs[k]:
            a = yaml.safe_dump(theirs[k], sort_keys=True).splitlines()
            b = yaml.safe_dump(ours[k], sort_keys=True).splitlines()
            diff = "\n".join(difflib.unified_diff(a, b, "deploy/", "chart", lineterm="", n=2))
            out.append(f"{k} differs:\n{diff}")
    return out
