"""The autoscale controller against the real parts: control plane, kube-scheduler with gpupack's
profile, the `gpupack extender` process with its autoscale controller, and the unmodified
cluster-autoscaler 1.29.5 (kwok provider). The kubelets are emulated (ca_harness.NewNodeKubelet
for the nodes the autoscaler adds, the `kubelet` fixture for pods). The controller's own tests at
the end run it in this process against the real API server, one pass at a time, on a clock of
their own."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import realk8s
import yaml
from ca_harness import (
    GROUP_LABEL,
    Autoscaler,
    Group,
    NewNodeKubelet,
    events,
    existing_node,
    kwok_nodes,
    mark_unschedulable,
    share_pod,
    whole_pod,
    write_configmaps,
)
from ext_helpers import annotations, create_pod, list_pods
from kubernetes import client
from processes import ExtenderProcess
from prometheus_client import CollectorRegistry

from extender.controllers.autoscale import (
    BACKOFF_KEY,
    REASON_BACKOFF,
    REASON_NO_GROUP,
    AutoscaleConfig,
    AutoscaleController,
)
from extender.controllers.autoscale_groups import (
    ANN_PINNED,
    ANN_SCALE_DOWN_DISABLED,
    LABEL_PLACEHOLDER,
    OWNER_CONFIGMAP,
    placeholder_host,
)
from gpupack.contract import ANN_ASSIGNMENT, decode_assignment
from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient

pytestmark = pytest.mark.k8s
until = realk8s.until
H100 = Group("h100", "NVIDIA-H100-80GB-HBM3", 8, 81559)
A100 = Group("a100", "NVIDIA-A100-SXM4-40GB", 4, 40960)


@pytest.fixture
def stack(
    cluster: realk8s.ControlPlane, ns: str, sfx: str, kubeconfig, tmp_path, kubelet
) -> Iterator[Callable]:
    """start(groups) -> the running stack; everything it started is stopped after the test."""
    st = SimpleNamespace(procs=[], ca=None, ext=None)

    def start(groups: list[Group], with_ca: bool = True, rbac: bool = False, flags: tuple[str, ...] = (),
              templates: Callable[[str], str] | None = None) -> SimpleNamespace:  # fmt: skip
        sysns = f"gpupack-{sfx}"
        cluster.ensure_namespace(sysns, {"gpupack.io/webhook": "skip"})
        st.sysns = sysns
        st.templates = write_configmaps(cluster.core, sysns, groups)
        ext_kc = kubeconfig
        if rbac:  # the extender as the shipped ServiceAccount, with deploy/autoscale's RBAC too
            text = "\n---\n".join((realk8s.REPO / "deploy" / f).read_text()
                                   for f in ("scheduler/rbac.yaml", "autoscale/rbac.yaml", "scheduler/serviceaccount.yaml"))  # fmt: skip
            objs = [o for o in yaml.safe_load_all(text.replace("gpupack-system", sysns)) if o]
            # the cluster-wide bindings other tests applied name their own namespaces: taken over
            cluster.kubectl("apply", "--server-side", "--field-manager=gpupack-test", "--force-conflicts", "-f", "-",
                            input=yaml.safe_dump_all(objs))  # fmt: skip
            text = cluster.core.read_namespaced_config_map("kwok-provider-templates", sysns).data["templates"]
            cluster.core.create_namespaced_config_map(
                sysns, {"metadata": {"name": "gpupack-node-templates"}, "data": {"templates": text}}
            )
            st.templates = f"{sysns}/gpupack-node-templates"
            ext_kc = cluster.service_account_kubeconfig(tmp_path / "sa.kubeconfig", sysns, "gpupack-extender")
        st.flags = ("--log-level", "info", "--autoscale-templates", st.templates, "--autoscale-namespace", sysns,
                    "--autoscale-group-label", GROUP_LABEL, "--autoscale-interval-s", "1", *flags)  # fmt: skip
        st.ext = ExtenderProcess(ext_kc, tmp_path / "extender-0.log", *st.flags)
        st.ext.wait_ready()
        st.sched = cluster.start_scheduler(
            realk8s.gpupack_scheduler_config(st.ext.url), name="kube-scheduler"
        )
        st.procs.append(st.sched)
        st.kubelet = NewNodeKubelet(cluster, groups).__enter__()
        st.kubeconfig, st.tmp, st.cluster, st.ns = kubeconfig, tmp_path, cluster, ns
        if with_ca:
            st.ca = Autoscaler(cluster, sysns, tmp_path / "ca.log", kubeconfig)
        if templates is not None:  # gpupack's view of the groups, changed after the autoscaler read its own
            tns, tname = st.templates.split("/")
            text = cluster.core.read_namespaced_config_map(tname, tns).data["templates"]
            cluster.core.patch_namespaced_config_map(tname, tns, {"data": {"templates": templates(text)}})
        return st

    yield start
    if st.ca is not None:
        st.ca.stop()
    if st.ext is not None:
        st.ext.stop()
    for p in st.procs:
        p.stop()
    if getattr(st, "kubelet", None) is not None:
        st.kubelet.__exit__()
        assert not [e for e in st.kubelet.errors if "Conflict" not in e and "404" not in e], st.kubelet.errors


def diag(st: SimpleNamespace) -> str:
    ca = st.ca.text()[-4000:] if st.ca else ""
    return f"\n--- extender ---\n{st.ext.tail()}\n--- autoscaler ---\n{ca}"


def placeholders(st: SimpleNamespace) -> list[dict]:
    return [
        p
        for p in list_pods(st.cluster.core, st.sysns)
        if LABEL_PLACEHOLDER in p["metadata"].get("labels", {})
    ]


def all_bound(st: SimpleNamespace, n: int) -> list[dict] | None:
    pods = list_pods(st.cluster.core, st.ns)
    return pods if len(pods) == n and all(p["spec"].get("nodeName") for p in pods) else None


def fill(st: SimpleNamespace, names: list[str], per_gpu_mib: int, count: int, prefix: str) -> None:
    for i in range(count):
        create_pod(st.cluster.core, share_pod(f"{prefix}{i}", per_gpu_mib), st.ns)
    until(lambda: len([p for p in list_pods(st.cluster.core, st.ns) if p["spec"].get("nodeName")]) >= count, 90,
          what=f"{count} pods bound")  # fmt: skip


def over_committed(core: client.CoreV1Api, ns: str, capacity: dict[str, int]) -> list[str]:
    used: dict[str, int] = {}
    for p in list_pods(core, ns):
        raw = annotations(p).get(ANN_ASSIGNMENT)
        if raw and p["spec"].get("nodeName"):
            for shares in decode_assignment(raw).containers.values():
                for s in shares:
                    used[s.uuid] = used.get(s.uuid, 0) + s.mem_mib
    return [u for u, mib in used.items() if mib > capacity[u.split("-")[1]]]


def test_forty_share_pods_on_three_full_nodes_get_the_packed_count_of_nodes(stack, cluster):
    for i in range(3):
        existing_node(cluster, f"h100-old-{i}", H100)
    st = stack([H100])
    fill(st, [], H100.mem_mib, 24, "full-")  # one whole-memory share on each of the 24 GPUs
    for i in range(40):  # a quarter of a GPU each: 40 need 10 GPUs, 2 nodes at best
        create_pod(cluster.core, share_pod(f"burst-{i}", 20000, 25), st.ns)
    pods = until(lambda: all_bound(st, 64), 180, what="all 64 pods bound") or []
    added = kwok_nodes(cluster.core)
    added = [n for n in added if not n["metadata"]["name"].startswith("h100-old")]
    lower = math.ceil(40 / (4 * 8))
    assert lower <= len(added) <= lower + 1, f"{len(added)} nodes added{diag(st)}"
    assert {p["spec"]["nodeName"] for p in pods if p["metadata"]["name"].startswith("burst-")} <= {
        n["metadata"]["name"] for n in added
    }
    assert over_committed(cluster.core, st.ns, {"h100": H100.mem_mib}) == []
    until(lambda: not placeholders(st), 30, what="placeholders gone once the nodes took the pods")


def test_model_restricted_pods_get_a_node_of_their_models_group(stack, cluster):
    st = stack([H100, A100])
    for i in range(3):
        create_pod(cluster.core, share_pod(f"a-{i}", 30000, models=A100.model), st.ns)
    for i in range(2):
        create_pod(cluster.core, share_pod(f"h-{i}", 70000, models=H100.model), st.ns)
    pods = until(lambda: all_bound(st, 5), 120, what="all 5 pods bound") or []
    groups = {n["metadata"]["name"]: n["metadata"]["labels"][GROUP_LABEL] for n in kwok_nodes(cluster.core)}
    for p in pods:
        want = "a100" if p["metadata"]["name"].startswith("a-") else "h100"
        assert groups[p["spec"]["nodeName"]] == want, diag(st)
    assert sorted(groups.values()) == ["a100", "h100"], f"{groups}{diag(st)}"  # one node each suffices


def test_a_pod_that_fits_after_a_deletion_adds_no_node(stack, cluster):
    existing_node(cluster, "h100-old-0", H100)
    st = stack([H100])
    fill(st, [], H100.mem_mib, 8, "full-")
    cluster.core.delete_namespaced_pod("full-3", st.ns, grace_period_seconds=0)
    create_pod(cluster.core, share_pod("late", H100.mem_mib), st.ns)
    until(lambda: all_bound(st, 8), 60, what="the late pod bound")
    scans = st.ca.text().count("Starting scale down") + 3
    until(lambda: st.ca.text().count("Starting scale down") >= scans, 60, what="three more autoscaler loops")
    assert [n["metadata"]["name"] for n in kwok_nodes(cluster.core)] == ["h100-old-0"], diag(st)
    assert st.ca.scale_ups() == [] and not placeholders(st)


def test_scale_down_removes_the_emptied_nodes_and_never_a_node_whose_pod_has_no_other_place(stack, cluster):
    for name in ("keep-whole", "keep-full", "empty-0", "empty-1"):
        existing_node(cluster, name, H100)
    st = stack([H100], with_ca=False)
    # a whole GPU, owned by a ReplicaSet (so the autoscaler would drain its node), on keep-whole
    apps = client.AppsV1Api(cluster.api_client())
    tmpl = share_pod("x", 0)
    c = tmpl["spec"]["containers"][0]
    c["resources"] = {"limits": {"gpupack.io/gpu": "1"}, "requests": {"gpupack.io/gpu": "1"}}
    tmpl["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "keep-whole"}
    rs = {"metadata": {"name": "whole"}, "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "whole"}},
          "template": {"metadata": {"labels": {"app": "whole", "gpupack.io/class": "online"}}, "spec": tmpl["spec"]}}}  # fmt: skip
    apps.create_namespaced_replica_set(st.ns, rs)
    # keep-full: a big share on every GPU, so no whole GPU is free there
    for i in range(8):
        body = share_pod(f"big-{i}", 50000)
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "keep-full"}
        create_pod(cluster.core, body, st.ns)
    # the nodes night consolidation empties held pods until now
    for i in range(2):
        body = share_pod(f"night-{i}", 20000)
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": f"empty-{i}"}
        create_pod(cluster.core, body, st.ns)
    until(lambda: all_bound(st, 11), 60, what="11 pods bound")
    for i in range(2):
        cluster.core.delete_namespaced_pod(f"night-{i}", st.ns, grace_period_seconds=0)

    def pinned() -> bool:
        ann = json.loads(cluster.core.read_node("keep-whole", _preload_content=False).data)["metadata"][
            "annotations"
        ]
        return ann.get(ANN_SCALE_DOWN_DISABLED) == "true" and ANN_PINNED in ann

    until(pinned, 30, what="keep-whole marked")
    st.ca = Autoscaler(cluster, st.sysns, st.tmp / "ca.log", st.kubeconfig)
    until(lambda: sorted(n["metadata"]["name"] for n in kwok_nodes(cluster.core)) == ["keep-full", "keep-whole"],
          90, what="the two emptied nodes removed")  # fmt: skip
    scans = st.ca.text().count("Starting scale down") + 4
    until(lambda: st.ca.text().count("Starting scale down") >= scans, 60, what="four more autoscaler loops")
    assert sorted(n["metadata"]["name"] for n in kwok_nodes(cluster.core)) == ["keep-full", "keep-whole"], (
        diag(st)
    )
    assert "keep-whole" in st.ca.text() and "no scale down" in st.ca.text(), diag(st)
    # the mark goes once the pod could move: a node with a free whole GPU and a pod joins
    existing_node(cluster, "spare", H100)
    body = share_pod("spare-pod", 1000)
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "spare"}
    create_pod(cluster.core, body, st.ns)
    until(lambda: not pinned(), 60, what="keep-whole unmarked")


def test_restarts_mid_way_add_no_duplicate_nodes(stack, cluster):
    st = stack([H100], with_ca=False)
    for i in range(12):  # 12 whole-memory shares: 12 GPUs, 2 nodes
        create_pod(cluster.core, share_pod(f"p-{i}", H100.mem_mib), st.ns)
    until(lambda: len(placeholders(st)) == 2, 60, what="two placeholders")
    st.ext.stop()  # the extender restarts: it finds its placeholders and adds none
    st.ext = ExtenderProcess(st.kubeconfig, st.tmp / "extender-1.log", *st.flags, port=st.ext.port)
    st.ext.wait_ready()
    st.ca = Autoscaler(cluster, st.sysns, st.tmp / "ca.log", st.kubeconfig)
    until(lambda: st.ca.scale_ups(), 60, what="a scale-up")
    st.ca.stop()  # ... and the autoscaler, right after it acted
    st.ext.stop()
    st.ext = ExtenderProcess(st.kubeconfig, st.tmp / "extender-2.log", *st.flags, port=st.ext.port)
    st.ext.wait_ready()
    st.ca = Autoscaler(cluster, st.sysns, st.tmp / "ca-2.log", st.kubeconfig)
    until(lambda: all_bound(st, 12), 120, what="all 12 pods bound")
    assert len(kwok_nodes(cluster.core)) == 2, diag(st)
    assert len(placeholders(st)) <= 2


def test_the_controller_works_with_exactly_the_shipped_rbac(stack, cluster):
    existing_node(cluster, "h100-old-0", H100)
    st = stack([H100], rbac=True)
    fill(st, [], H100.mem_mib, 8, "full-")
    for i in range(4):
        create_pod(cluster.core, share_pod(f"more-{i}", 40000), st.ns)
    until(lambda: all_bound(st, 12), 120, what="all 12 pods bound")
    added = [n for n in kwok_nodes(cluster.core) if n["metadata"]["name"] != "h100-old-0"]
    assert len(added) == 1, diag(st)
    ann = json.loads(cluster.core.read_node("h100-old-0", _preload_content=False).data)["metadata"][
        "annotations"
    ]
    assert ann.get(ANN_SCALE_DOWN_DISABLED) == "true", diag(st)  # its pods fit no other node
    # the messages, not their timestamps (a line logged at hh:mm:ss,403 is no refusal)
    said = "\n".join(line.split(" ", 2)[-1] for line in st.ext.log.read_text().splitlines())
    assert "403" not in said and "Forbidden" not in said, diag(st)


# --- pods no node group can take -------------------------------------------------------------
IMPOSSIBLE = (  # two ask for 1,000 CPUs (a node has 64), one for a label no group carries
    whole_pod("imp-cpu-0", 8, cpu="1000"),
    whole_pod("imp-cpu-1", 8, cpu="1000"),
    whole_pod("imp-sel", 8, selector={"pool": "nowhere"}),
)


def test_pods_no_group_can_take_add_no_node_with_the_real_autoscaler(stack, cluster):
    st = stack([H100])
    for p in IMPOSSIBLE:
        create_pod(cluster.core, p, st.ns)

    def told() -> bool:
        return len({e["involvedObject"]["name"] for e in events(cluster.core, st.ns, REASON_NO_GROUP)}) == 3

    until(told, 60, what="an Event on each impossible pod")
    # the controller passes (1 s apart) and the autoscaler loops (2 s apart) several times over
    # the pending pods; GPUPACK_AUTOSCALE_SOAK_S keeps watching longer (a manual check)
    soak_loops = int(float(os.environ.get("GPUPACK_AUTOSCALE_SOAK_S", "0")) / 2)
    passes = st.ext.metric("gpupack_autoscale_passes_total ") + 5
    loops = st.ca.text().count("Starting main loop") + max(4, soak_loops)
    until(lambda: st.ext.metric("gpupack_autoscale_passes_total ") >= passes, 60, what="five more passes")
    until(
        lambda: st.ca.text().count("Starting main loop") >= loops,
        60 + 3 * soak_loops,
        what="autoscaler loops",
    )
    assert not placeholders(st) and st.ca.scale_ups() == [] and kwok_nodes(cluster.core) == [], diag(st)
    assert all(not p["spec"].get("nodeName") for p in list_pods(cluster.core, st.ns))
    said = {e["involvedObject"]["name"]: e["message"] for e in events(cluster.core, st.ns, REASON_NO_GROUP)}
    assert "group h100: needs 1000 CPUs, a node has 64 CPUs" in said["imp-cpu-0"], said
    assert "group h100: nodeSelector pool=nowhere not in template labels" in said["imp-sel"], said
    assert len(events(cluster.core, st.ns, REASON_NO_GROUP)) == 3  # once per pod, not once per pass
    assert "No expansion options" in st.ca.text()  # the autoscaler saw the pods and found no group either


def test_a_scale_up_the_real_autoscaler_refuses_backs_off_and_holds_back_only_what_it_refused(stack, cluster):
    # gpupack's templates say 96 CPUs a node, the autoscaler's (read at its start) 64: the placeholder
    # carries the pod's 80 CPUs, so the autoscaler's own simulation refuses it (NotTriggerScaleUp)
    flags = ("--autoscale-backoff-s", "3")
    st = stack([H100], flags=flags, templates=lambda t: t.replace("cpu: '64'", "cpu: '96'"))
    create_pod(cluster.core, whole_pod("cpu80", 8, cpu="80"), st.ns)

    def backoffs() -> list[str]:
        said = [e["message"] for e in events(cluster.core, st.sysns, REASON_BACKOFF)]
        return sorted(said, key=lambda m: int(m.rsplit("(failure ", 1)[1].split()[0]))

    until(lambda: len(backoffs()) >= 3, 90, what="three failed scale-ups")
    said = backoffs()
    assert "for 3 s (failure 1 in a row)" in said[0] and "for 6 s (failure 2" in said[1], said
    assert "for 12 s (failure 3" in said[2], said
    assert all("didn't trigger scale-up" in m and "asking 80000m CPU or more" in m for m in said), said
    assert st.ca.scale_ups() == [] and kwok_nodes(cluster.core) == [], diag(st)
    assert st.ext.metric('gpupack_autoscale_scale_up_failures_total{group="h100"}') >= 3
    # the refusal holds back what asks that much only: another tenant's pod in the group gets its node
    # (a GPU share: the autoscaler alone would add no node for it)
    create_pod(cluster.core, share_pod("light", 20000), st.ns)
    until(lambda: (cluster.core.read_namespaced_pod("light", st.ns).spec.node_name or "").startswith("h100"),
          90, what="the other pod bound on a new node")  # fmt: skip
    # the 80-CPU pod is told why it waits (once), and with the new node's allocatable (64 CPUs, which
    # gpupack reads as the autoscaler does) it gets no placeholder again
    (told,) = until(lambda: events(cluster.core, st.ns, REASON_NO_GROUP), 30, what="the 80-CPU pod told")
    assert told["involvedObject"]["name"] == "cpu80" and "group h100: needs 80 CPUs" in told["message"], told
    passes = st.ext.metric("gpupack_autoscale_passes_total ") + 5
    until(lambda: st.ext.metric("gpupack_autoscale_passes_total ") >= passes, 60, what="five more passes")
    assert len(kwok_nodes(cluster.core)) == 1 and not placeholders(st), diag(st)
    assert not cluster.core.read_namespaced_pod("cpu80", st.ns).spec.node_name


# --- the controller, one pass at a time --------------------------------------------------------
@pytest.fixture
def controller(cluster: realk8s.ControlPlane, sfx: str) -> SimpleNamespace:
    """make() -> a fresh controller (a restart) on the same namespace, templates and clock.
    The clock starts an hour back, so a node made now is newer than any failure it records."""
    sysns = f"gpupack-{sfx}"
    cluster.ensure_namespace(sysns, {"gpupack.io/webhook": "skip"})
    templates = write_configmaps(cluster.core, sysns, [H100])
    kc = KubeClient(cluster.new_api_client(), timeout_s=10.0)
    c = SimpleNamespace(sysns=sysns, now=time.time() - 3600, registry=None)
    cfg = AutoscaleConfig(templates, sysns, GROUP_LABEL, interval_s=1, backoff_s=60, backoff_max_s=200,
                          scale_up_timeout_s=300)  # fmt: skip

    def make() -> AutoscaleController:
        c.registry = CollectorRegistry()
        rec = EventRecorder(kc, "test", "gpupack-extender")
        return AutoscaleController(kc, cfg, events=rec, registry=c.registry, clock=lambda: c.now)

    c.make = make
    return c


def live_placeholders(core: client.CoreV1Api, namespace: str) -> list[dict]:
    return [p for p in list_pods(core, namespace)
            if LABEL_PLACEHOLDER in p["metadata"].get("labels", {}) and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def pending(cluster: realk8s.ControlPlane, ns: str, *pods: dict) -> None:
    for p in pods:
        create_pod(cluster.core, p, ns)
        mark_unschedulable(cluster.core, ns, p["metadata"]["name"])


def test_each_pod_no_group_can_take_is_told_once_and_forgotten_when_gone(controller, cluster, ns):
    c = controller.make()
    crowd = [whole_pod(f"sel-{i}", 1, selector={"pool": f"p{i}"}) for i in range(30)]
    huge = whole_pod("huge-mem", 1)
    huge["spec"]["containers"][0]["resources"]["requests"]["memory"] = "8E"  # as large as the API takes
    pending(cluster, ns, *IMPOSSIBLE, *crowd, huge, whole_pod("fits", 8, cpu="8"))
    r = c.run_pass()
    assert r.unplaceable[f"{ns}/imp-cpu-0"] == "group h100: needs 1000 CPUs, a node has 64 CPUs"
    assert r.unplaceable[f"{ns}/imp-sel"] == "group h100: nodeSelector pool=nowhere not in template labels"
    assert (
        r.unplaceable[f"{ns}/huge-mem"].startswith("group h100: needs 8")
        and "of memory" in r.unplaceable[f"{ns}/huge-mem"]
    )
    assert len(r.unplaceable) == 34 and r.wanted == {"h100": 1}  # the pod that fits still gets its node
    (ph,) = live_placeholders(cluster.core, controller.sysns)
    assert placeholder_host(ph) == (8000, 0)  # the pod's CPU travels with it: the autoscaler judges it too
    c.run_pass()
    c.run_pass()
    said = events(cluster.core, ns, REASON_NO_GROUP)
    assert sorted(e["involvedObject"]["name"] for e in said) == sorted(
        [p["metadata"]["name"] for p in (*IMPOSSIBLE, *crowd, huge)]
    )  # one each, in three passes
    assert len(c.told) == 34
    for p in [*IMPOSSIBLE, *crowd, huge]:
        cluster.core.delete_namespaced_pod(p["metadata"]["name"], ns, grace_period_seconds=0)
    until(lambda: len(list_pods(cluster.core, ns)) == 1, 30, what="the told pods gone")
    c.run_pass()
    assert c.told == {}
    assert controller.registry.get_sample_value("gpupack_autoscale_unplaceable_pods") == 0
    assert controller.registry.get_sample_value("gpupack_autoscale_passes_total") == 4


def ca_says_no(core: client.CoreV1Api, ph: dict) -> None:
    """The cluster autoscaler's Event on a pending pod it will add no node for."""
    m = ph["metadata"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.create_namespaced_event(m["namespace"], {
        "metadata": {"generateName": f"{m['name']}."}, "reason": "NotTriggerScaleUp", "type": "Normal",
        "message": "pod didn't trigger scale-up: 1 Insufficient cpu", "source": {"component": "cluster-autoscaler"},
        "involvedObject": {"kind": "Pod", "name": m["name"], "namespace": m["namespace"], "uid": m["uid"]},
        "firstTimestamp": now, "lastTimestamp": now, "count": 1})  # fmt: skip


def backoff_record(cluster: realk8s.ControlPlane, namespace: str) -> dict:
    cm = cluster.core.read_namespaced_config_map(OWNER_CONFIGMAP, namespace)
    return json.loads((cm.data or {}).get(BACKOFF_KEY) or "{}")


def test_a_refused_or_never_met_scale_up_backs_its_group_off_and_the_backoff_survives_a_restart(
    controller, cluster, ns
):
    sysns = controller.sysns
    c = controller.make()
    pending(cluster, ns, whole_pod("big", 8))
    assert c.run_pass().created == 1
    (ph,) = live_placeholders(cluster.core, sysns)
    ca_says_no(cluster.core, ph)
    r = c.run_pass()
    assert (
        list(r.failed) == [ph["metadata"]["name"]] and "Insufficient cpu" in r.failed[ph["metadata"]["name"]]
    )
    assert r.backing_off["h100"] == pytest.approx(60) and r.created == 0
    assert not live_placeholders(cluster.core, sysns)
    assert backoff_record(cluster, sysns)["h100"]["failures"] == 1
    assert (
        controller.registry.get_sample_value("gpupack_autoscale_scale_up_failures_total", {"group": "h100"})
        == 1
    )
    assert controller.registry.get_sample_value("gpupack_autoscale_backoff_seconds", {"group": "h100"}) == 60
    (ev,) = events(cluster.core, sysns, REASON_BACKOFF)
    assert "no placeholder of the group for 60 s" in ev["message"]
    assert c.run_pass().created == 0  # not ordered again while backing off
    controller.now += 61
    assert c.run_pass().created == 1
    (ph,) = live_placeholders(cluster.core, sysns)
    ca_says_no(cluster.core, ph)
    assert c.run_pass().backing_off["h100"] == pytest.approx(120)  # doubled
    # a restart reads the backoff back from the API
    c = controller.make()
    r = c.run_pass()
    assert r.created == 0 and r.backing_off["h100"] == pytest.approx(120)
    # a node of the group made since the last failure ends the backoff (it counts as coming here)
    cluster.make_node(f"h100-new-{ns[-6:]}", labels={GROUP_LABEL: "h100"})
    r = c.run_pass()
    assert backoff_record(cluster, sysns) == {} and not r.backing_off and r.wanted == {}
    cluster.core.delete_node(f"h100-new-{ns[-6:]}")
    # a placeholder whose node never comes fails too, once it is older than the timeout
    controller.now = time.time()
    until(
        lambda: c.run_pass().created == 1 or live_placeholders(cluster.core, sysns), 30, what="a placeholder"
    )
    controller.now = time.time() + 301
    r = c.run_pass()
    (why,) = r.failed.values()
    assert why.startswith("no node came in") and r.backing_off["h100"] == pytest.approx(60)
    # the cap: failures in a row never pause a group longer than backoff_max_s
    for _ in range(3):
        controller.now += r.backing_off["h100"] + 1
        assert c.run_pass().created == 1
        ca_says_no(cluster.core, live_placeholders(cluster.core, sysns)[0])
        r = c.run_pass()
    assert r.backing_off["h100"] == pytest.approx(200)
