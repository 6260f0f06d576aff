"""One source of truth: the Helm chart with its default values renders the objects deploy/ does.

`kubectl kustomize deploy/` (the real kubectl of ../shared/k8s) against `helm template` of
charts/gpupack (both real Helm clients, v4 and v3), object by object, after removing only what
Helm itself adds (its release labels, the scheduler pod's config checksum). A change to deploy/
that the chart lacks, or one to the chart that deploy/ lacks, fails here with a diff of the object.
Offline: no API server is needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import realhelm
import realk8s
import yaml
from chart_objects import (
    DEPLOY,
    deploy_scheduler_version,
    differences,
    helm_assets,  # noqa: F401 (a fixture, used by pytestmark)
    render,
)

# without the Helm binaries: skipped, or failed where CI requires them
pytestmark = pytest.mark.usefixtures("helm_assets")


@pytest.fixture(scope="module")
def kubectl() -> str:
    if realk8s.assets_dir() is None:
        pytest.skip(realk8s.HOW_TO_GET)
    return str(realk8s.binary("kubectl"))


def _kustomize(kubectl: str, path: Path) -> list[dict]:
    import subprocess

    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def deploy_objects(kubectl: str) -> list[dict]:
    return _kustomize(kubectl, DEPLOY)


def _offline(*extra: str) -> list[str]:
    # the cluster deploy/ is written for: the kube-scheduler version it pins, with the admission
    # policy API as v1 (GA from 1.30, what deploy/ ships)
    return ["--kube-version", deploy_scheduler_version(), "--skip-tests", *extra]


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_default_values_render_what_deploy_installs(client, deploy_objects, tmp_path):
    chart = render(client, *_offline(), home=tmp_path)
    # the release namespace exists before `helm install` (Helm keeps its record there), so only
    # namespace.create renders it; everything else deploy/ installs, the defaults install
    without_ns = [o for o in deploy_objects if o["kind"] != "Namespace"]
    assert len(without_ns) == len(deploy_objects) - 1
    assert differences(chart, without_ns) == []
    # ... and with namespace.create the Namespace too, labelled as deploy/ labels it
    assert (
        differences(
            render(client, *_offline("--set", "namespace.create=true"), home=tmp_path), deploy_objects
        )
        == []
    )


def test_autoscale_renders_what_the_deploy_component_adds(kubectl, tmp_path):
    # deploy/ with its autoscale component on, as the operator guide says to turn it on. The base's
    # `labels` run before a component, so the component's own RBAC objects get part-of here.
    k = tmp_path / "with-autoscale"
    k.mkdir()
    rel = os.path.relpath(DEPLOY, k)  # kustomize takes relative paths only
    (k / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel], "components": [f"{rel}/autoscale"],
        "labels": [{"pairs": {"app.kubernetes.io/part-of": "gpupack"}, "includeSelectors": False}],
    }))  # fmt: skip
    chart = render("helm", *_offline("--set", "autoscale.enabled=true"), home=tmp_path)
    assert differences(chart, [o for o in _kustomize(kubectl, k) if o["kind"] != "Namespace"]) == []


def _with_components(kubectl: str, tmp_path: Path, *components: str) -> list[dict]:
    """deploy/ with components on, as its kustomization says to turn them on (`components:` in
    deploy/kustomization.yaml, whose labels and images then reach the components' objects too);
    here an overlay with the base's labels and images again, as the base's run before a component."""
    k = tmp_path / "with-components"
    k.mkdir()
    rel = os.path.relpath(DEPLOY, k)  # kustomize takes relative paths only
    base = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (k / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel], "components": [f"{rel}/{c}" for c in components],
        "labels": base["labels"], "images": base["images"],
    }))  # fmt: skip
    return [o for o in _kustomize(kubectl, k) if o["kind"] != "Namespace"]


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_dra_mode_renders_what_the_deploy_dra_component_installs(client, kubectl, tmp_path):
    # devicePlugin.mode=dra on a cluster serving resource.k8s.io/v1: deploy/dra's objects (the DRA
    # plugin's DaemonSet in place of the device plugin's, its RBAC, metrics Service and
    # NetworkPolicy, the own-node policy, the DeviceClasses; gpupack allocating: the gate policies,
    # the allocator's RBAC and the extender's --dra-allocate --dra-place-pods), and every other
    # object unchanged
    dra = ("--set", "devicePlugin.mode=dra", "--api-versions", "resource.k8s.io/v1",
           "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")  # fmt: skip
    chart = render(client, *_offline(*dra), home=tmp_path)
    deploy = _with_components(kubectl, tmp_path, "dra")
    assert differences(chart, deploy) == []
    kinds = {(o["kind"], o["metadata"]["name"]) for o in chart}
    assert ("DaemonSet", "gpupack-dra-plugin") in kinds and (
        "DaemonSet",
        "gpupack-device-plugin",
    ) not in kinds
    assert {n for k, n in kinds if k == "DeviceClass"} == {"gpupack-online", "gpupack-offline"}
    assert ("MutatingAdmissionPolicy", "gpupack-dra-allocate-gate") in kinds


def test_the_comparison_sees_a_difference(deploy_objects, tmp_path):
    # the test above can fail: one changed value shows up as that object's diff, and nothing else
    chart = render("helm", *_offline("--set", "defrag.schedule=0 3 * * *"), home=tmp_path)
    (diff,) = differences(chart, [o for o in deploy_objects if o["kind"] != "Namespace"])
    assert diff.startswith("('CronJob', 'gpupack-system', 'gpupack-defrag') differs"), diff
    assert "-  schedule: 30 1 * * *\n+  schedule: 0 3 * * *" in diff, diff
