import threading
import time

import pytest
import realk8s
import urllib3
from faultproxy import FaultProxy
from kubernetes import client


def test_control_plane_nodes_tokens_faults_scheduler(cluster, tmp_path):
    """The fixture gives a Ready fake node, real RBAC, injected faults and a working scheduler."""
    cluster.ensure_namespace("smoke")
    cluster.make_node("n1", extended={"gpupack.io/gpu": "16"})
    n = cluster.core.read_node("n1")
    assert n.status.allocatable["gpupack.io/gpu"] == "16"
    assert not any(t.key == "node.kubernetes.io/not-ready" for t in (n.spec.taints or []))
    tok = cluster.service_account_token("smoke", "sa1")
    c = client.CoreV1Api(cluster.new_api_client(tok))
    with pytest.raises(client.ApiException) as forbidden:
        c.list_node()
    assert forbidden.value.status == 403
    with FaultProxy(cluster.url) as fp:
        kc = cluster.write_kubeconfig(tmp_path / "kc", server=fp.url)
        from kubernetes import config

        api = config.new_client_from_config(str(kc))
        core = client.CoreV1Api(api)
        fp.fail_next("GET", "/api/v1/nodes$", 500)
        with pytest.raises(client.ApiException) as injected:
            core.list_node()
        assert injected.value.status == 500
        assert len(core.list_node().items) == 1
        evs = []
        from kubernetes import watch

        w = watch.Watch()

        def run():
            try:
                for ev in w.stream(core.list_namespaced_pod, "smoke", timeout_seconds=30):
                    evs.append(ev["type"])
            except urllib3.exceptions.ProtocolError:
                evs.append("cut")

        th = threading.Thread(target=run)
        th.start()
        time.sleep(0.5)
        cluster.core.create_namespaced_pod(
            "smoke", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        )
        # a watch opened with no resourceVersion replays existing objects as ADDED, so this holds
        # whether the pod was created before or after the watch connected
        realk8s.until(lambda: evs == ["ADDED"], 15, "the pod's ADDED event through the proxy")
        assert fp.cut_watches() == 1
        th.join(5)
        assert not th.is_alive()
        assert evs == ["ADDED", "cut"]
    s = cluster.start_scheduler(
        {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration"}
    )
    realk8s.until(
        lambda: cluster.core.read_namespaced_pod("p", "smoke").spec.node_name == "n1", 30, "scheduled"
    )
    s.stop()
