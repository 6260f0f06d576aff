"""The Helm chart's values, rendered offline by both real Helm clients (v4 and v3): `helm lint
--strict`, the schema's refusals, and what each value operators change does to the objects.

No API server: `--kube-version` and `--api-versions` stand for the cluster. The chart against the
real API server is tests/deploy/test_chart_apiserver.py; the defaults against deploy/ are
tests/deploy/test_chart_matches_deploy.py.
"""

from __future__ import annotations

import pytest
import realhelm
import yaml
from chart_objects import (
    CHART,
    helm,
    helm_assets,  # noqa: F401 (a fixture, used by pytestmark)
    render,
)

# without the Helm binaries: skipped, or failed where CI requires them
pytestmark = pytest.mark.usefixtures("helm_assets")
VAP = "admissionregistration.k8s.io/{}/ValidatingAdmissionPolicy"


def _one(objs: list[dict], kind: str, name: str) -> dict:
    (o,) = [x for x in objs if x["kind"] == kind and x["metadata"]["name"] == name]
    return o


def _containers(objs: list[dict], kind: str, name: str) -> dict[str, dict]:
    o = _one(objs, kind, name)
    spec = o["spec"]["jobTemplate"]["spec"] if kind == "CronJob" else o["spec"]
    ps = spec["template"]["spec"]
    return {c["name"]: c for c in ps.get("initContainers", []) + ps["containers"]}


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_lint_strict_passes(client, tmp_path):
    assert realhelm.version(client)[0] == {"helm": 4, "helm3": 3}[client]  # both lines users run
    r = helm(client, "lint", "--strict", str(CHART), home=tmp_path)
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout, r.stdout
    # --strict turns warnings into failures; an [INFO] (no icon) is all that may be said
    assert "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout, r.stdout
    # the packaged chart (what a release publishes) renders what the folder renders
    helm(client, "package", str(CHART), "-d", str(tmp_path / "pkg"), home=tmp_path)
    (tgz,) = (tmp_path / "pkg").glob("gpupack-*.tgz")
    assert render(client, "--kube-version", "1.32.4", home=tmp_path, chart=tgz) == render(
        client, "--kube-version", "1.32.4", home=tmp_path
    )


@pytest.mark.parametrize("client", realhelm.CLIENTS)
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "imagee.tag=x"], "imagee"),  # misspelt at the top
        (
            ["--set", "scheduler.profile.percentageOfNodesToscore=50"],
            "percentageOfNodesToscore",
        ),  # misspelt deep
        (["--set", "scheduler.replicas=two"], "replicas"),  # mistyped
        (["--set", "webhook.failurePolicy=fail"], "failurePolicy"),  # not one of Fail, Ignore
        (["--set", "defrag.window=1:00-5:00"], "window"),  # not HH:MM-HH:MM
        (["--set", "defrag.budget.maxWorkloadShare=2"], "maxWorkloadShare"),  # above 1
        (["--set", "scheduler.profile.extender.httpTimeout=15"], "httpTimeout"),  # not a duration
        (["--set", "networkPolicy.metricsPeers=null"], "metricsPeers"),  # a default deleted
        (["--set", "extender.bindWaitSeconds=null"], "bindWaitSeconds"),  # a default deleted
        (["--set-json", "networkPolicy.webhookPeers=[]"], "webhookPeers"),  # would admit everyone
    ],
)
def test_a_misspelt_or_mistyped_value_is_refused_naming_it(client, args, says, tmp_path):
    # (`helm install` refuses them the same way: tests/deploy/test_chart_apiserver.py)
    r = helm(client, "template", "gpupack", str(CHART), *args, home=tmp_path, check=False)
    assert r.returncode != 0, f"{args} was accepted"
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert says in r.stderr, r.stderr


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_kube_scheduler_follows_the_cluster_version(client, tmp_path):
    def image(*args: str) -> str:
        objs = render(client, "--skip-tests", *args, home=tmp_path)
        return _containers(objs, "Deployment", "gpupack-scheduler")["kube-scheduler"]["image"]

    assert image("--kube-version", "1.28.7", "--api-versions", VAP.format("v1beta1")) == (
        "registry.k8s.io/kube-scheduler:v1.28.7"
    )
    assert image("--kube-version", "v1.36.2") == "registry.k8s.io/kube-scheduler:v1.36.2"
    # a provider's build suffix is not part of the upstream image's tag
    assert image("--kube-version", "v1.30.4-eks-a737599") == "registry.k8s.io/kube-scheduler:v1.30.4"
    # an override wins, for a mirror too
    assert (
        image("--kube-version", "1.30.4", "--set", "scheduler.image.tag=v1.30.2",
              "--set", "scheduler.image.repository=mirror.example/kube-scheduler")
        == "mirror.example/kube-scheduler:v1.30.2"
    )  # fmt: skip


@pytest.mark.parametrize("client", realhelm.CLIENTS)
def test_admission_policies_use_the_api_version_the_server_serves(client, tmp_path):
    def versions(*args: str) -> set[str]:
        objs = render(client, "--skip-tests", *args, home=tmp_path)
        return {o["apiVersion"] for o in objs if o["kind"].startswith("ValidatingAdmissionPolicy")}

    assert versions("--kube-version", "1.36.2", "--api-versions", VAP.format("v1")) == {
        "admissionregistration.k8s.io/v1"
    }
    # 1.28-1.29 with the gate on serve v1beta1 only
    assert versions("--kube-version", "1.28.7", "--api-versions", VAP.format("v1beta1")) == {
        "admissionregistration.k8s.io/v1beta1"
    }
    # offline, without --api-versions: v1 from 1.30, where it is on by default
    assert versions("--kube-version", "1.31.0") == {"admissionregistration.k8s.io/v1"}
    assert versions("--kube-version", "1.28.7", "--set", "admissionPolicies.enabled=false") == set()
    # a 1.28 that serves none: the install stops and says what to do
    r = helm(
        client, "template", "gpupack", str(CHART), "--kube-version", "1.28.7", home=tmp_path, check=False
    )
    assert r.returncode != 0
    assert (
        "serves no ValidatingAdmissionPolicy API" in r.stderr
        and "admissionPolicies.enabled=false" in r.stderr
    )


def test_values_reach_the_objects(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": "registry.example/gpupack", "tag": "9.9.9", "pullPolicy": "Always"},
        "logFormat": "json",
        "scheduler": {"replicas": 3, "profile": {"extender": {"weight": 5, "httpTimeout": "20s"}}},
        "extender": {"preemption": {"enabled": True, "intervalSeconds": 5}, "extraArgs": ["--bind-concurrency=32"]},
        "webhook": {"failurePolicy": "Ignore", "certificates": {"certDays": 90, "secretName": "my-tls"}},
        "devicePlugin": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                         "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}}},
        "defrag": {"schedule": "0 3 * * *", "objective": "nodes", "window": "02:00-06:00",
                   "budget": {"maxEvictions": 3}, "pushgateway": "http://pgw.monitoring.svc:9091"},
        "autoscale": {"enabled": True, "nodeTemplates": "apiVersion: v1\nkind: List\nitems: []\n"},
        "networkPolicy": {"webhookPeers": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]},
    }))  # fmt: skip
    objs = render("helm", "--skip-tests", "--kube-version", "1.32.4", "-f", str(values), home=tmp_path)
    sched = _containers(objs, "Deployment", "gpupack-scheduler")
    ext = sched["extender"]
    assert ext["image"] == "registry.example/gpupack:9.9.9" and ext["imagePullPolicy"] == "Always"
    assert {"--preemption-interval-s=5", "--bind-concurrency=32",
            "--autoscale-templates=gpupack-system/gpupack-node-templates"} <= set(ext["args"])  # fmt: skip
    assert {"name": "GPUPACK_LOG_FORMAT", "value": "json"} in ext["env"]
    assert {"--secret=my-tls", "--cert-days=90"} <= set(sched["webhook-certs"]["args"])
    assert _one(objs, "Deployment", "gpupack-scheduler")["spec"]["replicas"] == 3
    cfg = yaml.safe_load(_one(objs, "ConfigMap", "gpupack-scheduler-config")["data"]["config.yaml"])
    assert cfg["extenders"][0]["weight"] == 5 and cfg["extenders"][0]["httpTimeout"] == "20s"
    for hook in _one(objs, "MutatingWebhookConfiguration", "gpupack")["webhooks"]:
        assert hook["failurePolicy"] == "Ignore"
    # the state and plugin-node webhooks stay closed: they only ever refuse what is refused anyway
    vwc = {h["name"]: h for h in _one(objs, "ValidatingWebhookConfiguration", "gpupack")["webhooks"]}
    assert vwc["validate.pods.gpupack.io"]["failurePolicy"] == "Ignore"
    assert (
        vwc["state.pods.gpupack.io"]["failurePolicy"]
        == vwc["plugin-node.gpupack.io"]["failurePolicy"]
        == "Fail"
    )
    ds = _one(objs, "DaemonSet", "gpupack-device-plugin")["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"pool": "gpu"} and ds["tolerations"] == [
        {"key": "gpu", "operator": "Exists"}
    ]
    # a values file's map is merged into the default (Helm's rule): the limits stay
    assert ds["containers"][0]["resources"] == {"requests": {"cpu": "20m", "memory": "64Mi"},
                                                "limits": {"cpu": "1", "memory": "512Mi"}}  # fmt: skip
    cj = _one(objs, "CronJob", "gpupack-defrag")
    assert cj["spec"]["schedule"] == "0 3 * * *"
    assert {"--objective=nodes", "--window=02:00-06:00", "--max-evictions=3",
            "--pushgateway=http://pgw.monitoring.svc:9091"} <= set(_containers(objs, "CronJob", "gpupack-defrag")["defrag"]["args"])  # fmt: skip
    assert _one(objs, "ConfigMap", "gpupack-node-templates")["data"]["templates"].startswith(
        "apiVersion: v1\nkind: List"
    )
    assert _one(objs, "Role", "gpupack-autoscale")  # the autoscale RBAC comes with it
    np = _one(objs, "NetworkPolicy", "gpupack-scheduler")["spec"]["ingress"]
    assert np[0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]


def test_switches_turn_their_objects_off(tmp_path):
    base = {
        (o["kind"], o["metadata"]["name"])
        for o in render("helm", "--skip-tests", "--kube-version", "1.32.4", home=tmp_path)
    }
    off = render("helm", "--skip-tests", "--kube-version", "1.32.4", "--set", "defrag.enabled=false",
                 "--set", "networkPolicy.enabled=false", "--set", "extender.preemption.enabled=false", home=tmp_path)  # fmt: skip
    gone = base - {(o["kind"], o["metadata"]["name"]) for o in off}
    assert gone == {
        ("CronJob", "gpupack-defrag"), ("ServiceAccount", "gpupack-defrag"), ("ClusterRole", "gpupack-defrag"),
        ("ClusterRoleBinding", "gpupack-defrag"), ("Role", "gpupack-defrag-lease"), ("RoleBinding", "gpupack-defrag-lease"),
        ("NetworkPolicy", "gpupack-scheduler"), ("NetworkPolicy", "gpupack-device-plugin"),
    }  # fmt: skip
    assert (
        "--preemption-interval-s=0" in _containers(off, "Deployment", "gpupack-scheduler")["extender"]["args"]
    )


@pytest.mark.parametrize(
    ("bad", "says", "fixed"),
    [
        # the extender passes the best of the nodes it is shown: all of them, or a sample's best
        (["scheduler.profile.percentageOfNodesToScore=50"], "must be 100 while extender.filterKeepBest is 1",
         ["extender.filterKeepBest=0"]),
        # kube-scheduler would give up on a bind the extender still completes: 4 + 5 x 2 = 14 s
        (["scheduler.profile.extender.httpTimeout=14s"], "must exceed the extender's worst bind",
         ["extender.apiTimeoutSeconds=1.5"]),
        (["extender.bindWaitSeconds=10"], "must exceed the extender's worst bind",
         ["scheduler.profile.extender.httpTimeout=1m"]),
        # a defrag run whose worst case outlasts its Job is stopped mid-run
        (["defrag.budget.maxEvictions=12"], "must stay below activeDeadlineSeconds 3600",
         ["defrag.activeDeadlineSeconds=4000"]),
    ],
)  # fmt: skip
def test_values_that_contradict_each_other_are_refused(bad, says, fixed, tmp_path):
    sets = [a for v in bad for a in ("--set", v)]
    r = helm("helm", "template", "gpupack", str(CHART), *sets, home=tmp_path, check=False)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    render("helm", *sets, *[a for v in fixed for a in ("--set", v)], home=tmp_path)


def test_helm_test_pods_check_the_extender_and_the_webhook(tmp_path):
    objs = render("helm", "--kube-version", "1.32.4", "--namespace", "ops", home=tmp_path)
    hooks = [o for o in objs if (o["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    pods = {o["metadata"]["name"]: o for o in hooks if o["kind"] == "Pod"}
    assert set(pods) == {"gpupack-test-extender", "gpupack-test-webhook"}
    urls = {}
    for name, pod in pods.items():
        (c,) = pod["spec"]["containers"]
        script = c["args"][0]
        compile(script, name, "exec")  # the check itself is valid Python
        urls[name] = next(line.split('"')[1] for line in script.splitlines() if line.startswith("url = "))
    assert urls == {
        "gpupack-test-extender": "http://gpupack-scheduler-metrics.ops.svc:9090/readyz",
        "gpupack-test-webhook": "https://gpupack-webhook.ops.svc:443/readyz",
    }
    # the webhook check trusts only the CA the webhook configurations carry (the Secret's ca.crt)
    vol = pods["gpupack-test-webhook"]["spec"]["volumes"][0]["secret"]
    assert vol == {"secretName": "gpupack-webhook-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    # and a test-only NetworkPolicy lets the test pods past the scheduler's
    (np,) = [o for o in hooks if o["kind"] == "NetworkPolicy"]
    assert np["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpupack-helm-test"}}}
    ]


# Every switch on and every knob turned: what tools/validate_deploy.py holds deploy/ to, the
# chart's objects are held to as well (each gpupack command's args parsed by its real parser,
# ports, mounts, selectors, RBAC references, the scheduler configuration against the extender).
EVERYTHING = {
    "namespace": {"create": True},
    "logFormat": "json",
    "logLevel": "debug",
    "scheduler": {"profile": {"extender": {"weight": 3, "httpTimeout": "30s"}}},
    "extender": {
        "bindWaitSeconds": 6,
        "preemption": {"intervalSeconds": 7.5},
        "extraArgs": ["--bind-concurrency=32", "--no-warm-shapes"],
    },
    "webhook": {"certificates": {"caDays": 1000, "certDays": 100, "renewBeforeDays": 10}},
    "devicePlugin": {"enforcement": "mps", "kubeletDir": "/data/kubelet"},
    "defrag": {"objective": "nodes", "pushgateway": "http://pgw:9091", "extraArgs": ["--allow-jobs"]},
    "autoscale": {"enabled": True, "nodeTemplates": "apiVersion: v1\nkind: List\nitems: []\n"},
}


def _validate(objs: list[dict]) -> list[str]:
    import copy

    from tools.validate_deploy import schema_errors, semantic_errors

    errs = semantic_errors(objs)
    for o in objs:
        errs += schema_errors(copy.deepcopy(o), ("1.30", "1.32", "1.35"))
    return errs


def test_every_option_renders_objects_that_validate(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(EVERYTHING))
    objs = render("helm", "--kube-version", "1.32.4", "-f", str(values), home=tmp_path)
    assert _validate(objs) == []
    # ... and the check bites: a flag `gpupack extender` does not have is named
    objs = render(
        "helm", "--kube-version", "1.32.4", "--set", "extender.extraArgs={--no-such-flag=1}", home=tmp_path
    )
    (err,) = _validate(objs)
    assert "gpupack extender rejects its args" in err and "--no-such-flag" in err, err


def test_fractions_given_with_set_are_taken(tmp_path):
    # `--set x=0.3` hands the chart the text "0.3" (Helm types only whole numbers): accepted where a
    # fraction is, and written into the flag as given
    objs = render("helm", "--skip-tests", "--set", "defrag.budget.maxWorkloadShare=0.3",
                  "--set", "extender.preemption.intervalSeconds=0.5", home=tmp_path)  # fmt: skip
    assert "--max-workload-share=0.3" in _containers(objs, "CronJob", "gpupack-defrag")["defrag"]["args"]
    assert (
        "--preemption-interval-s=0.5"
        in _containers(objs, "Deployment", "gpupack-scheduler")["extender"]["args"]
    )


def test_a_digest_pins_every_gpupack_container(tmp_path):
    digest = "sha256:" + "ab" * 32
    objs = render("helm", "--skip-tests", "--set", f"image.digest={digest}", home=tmp_path)
    images = {
        c["image"]
        for kind, name in (("Deployment", "gpupack-scheduler"), ("DaemonSet", "gpupack-device-plugin"),
                           ("CronJob", "gpupack-defrag"))
        for c in _containers(objs, kind, name).values()
        if c["name"] != "kube-scheduler"
    }  # fmt: skip
    assert images == {f"gpupack@{digest}"}
