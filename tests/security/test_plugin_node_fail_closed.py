"""Issue 31 item 4: a GPU node's device plugin cannot write other nodes, also while gpupack's
webhook is unavailable. Against the real API server with deploy/webhook/ as shipped (webhooks and
admission policies; the webhooks pointed at a local `gpupack extender`), a real token bound to a
plugin pod on node A:

- on servers whose pod-bound tokens name no node (v1.28-1.29) the `plugin-node` webhook is the only
  check that the plugin writes its own node: it fails closed, so with it stalled (a listener that
  accepts and never answers) or down (nothing listening), the plugin's writes to node B's inventory
  (an 8,000,000 MiB GPU) and to node B's pod's handoff are refused, and so are its own node's (the
  cost, docs/operator-guide.md); the device plugin's Allocate retries, then fails the container
  with the webhook's name (metric reason `webhook_unavailable`); with the webhook back, its own
  node's writes and Allocate pass and node B's are still refused;
- where the token names the node (v1.30 on), the admission policy alone refuses node B's writes
  and lets node A's through whatever the webhook's state.

It prints how long a refused write takes with the webhook stalled and down."""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import deploy_objects
import pytest
from kubernetes import client
from processes import free_port
from realk8s import until
from test_webhook_apiserver import Webhook, c, plugin_pod_token, webhook  # noqa: F401  (the module's fixture)

from deviceplugin.allocate import Allocator
from deviceplugin.health import DeviceState
from deviceplugin.kube import Kube, webhook_refusal
from deviceplugin.metrics import Metrics
from gpupack import handoff
from gpupack.contract import ANN_INVENTORY, SCHEDULER_NAME, Assignment, GPUInfo, GPUShare, NodeInventory
from gpupack.handoff import HandoffError

HOOK = "plugin-node.gpupack.io"


class Stalled:
    """A TCP listener that accepts every connection and never answers (a stalled webhook: the API
    server's TLS handshake waits until the webhook's timeoutSeconds)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


@pytest.fixture
def stalled() -> Iterator[Stalled]:
    s = Stalled()
    yield s
    s.close()


def _point_plugin_node_at(cp: Any, url: str) -> None:
    adm = client.AdmissionregistrationV1Api(cp.api_client())
    cfg = adm.read_validating_webhook_configuration("gpupack")
    for h in cfg.webhooks:
        if h.name == HOOK:
            h.client_config.url = url
    adm.replace_validating_webhook_configuration("gpupack", cfg)


def _refusal(call: Callable[[], Any]) -> tuple[client.ApiException, float]:
    t0 = time.monotonic()
    with pytest.raises(client.ApiException) as e:
        call()
    return e.value, time.monotonic() - t0


def test_the_plugin_writes_only_its_own_node_with_the_webhook_stalled_down_or_up(
    webhook: Webhook,  # noqa: F811
    stalled: Stalled,
) -> None:
    cp, sys_ns, sfx = webhook.cp, webhook.system, webhook.sfx
    node_a, node_b = f"wh-{sfx}", f"whb-{sfx}"
    uuid_a = f"GPU-wh-{sfx}"
    real_inv_b = NodeInventory(gpus=(GPUInfo(uuid=f"GPU-b-{sfx}", index=0, model="NVIDIA-L4", mem_mib=24576,
                                             sm_count=58),)).to_json()  # fmt: skip
    cp.make_node(node_b, extended={"gpupack.io/gpu": "16"}, annotations={ANN_INVENTORY: real_inv_b})
    forged_inv = NodeInventory(gpus=(GPUInfo(uuid=f"GPU-b-{sfx}", index=0, model="NVIDIA-L4", mem_mib=8_000_000,
                                             sm_count=58),)).to_json()  # fmt: skip
    tok, claim = plugin_pod_token(cp, sys_ns, node_a)
    dp_client = cp.new_api_client(tok)
    dp = client.CoreV1Api(dp_client)
    loose = client.CoreV1Api(cp.new_api_client(cp.service_account_token(sys_ns, "gpupack-device-plugin")))
    # the tenant pods: outside the GPU-pod webhooks (a preset nodeName), the plugin's targets
    ns = webhook.namespace("wh-failclosed", {"gpupack.io/webhook": "skip"})
    for name, node in (("on-a", node_a), ("on-b", node_b)):
        cp.core.create_namespaced_pod(
            ns, {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": [c("a")]}}
        )
    # a pod on A with a pending handoff, written as the extender does at bind
    alloc = cp.core.create_namespaced_pod(ns, {"metadata": {"name": "alloc"}, "spec": {"nodeName": node_a, "schedulerName": SCHEDULER_NAME,
        "containers": [c("a", {"gpupack.io/gpu": "1", "gpupack.io/gpu-mem": "1024", "gpupack.io/gpu-sm": "10"})]}})  # fmt: skip
    client.RbacAuthorizationV1Api(cp.api_client()).create_namespaced_role_binding(ns, {
        "metadata": {"name": "ext-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "gpupack-extender", "namespace": sys_ns}]})  # fmt: skip
    ext = client.CoreV1Api(cp.new_api_client(cp.service_account_token(sys_ns, "gpupack-extender")))
    # deploy/webhook/policies.yaml as shipped, on both versions
    deploy_objects.apply(cp, cp.for_this_server(deploy_objects.remap(deploy_objects.load("webhook/policies.yaml"),
                                                                     sys_ns)))  # fmt: skip

    def enforced() -> bool:  # a dry run goes through admission and changes nothing
        try:
            dp.patch_namespaced_pod("on-a", ns, {"metadata": {"labels": {"x": "y"}}}, dry_run="All")
        except client.ApiException as e:
            return e.status == 403 and "may change only" in e.body
        return False

    until(enforced, 30, "the device plugin's admission policy to be enforced")

    def bind_alloc() -> None:
        a = Assignment(alloc.metadata.uid, node_a, "online", {"a": (GPUShare(uuid_a, 0, 1024, 10, False),)},
                       bound_at=handoff.rfc3339(datetime.now(UTC)))  # fmt: skip
        ext.patch_namespaced_pod(
            "alloc", ns, {"metadata": {"annotations": handoff.handoff_annotations_for_bind(a)}}
        )

    bind_alloc()
    state = DeviceState((GPUInfo(uuid=uuid_a, index=0, model="NVIDIA-L4", mem_mib=24576, sm_count=58),))
    metrics = Metrics(node_a, state)
    allocator = Allocator(Kube(dp_client), node_a, state, metrics, webhook_wait_s=1.0)

    writes: dict[str, Callable[[], Any]] = {
        "node B inventory": lambda: dp.patch_node(node_b, {"metadata": {"annotations": {ANN_INVENTORY: forged_inv}}}),
        "node B pod handoff": lambda: dp.patch_namespaced_pod(
            "on-b", ns, {"metadata": {"annotations": {"gpupack.io/handoff": "pending"}}}),
    }  # fmt: skip
    own: dict[str, Callable[[], Any]] = {
        "node A labels": lambda: dp.patch_node(node_a, {"metadata": {"labels": {"gpupack.io/gpu-model": "NVIDIA-L4"}}}),
        "node A pod handoff": lambda: dp.patch_namespaced_pod(
            "on-a", ns, {"metadata": {"annotations": {"gpupack.io/allocated": "a"}}}),
    }  # fmt: skip

    def hook_state(want: str) -> bool:
        """What the API server makes of the plugin-node webhook now, read from a plugin token that
        names no node (it always reaches the webhook): "unavailable" or "up"."""
        try:
            loose.patch_node(node_a, {"metadata": {"labels": {"gpupack.io/gpu-model": "x"}}}, dry_run="All")
        except client.ApiException as e:
            got = (
                "unavailable" if webhook_refusal(e) == HOOK else "up" if "names neither" in e.body else e.body
            )
            return got == want
        return False

    figures: dict[str, float] = {}
    for mode, url in (("stalled", f"https://127.0.0.1:{stalled.port}/validate"),
                      ("down", f"https://127.0.0.1:{free_port()}/validate")):  # fmt: skip
        _point_plugin_node_at(cp, url)
        until(lambda: hook_state("unavailable"), 60, f"the API server to call the {mode} webhook")
        times = []
        for what, call in writes.items():
            for _ in range(2):
                e, took = _refusal(call)
                times.append(took)
                if claim:  # the policy alone, by the token's node claim
                    assert e.status == 403 and f"on node {node_a}: may touch only its own node" in e.body, (
                        what,
                        e.body,
                    )
                else:  # fail closed: the webhook could not be asked
                    assert webhook_refusal(e) == HOOK, (mode, what, e.status, e.body)
        figures[mode] = statistics.median(times)
        for what, call in own.items():
            if claim:
                call()  # the webhook is not asked: its state does not matter
            else:
                e, _ = _refusal(call)
                assert webhook_refusal(e) == HOOK, (mode, what, e.body)
        # Allocate: retries, then fails the container naming the webhook (1.28-1.29)
        if not claim:
            t0 = time.monotonic()
            with pytest.raises(HandoffError, match=f"admission webhook {HOOK} is unavailable"):
                allocator.allocate([f"{uuid_a}::0"])
            assert time.monotonic() - t0 >= 1.0
            assert (
                cp.core.read_namespaced_pod("alloc", ns).metadata.annotations["gpupack.io/handoff"]
                == "pending"
            )
        elif mode == "stalled":
            assert allocator.allocate([f"{uuid_a}::0"])["NVIDIA_VISIBLE_DEVICES"] == uuid_a
            bind_alloc()  # pending again for the next round
    if not claim:
        text = metrics.handoff_failures.labels(node=node_a, reason="webhook_unavailable")._value.get()
        assert text == 2
    print(f"refused write, median: webhook stalled {figures['stalled']:.3f} s, down {figures['down']:.3f} s"
          f" ({'policy, node claim' if claim else 'plugin-node webhook, failurePolicy Fail'})")  # fmt: skip

    # the webhook back: its own node's writes and Allocate pass, node B's are refused
    _point_plugin_node_at(cp, webhook.url + "/validate")
    until(lambda: hook_state("up"), 60, "the API server to call the webhook again")
    for what, call in writes.items():
        e, _ = _refusal(call)
        assert e.status == 403 and "may touch only its own node" in e.body, (what, e.body)
    for call in own.values():
        call()
    assert allocator.allocate([f"{uuid_a}::0"])["NVIDIA_VISIBLE_DEVICES"] == uuid_a
    # nothing of node B changed, at any point
    assert cp.core.read_node(node_b).metadata.annotations[ANN_INVENTORY] == real_inv_b
    assert "gpupack.io/handoff" not in (cp.core.read_namespaced_pod("on-b", ns).metadata.annotations or {})
