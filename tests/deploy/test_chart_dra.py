"""The Helm chart in DRA mode (devicePlugin.mode=dra): offline with both real Helm clients (values,
schema, refusal), and against the real API server: switched on with `helm upgrade` on v1.36.2 (its
objects accepted, the device plugin's gone, nothing left after uninstall), refused on a server that
serves no resource.k8s.io/v1 (v1.28.7) before anything is made.

That the DRA objects equal deploy/dra's is tests/deploy/test_chart_matches_deploy.py; that they work
(the plugin on exactly this RBAC and own-node policy) is tests/draplugin/test_dra_cluster.py.
"""

from __future__ import annotations

import deploy_objects
import pytest
import realhelm
import realk8s
import yaml
from chart_objects import (
    CHART,
    helm,
    helm_assets,  # noqa: F401 (a fixture, used by pytestmark)
    render,
)
from test_chart_apiserver import NS_LABELS, Helm, _clear_leftovers, _gpupack_admission, _live
from test_chart_values import _containers, _one, _validate

# without the Helm binaries: skipped, or failed where CI requires them
pytestmark = pytest.mark.usefixtures("helm_assets")
DRA = ("--set", "devicePlugin.mode=dra")
REFUSAL = "devicePlugin.mode=dra needs Dynamic Resource Allocation at resource.k8s.io/v1"
DEVICE_PLUGIN_OBJECTS = {
    ("DaemonSet", "gpupack-device-plugin"), ("ServiceAccount", "gpupack-device-plugin"),
    ("ClusterRole", "gpupack-device-plugin"), ("ClusterRoleBinding", "gpupack-device-plugin"),
    ("Service", "gpupack-device-plugin-metrics"), ("NetworkPolicy", "gpupack-device-plugin"),
}  # fmt: skip
DRA_OBJECTS = {
    ("DaemonSet", "gpupack-dra-plugin"), ("ServiceAccount", "gpupack-dra-plugin"),
    ("ClusterRole", "gpupack-dra-plugin"), ("ClusterRoleBinding", "gpupack-dra-plugin"),
    ("Service", "gpupack-dra-plugin-metrics"), ("NetworkPolicy", "gpupack-dra-plugin"),
    ("ValidatingAdmissionPolicy", "gpupack-dra-plugin-own-node"),
    ("ValidatingAdmissionPolicyBinding", "gpupack-dra-plugin-own-node"),
    ("DeviceClass", "gpupack-online"), ("DeviceClass", "gpupack-offline"),
}  # fmt: skip
# gpupack allocating the claims (devicePlugin.dra.allocate, on by default in DRA mode)
ALLOCATE_OBJECTS = {
    ("MutatingAdmissionPolicy", "gpupack-dra-allocate-gate"),
    ("MutatingAdmissionPolicyBinding", "gpupack-dra-allocate-gate"),
    ("ValidatingAdmissionPolicy", "gpupack-dra-allocate-gate-kept"),
    ("ValidatingAdmissionPolicyBinding", "gpupack-dra-allocate-gate-kept"),
    ("ClusterRole", "gpupack-dra-allocator"), ("ClusterRoleBinding", "gpupack-dra-allocator"),
}  # fmt: skip
ALLOCATE_REFUSAL = "devicePlugin.dra.allocate=true gates pods with a MutatingAdmissionPolicy"
# tools/validate_deploy.py does not know DeviceClass (cluster-scoped), nor that the plugin needs only
# its driver's folder of the kubelet's plugins directory mounted: its two false findings here; nor,
# its schemas ending at 1.35, MutatingAdmissionPolicy v1 (1.36; cluster-scoped too)
VALIDATOR_BLIND_SPOTS = ("DeviceClass/gpupack-o", "--plugins-dir=", "MutatingAdmissionPolicy")


def _names(objs: list[dict]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def test_dra_mode_swaps_the_node_agent_and_nothing_else(tmp_path):
    base = render("helm", "--skip-tests", "--kube-version", "1.36.2", home=tmp_path)
    dra = render("helm", "--skip-tests", "--kube-version", "1.36.2", *DRA, home=tmp_path)
    assert _names(base) - _names(dra) == DEVICE_PLUGIN_OBJECTS
    assert _names(dra) - _names(base) == DRA_OBJECTS | ALLOCATE_OBJECTS
    assert {"--dra-allocate", "--dra-place-pods"} <= set(
        _containers(dra, "Deployment", "gpupack-scheduler")["extender"]["args"]
    )
    # allocate=false: the DRA plugin's objects only, the extender as in device-plugin mode
    plain = render("helm", "--skip-tests", "--kube-version", "1.36.2", *DRA, "--set", "devicePlugin.dra.allocate=false",
                   home=tmp_path)  # fmt: skip
    assert _names(plain) - _names(base) == DRA_OBJECTS
    assert _containers(plain, "Deployment", "gpupack-scheduler") == _containers(
        base, "Deployment", "gpupack-scheduler"
    )
    # networkPolicy.enabled=false turns the DRA plugin's NetworkPolicy off too
    off = render("helm", "--skip-tests", "--kube-version", "1.36.2", *DRA, "--set", "networkPolicy.enabled=false",
                 home=tmp_path)  # fmt: skip
    assert _names(dra) - _names(off) == {
        ("NetworkPolicy", "gpupack-dra-plugin"),
        ("NetworkPolicy", "gpupack-scheduler"),
    }


def test_the_device_plugins_knobs_reach_the_dra_daemonset(tmp_path):
    values = tmp_path / "values.yaml"
    digest = "sha256:" + "cd" * 32
    values.write_text(yaml.safe_dump({
        "image": {"repository": "registry.example/gpupack", "digest": digest},
        "logLevel": "debug",
        "devicePlugin": {
            "mode": "dra", "enforcement": "mps", "priorityClassName": "gpu-critical",
            "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"cpu": "2", "memory": "256Mi"}},
            "kubeletDir": "/data/kubelet",
            "dra": {"cdiDir": "/etc/cdi", "extraArgs": ["--probe-interval=10"]},
        },
    }))  # fmt: skip
    objs = render("helm", "--kube-version", "1.36.2", "-f", str(values), home=tmp_path)
    ds = _one(objs, "DaemonSet", "gpupack-dra-plugin")
    ps = ds["spec"]["template"]["spec"]
    c = _containers(objs, "DaemonSet", "gpupack-dra-plugin")["dra-plugin"]
    assert c["image"] == f"registry.example/gpupack@{digest}"
    assert (ps["priorityClassName"], ps["nodeSelector"], ps["tolerations"]) == (
        "gpu-critical", {"pool": "gpu"}, [{"key": "dedicated", "operator": "Exists"}]
    )  # fmt: skip
    assert c["resources"] == {
        "requests": {"cpu": "20m", "memory": "64Mi"},
        "limits": {"cpu": "2", "memory": "256Mi"},
    }
    assert c["args"] == [
        "--registry-dir=/data/kubelet/plugins_registry", "--plugins-dir=/data/kubelet/plugins",
        "--cdi-dir=/etc/cdi", "--enforcement=mps", "--offline-class=gpupack-offline", "--metrics-port=9500",
        "--probe-interval=10",
    ]  # fmt: skip
    assert {"name": "GPUPACK_LOG_LEVEL", "value": "debug"} in c["env"]
    # the kubelet dials the socket at the path the plugin reports: the node's path, in the pod too
    hosts = {v["name"]: v["hostPath"]["path"] for v in ps["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert (
        hosts
        == {k: mounts[k] for k in hosts}
        == {
            "plugins-registry": "/data/kubelet/plugins_registry",
            "plugin-dir": "/data/kubelet/plugins/gpu.gpupack.io",
            "cdi": "/etc/cdi",
        }
    )
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # every gpupack command's args parsed by its real parser, ports, selectors, the schemas of 1.35
    errs = [e for e in _validate(objs) if not any(b in e for b in VALIDATOR_BLIND_SPOTS)]
    assert errs == []


@pytest.mark.parametrize("client", realhelm.CLIENTS)
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "devicePlugin.mode=DRA"], "mode"),
        (["--set", "devicePlugin.dra.cdiDir=run/cdi"], "cdiDir"),
        (["--set", "devicePlugin.dra.extraArgs={x}"], "extraArgs"),
        (["--set", "devicePlugin.dra.cdiDirr=/x"], "cdiDirr"),
    ],
)
def test_a_misspelt_or_mistyped_dra_value_is_refused(client, args, says, tmp_path):
    r = helm(client, "template", "gpupack", str(CHART), "--kube-version", "1.36.2", *args, home=tmp_path,
             check=False)  # fmt: skip
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert says in r.stderr, r.stderr


def test_refused_offline_for_a_cluster_without_dra(tmp_path):
    # Helm 3 knows no resource.k8s.io/v1 of its own: an older --kube-version without the API stops
    # (Helm 4's built-in API list has it: against a real server both are refused, below)
    r = helm("helm3", "template", "gpupack", str(CHART), "--kube-version", "1.32.4", *DRA, home=tmp_path,
             check=False)  # fmt: skip
    assert r.returncode != 0 and REFUSAL in r.stderr and "set devicePlugin.mode=device-plugin" in r.stderr
    assert "Kubernetes v1.32.4 does not serve" in r.stderr, r.stderr
    # ... and where the cluster serves it, it renders (gpupack allocating needs 1.36: below)
    render("helm3", "--kube-version", "1.32.4", "--api-versions", "resource.k8s.io/v1", *DRA,
           "--set", "devicePlugin.dra.allocate=false", home=tmp_path)  # fmt: skip


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_allocate_is_refused_where_no_mutating_admission_policy_is_served(client, tmp_path):
    # DRA served (1.34-1.35) but no MutatingAdmissionPolicy v1: stops, and says what to set
    dra = ("--kube-version", "1.35.0", "--api-versions", "resource.k8s.io/v1", *DRA)
    r = helm(client, "template", "gpupack", str(CHART), *dra, home=tmp_path, check=False)
    assert r.returncode != 0 and ALLOCATE_REFUSAL in r.stderr, r.stderr
    assert "Kubernetes v1.35.0 does not serve: set devicePlugin.dra.allocate=false" in r.stderr, r.stderr
    objs = render(client, *dra, "--set", "devicePlugin.dra.allocate=false", home=tmp_path)
    assert not _names(objs) & ALLOCATE_OBJECTS
    # ... and where the server serves it, it renders
    served = render(client, *dra, "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
                    home=tmp_path)  # fmt: skip
    assert _names(served) >= ALLOCATE_OBJECTS


def _serves_dra(cluster: realk8s.ControlPlane) -> bool:
    try:
        return any(
            r["name"] == "deviceclasses" for r in cluster._get("/apis/resource.k8s.io/v1")["resources"]
        )
    except Exception:  # 404 before 1.34
        return False


def _clear_dra_leftovers(cluster: realk8s.ControlPlane) -> None:
    """What tests/draplugin applies of deploy/dra with kubectl, should it still be there: Helm would
    refuse to take it over."""
    cluster.kubectl(
        "delete", "deviceclasses.resource.k8s.io", "gpupack-online", "gpupack-offline", "--ignore-not-found"
    )
    cluster.kubectl("delete", "validatingadmissionpolicies.admissionregistration.k8s.io,"
                    "validatingadmissionpolicybindings.admissionregistration.k8s.io",
                    "gpupack-dra-plugin-own-node", "--ignore-not-found")  # fmt: skip
    cluster.kubectl("delete", "clusterrole,clusterrolebinding", "gpupack-dra-plugin", "--ignore-not-found")
    # deploy/examples/dra-allocate-gate.yaml (tests/extender/dra)
    cluster.kubectl("delete", "mutatingadmissionpolicies.admissionregistration.k8s.io,"
                    "mutatingadmissionpolicybindings.admissionregistration.k8s.io",
                    "gpupack-dra-allocate-gate", "--ignore-not-found", check=False)  # fmt: skip
    cluster.kubectl("delete", "validatingadmissionpolicies.admissionregistration.k8s.io,"
                    "validatingadmissionpolicybindings.admissionregistration.k8s.io",
                    "gpupack-dra-allocate-gate-kept", "--ignore-not-found")  # fmt: skip
    cluster.kubectl("delete", "clusterrole,clusterrolebinding", "gpupack-dra-allocator", "--ignore-not-found")


def test_switched_to_dra_by_upgrade_or_refused_without_it(cluster, tmp_path):
    h = Helm("helm", cluster, tmp_path)
    s = deploy_objects.suffix()
    ns, release = f"gpupack-dra-{s}", f"gpupack-{s}"
    _clear_leftovers(cluster)
    cluster.ensure_namespace(ns, NS_LABELS)
    if not _serves_dra(cluster):
        for client in realhelm.CLIENTS:  # Helm 4 and 3 read the server's APIs alike
            r = Helm(client, cluster, tmp_path)("install", release, str(CHART), "-n", ns, *DRA, check=False)
            assert r.returncode != 0 and REFUSAL in r.stderr, r.stderr
            assert h("list", "-n", ns, "-q").stdout.strip() == ""
            assert _gpupack_admission(cluster) == []
        return
    _clear_dra_leftovers(cluster)
    h("install", release, str(CHART), "-n", ns)
    before = h.manifest(release, ns)
    # an operator moving to DRA: one value; the device plugin's objects go, the DRA plugin's come
    out = h("upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values", *DRA).stdout
    notes = out.split("\nNOTES:\n", 1)[1]
    assert "DRA plugin (gpupack dra-plugin" in notes and "gpupack-online" in notes, notes
    assert "gpupack.io/gpu-mem (MiB)" not in notes, notes
    assert "gpupack allocates the claims (devicePlugin.dra.allocate)" in notes, notes
    after = h.manifest(release, ns)
    assert _names(before) - _names(after) == DEVICE_PLUGIN_OBJECTS
    assert _names(after) - _names(before) == DRA_OBJECTS | ALLOCATE_OBJECTS  # gpupack allocating: on
    extender = _containers(after, "Deployment", "gpupack-scheduler")["extender"]["args"]
    assert {"--dra-allocate", "--dra-place-pods"} <= set(extender)
    live = _live(cluster, after)
    assert len(live) == len(after)  # every object accepted by the API server
    assert (
        _live(cluster, [o for o in before if (o["kind"], o["metadata"]["name"]) in DEVICE_PLUGIN_OBJECTS])
        == {}
    )
    sa = f"system:serviceaccount:{ns}:gpupack-dra-plugin"
    (vap,) = [o for o in live.values() if o["kind"] == "ValidatingAdmissionPolicy"
              and o["metadata"]["name"] == "gpupack-dra-plugin-own-node"]  # fmt: skip
    assert sa in vap["spec"]["matchConditions"][0]["expression"]
    (kept,) = [o for o in live.values() if o["kind"] == "ValidatingAdmissionPolicy"
               and o["metadata"]["name"] == "gpupack-dra-allocate-gate-kept"]  # fmt: skip
    assert f"system:serviceaccount:{ns}:gpupack-extender" in kept["spec"]["validations"][0]["expression"]
    h("uninstall", release, "-n", ns, "--wait")
    assert _live(cluster, after) == {}
    assert _gpupack_admission(cluster) == []
