"""Every pod deploy/ runs meets Pod Security "restricted", except the device plugin, which needs
a hostPath and root and is the reason gpupack-system's label says `privileged`: checked by the
real API server's PodSecurity admission (server-side dry run in a namespace that enforces
"restricted"), on the pod templates `kubectl kustomize deploy/` renders."""

from __future__ import annotations

import copy
from pathlib import Path

import deploy_objects
import yaml
from kubernetes import client
from realk8s import ControlPlane

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _templates(cp: ControlPlane) -> dict[str, dict]:
    out = {}
    for o in yaml.safe_load_all(cp.kubectl("kustomize", str(DEPLOY))):
        if not o:
            continue
        spec = {"Deployment": lambda o: o["spec"]["template"], "DaemonSet": lambda o: o["spec"]["template"],
                "CronJob": lambda o: o["spec"]["jobTemplate"]["spec"]["template"]}.get(o["kind"])  # fmt: skip
        if spec:
            out[f"{o['kind']}/{o['metadata']['name']}"] = copy.deepcopy(spec(o))
    return out


def test_every_pod_but_the_device_plugin_meets_restricted(cluster: ControlPlane):
    ns = f"psa-{deploy_objects.suffix()}"
    cluster.ensure_namespace(ns, {"pod-security.kubernetes.io/enforce": "restricted"})
    templates = _templates(cluster)
    assert set(templates) == {
        "Deployment/gpupack-scheduler",
        "DaemonSet/gpupack-device-plugin",
        "CronJob/gpupack-defrag",
    }
    refused = {}
    for what, tpl in templates.items():
        # admission of the pod itself; its account, priority class and Secrets are not the point here
        tpl["spec"].pop("priorityClassName", None)
        tpl["spec"]["serviceAccountName"] = "default"
        body = {"metadata": {"name": "p", "labels": tpl["metadata"].get("labels", {})}, "spec": tpl["spec"]}
        try:
            cluster.core.create_namespaced_pod(ns, body, dry_run="All")
        except client.ApiException as e:
            assert e.status == 403, e.body
            refused[what] = e.body
    assert set(refused) == {"DaemonSet/gpupack-device-plugin"}, refused
    msg = refused["DaemonSet/gpupack-device-plugin"]
    # and only for what it cannot do without: the hostPath and root
    for needed in ('volumes \\"device-plugins\\", \\"pod-resources\\" use restricted volume type \\"hostPath\\"',
                   "runAsNonRoot != true", "must not set runAsUser=0"):  # fmt: skip
        assert needed in msg, msg
    for met in ("seccompProfile", "allowPrivilegeEscalation", "capabilities", "privileged", "hostNetwork"):
        assert met not in msg, msg
    # the namespace it ships in says so
    labels = deploy_objects.load("namespace.yaml")[0]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"


def test_the_device_plugin_mounts_only_what_it_uses():
    (ds,) = [o for o in deploy_objects.load("deviceplugin/daemonset.yaml") if o["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    host = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # the kubelet's socket directory, and its PodResources API (which pod holds a GPU, asked at
    # PreStartContainer), read-only
    assert host == {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"}
    mounts = {m["name"]: m for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert set(mounts) == {v["name"] for v in spec["volumes"]}
    (pr,) = [
        v["name"]
        for v in spec["volumes"]
        if v.get("hostPath", {}).get("path") == "/var/lib/kubelet/pod-resources"
    ]
    assert mounts[pr].get("readOnly") is True
    # of the PodResources API the plugin's code calls List alone (not Get, not GetAllocatableResources)
    code = "".join(p.read_text() for p in (DEPLOY.parent / "deviceplugin").glob("*.py"))
    assert ".List(" in code and ".Get(" not in code and "GetAllocatableResources" not in code
