"""deploy/: renders, validates against Kubernetes schemas and this repo's code, and breaks loudly.

The checks are the developer tool `python -m tools.validate_deploy`. The real `kubectl kustomize`
renders wherever a kubectl can be had (../shared/k8s's, checksum-verified, else PATH); the tool's
fallback renderer, what a machine without kubectl gets, is checked against it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import realk8s
import yaml

pytest.importorskip("kubernetes_validate", reason="needs the test extra: pip install -e '.[test]'")

from deviceplugin import kube as plugin_kube  # noqa: E402
from tools import kustomize  # noqa: E402
from tools import validate_deploy as V  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VERSIONS = ("1.30", "1.32", "1.35")


def _kubectl() -> str | None:
    if realk8s.assets_dir() is not None:
        return str(realk8s.binary("kubectl"))
    return shutil.which("kubectl")


KUBECTL = _kubectl()
RENDERERS = ["python"] + (["kubectl"] if KUBECTL else [])


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize.render(DEPLOY, "auto", KUBECTL)


@pytest.fixture(scope="module")
def examples() -> list[dict]:
    return kustomize.render(DEPLOY / "examples", "auto", KUBECTL)


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("where", ["", "examples"])
def test_renders_and_validates(renderer, where):
    n, errs = V.validate_dir(DEPLOY / where, renderer, VERSIONS, KUBECTL)
    assert errs == []
    assert n >= 7


@pytest.mark.slow
def test_cli_exit_codes(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "tools.validate_deploy", "--k8s", "1.2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no strict schemas for Kubernetes 1.2" in bad.stderr
    assert "Traceback" not in bad.stderr
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml]\n")
    (tmp_path / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, namespace: n}\nbogus: 1\n"
    )
    broken = subprocess.run(
        [sys.executable, "-m", "tools.validate_deploy", "--k8s", "1.32", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "'bogus' was unexpected" in broken.stdout and "Traceback" not in broken.stderr
    no_kubectl = subprocess.run(
        [sys.executable, "-m", "tools.validate_deploy", "--kubectl", str(tmp_path / "none"), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert no_kubectl.returncode == 1 and "No such file" in no_kubectl.stdout, no_kubectl.stdout
    assert "Traceback" not in no_kubectl.stderr


@pytest.mark.skipif(
    KUBECTL is None, reason="no kubectl (../shared/k8s, or on PATH) to check the fallback against"
)
@pytest.mark.parametrize("where", ["", "examples"])
def test_python_renderer_agrees_with_kubectl_kustomize(where):
    def key(o: dict) -> tuple:
        return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])

    ours = sorted(kustomize.render_python(DEPLOY / where), key=key)
    theirs = sorted(kustomize.render_kubectl(DEPLOY / where, KUBECTL), key=key)
    assert [key(o) for o in ours] == [key(o) for o in theirs]
    assert ours == theirs


# --- what the issue asks of the manifests ------------------------------------------------------
def test_device_plugin_daemonset(base):
    ds = find(base, "DaemonSet", "gpupack-device-plugin")
    spec = ds["spec"]["template"]["spec"]
    host = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # nothing it does not use (issue 11); the kubelet's PodResources API for PreStartContainer (issue 31)
    assert host == {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"}
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] and spec["affinity"]["nodeAffinity"]
    c = spec["containers"][0]
    assert c["command"] == ["gpupack", "device-plugin"]
    podres = {m["name"]: m for m in c["volumeMounts"]}["pod-resources"]
    assert podres["mountPath"] == "/var/lib/kubelet/pod-resources" and podres["readOnly"] is True
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in c["args"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["livenessProbe"] and c["readinessProbe"]


def test_scheduler_config_names_the_extender(base):
    cm = find(base, "ConfigMap", "gpupack-scheduler-config")
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    (ext,) = cfg["extenders"]
    # asked about every pod of the profile (CPU-only ones too); kube-scheduler leaves gpupack's
    # resources to it
    assert "managedResources" not in ext and ext["ignorable"] is False
    (prof,) = [p for p in cfg["profiles"] if p["schedulerName"] == "gpupack-scheduler"]
    (fit,) = [c for c in prof["pluginConfig"] if c["name"] == "NodeResourcesFit"]
    assert fit["args"]["ignoredResourceGroups"] == ["gpupack.io"]
    assert fit["args"]["scoringStrategy"]["type"] == "LeastAllocated"
    # the extender checks node resources instead of kube-scheduler's filter (its scoring stays)
    assert prof["plugins"] == {"filter": {"disabled": [{"name": "NodeResourcesFit"}]}}
    assert ext["nodeCacheCapable"] is True and ext["weight"] > 0 and ext["httpTimeout"]
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    dep = find(base, "Deployment", "gpupack-scheduler")
    names = [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
    # the sidecar design (the autoscale component patches containers/1: the extender), and the
    # extender's token minter
    assert names == ["kube-scheduler", "extender", "extender-token"]


def test_the_extender_holds_only_its_own_accounts_token(base):
    """Issue 31: the pod's token (gpupack-scheduler) reaches kube-scheduler, the certificate step
    and the minter only; the extender gets a token of gpupack-extender, minted for it, dying with
    the pod, in memory, shared with the minter alone; the minter listens on nothing."""
    spec = find(base, "Deployment", "gpupack-scheduler")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "gpupack-scheduler" and spec["automountServiceAccountToken"] is False
    for sa in ("gpupack-scheduler", "gpupack-extender"):
        assert find(base, "ServiceAccount", sa)["automountServiceAccountToken"] is False
    vols = {v["name"]: v for v in spec["volumes"]}
    (tok,) = [s["serviceAccountToken"] for s in vols["kube-api-access"]["projected"]["sources"]
              if "serviceAccountToken" in s]  # fmt: skip
    assert tok["path"] == "token" and "audience" not in tok
    assert vols["extender-token"]["emptyDir"]["medium"] == "Memory"
    every = spec["initContainers"] + spec["containers"]
    mounts = {c["name"]: {m["name"]: m for m in c.get("volumeMounts") or []} for c in every}
    with_pod_token = {c for c, m in mounts.items() if "kube-api-access" in m}
    assert with_pod_token == {"webhook-certs", "kube-scheduler", "extender-token-init", "extender-token"}
    assert {c for c, m in mounts.items() if "extender-token" in m} == {"extender", "extender-token-init",
                                                                      "extender-token"}  # fmt: skip
    assert mounts["extender"]["extender-token"]["readOnly"] is True
    ext = next(c for c in every if c["name"] == "extender")
    kubeconfig = next(a.split("=", 1)[1] for a in ext["args"] if a.startswith("--kubeconfig="))
    assert kubeconfig == mounts["extender"]["extender-token"]["mountPath"] + "/kubeconfig"
    init = next(c for c in every if c["name"] == "extender-token-init")
    side = next(c for c in every if c["name"] == "extender-token")
    for m in (init, side):
        assert m["command"] == ["python", "-m", "gpupack.token"] and "ports" not in m
        assert "--service-account=gpupack-extender" in m["args"]
        assert f"--out-dir={mounts['extender']['extender-token']['mountPath']}" in m["args"]
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in m["env"]}
        assert env == {
            "POD_NAMESPACE": "metadata.namespace",
            "POD_NAME": "metadata.name",
            "POD_UID": "metadata.uid",
        }
        assert m["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["args"] == side["args"] + ["--once"]
    # the extender's token: at most an hour (the minter replaces it at half its life)
    expiry = int(next(a.split("=", 1)[1] for a in side["args"] if a.startswith("--expiry-s=")))
    assert 600 <= expiry <= 3600
    # the minter may mint that account's tokens only
    role = find(base, "Role", "gpupack-extender-token")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["serviceaccounts/token"],
                              "resourceNames": ["gpupack-extender"], "verbs": ["create"]},
                             {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]  # fmt: skip


def test_webhooks_get_their_ca_without_an_operator(base):
    dep = find(base, "Deployment", "gpupack-scheduler")
    init = next(c for c in dep["spec"]["template"]["spec"]["initContainers"] if c["name"] == "webhook-certs")
    assert init["command"] == ["python", "-m", "gpupack.certs"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        wc = find(base, kind, "gpupack")
        assert (
            f"--{kind.removesuffix('WebhookConfiguration').lower()}-webhook-configuration=gpupack"
            in init["args"]
        )
        # every webhook fails closed, the device plugin's node check too: on Kubernetes 1.28-1.29
        # it is the only check that the plugin writes its own node (issue 31 item 4)
        assert all(h["matchConditions"] and h["failurePolicy"] == "Fail" for h in wc["webhooks"])
        # a stalled webhook refuses the plugin's write before the plugin's own API timeout
        for hook in wc["webhooks"]:
            if hook["name"] == "plugin-node.gpupack.io":
                assert hook["timeoutSeconds"] < plugin_kube.TIMEOUT_S


def test_examples_cover_inference_hpa_batch_and_pdb(examples):
    dep = find(examples, "Deployment", "llm-7b")
    pod = dep["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert {"gpupack.io/gpu-mem", "gpupack.io/gpu-sm"} <= set(limits)
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    assert any(m["mountPath"] == "/dev/shm" for m in pod["containers"][0]["volumeMounts"])
    assert (
        pod["containers"][0]["startupProbe"]["failureThreshold"]
        * pod["containers"][0]["startupProbe"]["periodSeconds"]
        >= 300
    )
    hpa = find(examples, "HorizontalPodAutoscaler", "llm-7b")
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600
    assert find(examples, "PodDisruptionBudget", "llm-7b")
    job = find(examples, "Job", "eval-batch")
    assert job["spec"]["template"]["metadata"]["labels"]["gpupack.io/class"] == "offline"


# --- negative: a broken manifest must fail ----------------------------------------------------------
BREAKAGES = [
    # (file, old, new, expected problem)
    (
        "deviceplugin/daemonset.yaml",
        "      priorityClassName: system-node-critical\n",
        "      priorityClassName: system-node-critical\n      hostNetwork: yes-please\n",
        "schema: spec/template/spec/hostNetwork",
    ),
    (
        "deviceplugin/daemonset.yaml",
        "      priorityClassName: system-node-critical\n",
        "      priorityClassName: system-node-critical\n      nodeSelectr: {}\n",
        "'nodeSelectr' was unexpected",
    ),
    (
        "scheduler/deployment.yaml",
        "--tls-cert=/tls/tls.crt",
        "--tls-cert-file=/tls/tls.crt",
        "gpupack extender rejects its args",
    ),
    (
        "scheduler/deployment.yaml",
        "--tls-key=/tls/tls.key",
        "--tls-key=/etc/tls/tls.key",
        "is not under any volumeMount",
    ),
    (
        "scheduler/deployment.yaml",
        "--webhook-port=8443",
        "--webhook-port=9443",
        "is not a declared containerPort",
    ),
    ("deviceplugin/daemonset.yaml", "port: metrics\n", "port: metric\n", "is not a named container port"),
    (
        "scheduler/config.yaml",
        'ignoredResourceGroups: ["gpupack.io"]',
        'ignoredResourceGroups: ["gpupack.com"]',
        "does not ignore gpupack.io/gpu, gpupack.io/gpu-mem, gpupack.io/gpu-sm",
    ),
    (
        "scheduler/config.yaml",
        'ignoredResourceGroups: ["gpupack.io"]',
        'ignoredResources: ["gpupack.io/gpu", "gpupack.io/gpu-mem"]',
        "does not ignore gpupack.io/gpu-sm",
    ),
    (
        "scheduler/config.yaml",
        'ignoredResourceGroups: ["gpupack.io"]',
        'ignoredResourceGroups: ["gpupack.io", "example.com"]',
        "ignores example.com, which has no effect while its filter is disabled",
    ),
    (
        "scheduler/config.yaml",
        "              - name: NodeResourcesFit\n        pluginConfig:",
        "              - name: '*'\n        pluginConfig:",
        "turns off every kube-scheduler filter",
    ),
    (
        "scheduler/config.yaml",
        "        ignorable: false\n",
        "        ignorable: false\n        managedResources:\n          - name: gpupack.io/gpu\n"
        "            ignoredByScheduler: true\n",
        "managedResources must not be set",
    ),
    (
        "scheduler/config.yaml",
        "              scoringStrategy:",
        "              scoringStrategyy:",
        "unknown field 'scoringStrategyy'",
    ),
    (
        "scheduler/config.yaml",
        "httpTimeout: 15s",
        "httpTimeout: 5s",
        "must exceed the extender's worst bind: --bind-wait-s 4 + 5 x --api-timeout-s 2 = 14 s",
    ),
    (
        "scheduler/config.yaml",
        "urlPrefix: http://127.0.0.1:8888",
        "urlPrefix: http://127.0.0.1:8080",
        "urlPrefix port",
    ),
    ("scheduler/config.yaml", "bindVerb: bind", "bindVerb: bnd", "serves no /bnd"),
    (
        "scheduler/config.yaml",
        "nodeCacheCapable: true",
        "nodeCacheCapable: true\n        nodeCache: true",
        "unknown field 'nodeCache'",
    ),
    (
        "scheduler/deployment.yaml",
        "--config=/etc/gpupack-scheduler/config.yaml",
        "--config=/etc/gpupack-scheduler/cfg.yaml",
        "has no key 'cfg.yaml'",
    ),
    ("webhook/webhooks.yaml", "path: /mutate", "path: /mutating", "is not served by the extender"),
    (
        "webhook/webhooks.yaml",
        "        name: gpupack-webhook\n        namespace: gpupack-system\n        path: /mutate",
        "        name: gpupack-hook\n        namespace: gpupack-system\n        path: /mutate",
        "Service gpupack-system/gpupack-hook not found",
    ),
    ("scheduler/service.yaml", "targetPort: webhook", "targetPort: webhooks", "targetPort 'webhooks'"),
    ("scheduler/networkpolicy.yaml", "port: sched-metrics", "port: scheduler-metrics", "is not a named port"),
    (
        "scheduler/rbac.yaml",
        "  name: gpupack-extender\nrules:",
        "  name: gpupack-extendr\nrules:",
        "roleRef ClusterRole/gpupack-extender not found",
    ),
    (
        "deviceplugin/daemonset.yaml",
        "serviceAccountName: gpupack-device-plugin",
        "serviceAccountName: gpupack-dp",
        "has no ServiceAccount",
    ),
    ("kustomization.yaml", "newTag: v1.32.4", "newTag: latest", "is not pinned"),
    (
        "kustomization.yaml",
        "  - deviceplugin/service.yaml\n",
        "  - deviceplugin/service.yaml\n  - deviceplugin/missing.yaml\n",
        "missing.yaml",
    ),
    ("namespace.yaml", "  name: gpupack-system\n", "  name: gpupack-system\n   labels: [\n", "YAML"),
    (
        "examples/online-inference.yaml",
        'gpupack.io/gpu-sm: "40"',
        'gpupack.io/gpu-sms: "40"',
        "unknown gpupack resource",
    ),
    (
        "examples/online-inference.yaml",
        'gpupack.io/gpu-sm: "40"',
        'gpupack.io/gpu-sm: "140"',
        "must be 1..100",
    ),
    (
        "examples/online-inference-hpa.yaml",
        "    name: llm-7b\n  minReplicas",
        "    name: llm-8b\n  minReplicas",
        "scaleTargetRef Deployment/llm-8b not found",
    ),
    (
        "examples/online-inference-pdb.yaml",
        "app.kubernetes.io/name: llm-7b",
        "app.kubernetes.io/name: llm",
        "matches no pod",
    ),
]


# The python renderer is checked against kubectl above, so every breakage runs through it; the
# ones that break rendering itself run through kubectl too.
CASES = [(b, "python") for b in BREAKAGES] + [
    (b, "kubectl") for b in BREAKAGES if "kubectl" in RENDERERS and b[3] in ("missing.yaml", "YAML")
]


@pytest.mark.parametrize("breakage,renderer", CASES, ids=[f"{r}-{b[3][:40]}" for b, r in CASES])
def test_a_broken_manifest_fails(tmp_path, breakage, renderer):
    path, old, new, expect = breakage
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("__pycache__"))
    f = copy / path
    text = f.read_text()
    assert old in text, f"{path} no longer contains {old!r}: update this test"
    f.write_text(text.replace(old, new, 1))
    where = copy / "examples" if path.startswith("examples/") else copy
    _, errs = V.validate_dir(where, renderer, ("1.32",), KUBECTL)
    assert any(expect in e for e in errs), errs


def test_every_component_folder_is_in_the_base():
    """A component's manifests in a sub-kustomization (e.g. deploy/defrag/) must be installed too."""
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    included = {str(r).split("/")[0] for r in k["resources"]}
    for sub in DEPLOY.iterdir():
        opt_in = (sub / "kustomization.yaml").is_file() and "kind: Component" in (
            sub / "kustomization.yaml"
        ).read_text()
        if sub.is_dir() and sub.name != "examples" and not opt_in and any(sub.glob("*.yaml")):
            assert sub.name in included, f"deploy/{sub.name}/ is not in deploy/kustomization.yaml"


@pytest.mark.skipif(KUBECTL is None, reason="kustomize Components need the real kubectl kustomize")
def test_the_autoscale_component_renders_validates_and_starts_the_controller(tmp_path):
    """deploy/autoscale/ (opt-in, a kustomize Component) switched on as the operator guide says."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    k = yaml.safe_load((copy / "kustomization.yaml").read_text())
    k["components"] = ["autoscale"]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(k))
    n, errs = V.validate_dir(copy, "kubectl", VERSIONS, KUBECTL)
    assert errs == [] and n >= 7
    objs = kustomize.render(copy, "kubectl", KUBECTL)
    dep = find(objs, "Deployment", "gpupack-scheduler")
    (ext,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
    assert "--autoscale-templates=gpupack-system/gpupack-node-templates" in ext["args"]
    assert find(objs, "Role", "gpupack-autoscale")["metadata"]["namespace"] == "gpupack-system"


# who may reach each network port of gpupack's pods (issue 31): the metrics ports only from
# namespaces labelled as scrapers, the webhook only from the ipBlocks an operator narrows to the API
# server, and the extender's verbs (loopback) from nobody
SCRAPERS = [{"namespaceSelector": {"matchLabels": {"gpupack.io/metrics-scraper": "true"}}}]
WHO = {
    "metrics": "scrapers",
    "sched-metrics": "scrapers",
    "webhook": "ipBlocks",
    "extender": "nobody",
}


def test_network_policies_admit_each_port_only_from_who_needs_it(base):
    policies = [o for o in base if o["kind"] == "NetworkPolicy"]
    workloads = [o for o in base if o["kind"] in ("Deployment", "DaemonSet")]
    seen: set[tuple[str, str]] = set()
    for w in workloads:
        tpl = w["spec"]["template"]
        labels = tpl["metadata"].get("labels") or {}
        mine = [
            p for p in policies
            if p["metadata"]["namespace"] == w["metadata"]["namespace"]
            and all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())
        ]  # fmt: skip
        ports = [p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports") or []]
        if not ports:
            continue
        assert not tpl["spec"].get("hostNetwork"), (
            f"{w['metadata']['name']}: a policy cannot guard host ports"
        )
        assert len(mine) == 1 and mine[0]["spec"]["policyTypes"] == ["Ingress"], w["metadata"]["name"]
        rules = mine[0]["spec"]["ingress"]
        for port in ports:
            admitting = [r for r in rules if any(p["port"] == port for p in r.get("ports") or [])]
            want = WHO[port]
            seen.add((w["metadata"]["name"], port))
            if want == "nobody":
                assert not admitting, (w["metadata"]["name"], port)
                continue
            assert len(admitting) == 1, (w["metadata"]["name"], port)
            frm = admitting[0]["from"]
            if want == "scrapers":
                assert frm == SCRAPERS, (w["metadata"]["name"], port, frm)
            else:
                assert frm and all(set(f) == {"ipBlock"} for f in frm), (w["metadata"]["name"], port, frm)
        # no rule admits a port the pod does not name (nor every port: a rule without ports)
        assert all(r.get("ports") for r in rules), w["metadata"]["name"]
    assert {("gpupack-device-plugin", "metrics"), ("gpupack-scheduler", "webhook")} <= seen
