"""Issue 13, what keeps simultaneous pods apart and binds short, against the real kube-apiserver:

- a bind claims its node from its arrival on: the next pod's filter steers clear even before
  the bind has read the pod or written anything;
- prioritize's top node is expected for its pod until that pod's bind arrives (or for a short
  while): the next pod's filter, which kube-scheduler may send before that bind, steers clear;
- a bind uses the Pod its filter saw (no GET); the Binding's resourceVersion precondition still
  refuses it over a pod that changed since, which is then read again and bound;
- binds reuse a Lease read that found it held at most LEASE_REUSE_S ago for their first checks,
  while the check right before each Binding reads the Lease afresh: a Lease that moved to another
  holder stops the very next bind.
"""

from __future__ import annotations

import threading
import time

import realk8s
from ext_helpers import DevicePluginEmulator, annotations, bind_body, create_pod, get_pod, gpu_node
from faultproxy import FaultProxy
from test_extender_handoff_cases import _lease, filter_body, small

from extender.api.lease import LEASE_REUSE_S
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, HANDOFF_DONE, decode_assignment

until = realk8s.until


def prioritize(ext, pod: dict, nodes: list[str]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in ext.post("prioritize", filter_body(pod, nodes)).json()}


def test_a_bind_steers_the_next_filter_away_from_its_node_from_its_arrival_on(
    cluster, ns, sfx, tmp_path, start_extender
):
    a, b = f"gpu-a-{sfx}", f"gpu-b-{sfx}"
    gpu_node(cluster, a, 2)
    gpu_node(cluster, b, 2)
    with FaultProxy(cluster.url) as proxy:
        ext = start_extender(kubeconfig_path=cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url))
        p = create_pod(cluster.core, small("p"), ns)
        q = create_pod(cluster.core, small("q"), ns)
        until(
            lambda: len(ext.post("filter", filter_body(q, [a, b])).json()["NodeNames"]) == 2,
            30,
            "nodes known",
        )
        # p was never filtered by this extender, so its bind reads it first: slowly
        proxy.delay(rf"/namespaces/{ns}/pods/p$", 1.0, method="GET")  # within the 2 s API timeout
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(ext.post("bind", bind_body(p, a)).json()))
        t.start()
        until(
            lambda: proxy.count("GET", rf"/namespaces/{ns}/pods/p$") == 1, 10, "p's read sent", interval=0.02
        )
        got = ext.post("filter", filter_body(q, [a, b])).json()
        assert ANN_ASSIGNMENT not in annotations(get_pod(cluster.core, ns, "p"))  # nothing written yet
        assert got["NodeNames"] == [b], got
        assert f"{ns}/p" in got["FailedNodes"][a], got
        t.join(30)
        assert out == {"Error": ""}, out


def test_the_top_node_of_a_prioritized_pod_is_kept_for_it_until_its_bind(cluster, ns, sfx, start_extender):
    a, b = f"gpu-a-{sfx}", f"gpu-b-{sfx}"
    gpu_node(cluster, a, 2)
    gpu_node(cluster, b, 2)
    ext = start_extender()
    p0, p, q = (create_pod(cluster.core, small(n), ns) for n in ("p0", "p", "q"))
    until(lambda: len(ext.post("filter", filter_body(p0, [a])).json()["NodeNames"]) == 1, 30, "node a known")
    with realk8s.KubeletEmulator(cluster, ns, on_admit=DevicePluginEmulator(cluster)):
        assert ext.post("bind", bind_body(p0, a)).json() == {"Error": ""}
        until(
            lambda: annotations(get_pod(cluster.core, ns, "p0")).get(ANN_HANDOFF) == HANDOFF_DONE,
            30,
            "p0 done",
        )
        # packing: the partly used node a is where p goes; kube-scheduler asks for q before p's bind
        until(
            lambda: prioritize(ext, p, [a, b]) == {a: 10, b: 0}, 10, "a preferred once p0's handoff is seen"
        )
        got = ext.post("filter", filter_body(q, [a, b])).json()
        assert got["NodeNames"] == [b] and f"{ns}/p" in got["FailedNodes"][a], got
        assert ext.post("bind", bind_body(p, a)).json() == {"Error": ""}
        until(
            lambda: annotations(get_pod(cluster.core, ns, "p")).get(ANN_HANDOFF) == HANDOFF_DONE, 30, "p done"
        )
        ext.wait_no_pending_handoffs()
        assert ext.post("filter", filter_body(q, [a, b])).json()["NodeNames"] == [a, b]
        # a pod prioritized but never bound (its scheduling cycle ended elsewhere) keeps nothing long;
        # r exists before q's prioritize, so r's filter comes well within the time q's node is kept
        r = create_pod(cluster.core, small("r"), ns)
        assert prioritize(ext, q, [a, b]) == {a: 10, b: 0}
        assert ext.post("filter", filter_body(r, [a, b])).json()["NodeNames"] == [b]
        until(lambda: ext.post("filter", filter_body(r, [a, b])).json()["NodeNames"] == [a, b], 10,
              "q's expected node released after a while")  # fmt: skip


def test_bind_uses_the_pod_its_filter_saw_and_a_changed_pod_is_read_again(
    cluster, ns, sfx, tmp_path, start_extender
):
    a, b = f"gpu-a-{sfx}", f"gpu-b-{sfx}"
    gpu_node(cluster, a, 2)
    gpu_node(cluster, b, 2)
    with FaultProxy(cluster.url) as proxy:
        ext = start_extender(kubeconfig_path=cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url))
        p = create_pod(cluster.core, small("p"), ns)
        until(
            lambda: ext.post("filter", filter_body(p, [a, b])).json()["NodeNames"] == [a, b],
            30,
            "nodes known",
        )
        assert ext.post("bind", bind_body(p, a)).json() == {"Error": ""}
        assert proxy.count("GET", rf"/namespaces/{ns}/pods/p$") == 0
        assert decode_assignment(annotations(get_pod(cluster.core, ns, "p"))[ANN_ASSIGNMENT]).node == a
        assert proxy.count("POST", rf"/namespaces/{ns}/pods/p/binding$") == 1
        # one write: the Binding carries the assignment, nothing is PATCHed before or after it
        assert proxy.count("PATCH", rf"/namespaces/{ns}/pods/p$") == 0
        # a pod that changed between its filter and its bind: the Binding's resourceVersion
        # precondition fails (409), the pod is read again, fitted again and bound
        q = create_pod(cluster.core, small("q"), ns)
        assert ext.post("filter", filter_body(q, [b])).json()["NodeNames"] == [b]
        cluster.core.patch_namespaced_pod("q", ns, {"metadata": {"labels": {"touched": "yes"}}})
        assert ext.post("bind", bind_body(q, b)).json() == {"Error": ""}
        qq = get_pod(cluster.core, ns, "q")
        assert proxy.count("GET", rf"/namespaces/{ns}/pods/q$") == 1
        assert proxy.count("POST", rf"/namespaces/{ns}/pods/q/binding$") == 2  # 409, then the retry
        assert proxy.count("PATCH", rf"/namespaces/{ns}/pods/q$") == 0
        assert qq["metadata"]["labels"].get("touched") == "yes" and qq["spec"]["nodeName"] == b
        a_q = decode_assignment(annotations(qq)[ANN_ASSIGNMENT])
        assert a_q.node == b and a_q.pod_uid == q["metadata"]["uid"]


def test_binds_reuse_a_recent_lease_read_but_read_it_afresh_before_each_binding_and_stop_once_it_moved(
    cluster, ns, sfx, tmp_path, start_extender
):
    # one node per pod: a bound pod's pending handoff (no kubelet here) keeps the next one off its node
    nodes = [f"gpu-{i}-{sfx}" for i in range(8)]
    spare = f"gpu-spare-{sfx}"  # no pod on it: a bind there waits for no handoff
    for n in [*nodes, spare]:
        gpu_node(cluster, n, 1)
    # long enough that the Lease stays valid beyond the fence's margin for the whole test
    _lease(cluster, ns, "sched", "me_1", duration=120)
    with FaultProxy(cluster.url) as proxy:
        kc = cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url)
        # the janitor's pass reads the Lease afresh: keep it out of the counted window
        ext = start_extender(
            "--lease-namespace", ns, "--lease-name", "sched", "--identity", "me",
            "--sweep-interval-s", "600", kubeconfig_path=kc,
        )  # fmt: skip
        pods = [create_pod(cluster.core, small(f"p{i}"), ns) for i in range(len(nodes) + 1)]
        until(lambda: len(ext.post("filter", filter_body(pods[0], [*nodes, spare])).json()["NodeNames"]) == 9,
              30, "nodes known")  # fmt: skip
        before = proxy.count("GET", r"/leases/sched$")
        t0 = time.monotonic()
        for pod, n in zip(pods, nodes, strict=False):
            assert ext.post("bind", bind_body(pod, n)).json() == {"Error": ""}
        elapsed = time.monotonic() - t0
        reads = proxy.count("GET", r"/leases/sched$") - before
        binds = len(nodes)
        # one fresh read right before each Binding; the earlier checks reuse a read at most
        # LEASE_REUSE_S old (about one more read per second, one more for the start-up requeue pass)
        assert binds <= reads <= binds + 2 + int(elapsed / LEASE_REUSE_S), (reads, elapsed)
        assert proxy.count("POST", rf"/namespaces/{ns}/pods/p\d+/binding$") == binds
        for pod, n in zip(pods, nodes, strict=False):
            assert get_pod(cluster.core, ns, pod["metadata"]["name"])["spec"]["nodeName"] == n

        # Another replica's scheduler takes the Lease at once (as after a release on shutdown), while
        # the read of the last bind is still fresh enough to be reused: the next bind is refused all
        # the same, and posts no Binding.
        _lease(cluster, ns, "sched", "other_2", duration=120)
        last = pods[-1]
        err = ext.post("bind", bind_body(last, spare)).json()["Error"]
        assert "is held by other_2" in err, err
        pod = get_pod(cluster.core, ns, last["metadata"]["name"])
        assert not pod["spec"].get("nodeName") and ANN_ASSIGNMENT not in annotations(pod)
        assert proxy.count("POST", rf"/namespaces/{ns}/pods/{last['metadata']['name']}/binding$") == 0
        # a refusal is never reused as a pass: it stays refused
        assert "is held by other_2" in ext.post("bind", bind_body(last, spare)).json()["Error"]
        assert proxy.count("POST", rf"/namespaces/{ns}/pods/{last['metadata']['name']}/binding$") == 0


def test_binds_give_their_api_connection_back_so_the_next_call_opens_none(cluster, ns, sfx, tmp_path):
    """A Binding's answer is read to its end: its connection returns to the pool, and a stream of
    binds runs over one kept-alive connection instead of a new TLS handshake each."""
    from extender.api.kube import Kube, api_client

    node = f"gpu-conn-{sfx}"
    gpu_node(cluster, node, 1)
    pods = [create_pod(cluster.core, small(f"c{i}"), ns) for i in range(4)]
    api = api_client(str(cluster.write_kubeconfig(tmp_path / "kc")))
    kube = Kube(api)
    kube.get_pod(ns, pods[0]["metadata"]["name"])  # the pool's first connection
    for p in pods:
        kube.bind(ns, p["metadata"]["name"], p["metadata"]["uid"], node)
        kube.get_pod(ns, p["metadata"]["name"])
    manager = api.rest_client.pool_manager
    pools = [manager.pools[k] for k in list(manager.pools.keys())]  # noqa: SIM118 (no __iter__)
    assert sum(pool.num_connections for pool in pools) == 1, [pool.num_connections for pool in pools]
    for p in pods:
        assert get_pod(cluster.core, ns, p["metadata"]["name"])["spec"]["nodeName"] == node
