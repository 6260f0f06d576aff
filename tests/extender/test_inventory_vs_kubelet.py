"""Issue 31 item 4: an inventory that contradicts the kubelet is refused. A node's published GPU
inventory (gpupack.io/inventory, written by its device plugin) listing more healthy GPUs than the
kubelet's own `gpupack.io/gpu` allocatable divided by the slots per GPU is reported as
`inventory-contradicts-kubelet` (problems metric, `gpupack status`, filter's reason), and the node
gets no GPU pod until the two agree. The kubelet counts only the device IDs of this node's own
plugin: a forged inventory (another node's plugin token, an 8,000,000 MiB GPU, eight GPUs on a
one-GPU node) shows up here."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import realk8s
import requests
from ext_helpers import container, inventory, node_obj, pod_obj
from processes import ExtenderProcess

from extender.api.wire import ExtenderArgs
from extender.state.records import kubelet_contradiction
from extender.state.view import ClusterView
from extender.status_cli import collect
from extender.verbs.framework import Extender
from gpupack.contract import ANN_INVENTORY, RES_GPU, SLOTS_PER_GPU, GPUInfo, NodeInventory
from gpupack.core.policies import DEFAULT_POLICY, get_policy

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
KIND = "inventory-contradicts-kubelet"


@pytest.mark.parametrize(
    ("healthy", "slots_per_gpu", "slots", "refused"),
    [
        (8, 16, 128, False),  # agree
        (8, 16, 0, False),  # no slots: `no-slots` says it (the plugin not registered yet)
        (
            1,
            16,
            128,
            False,
        ),  # fewer healthy than the kubelet's: GPUs went unhealthy, the kubelet not yet told
        (2, 16, 16, True),  # one GPU's slots, two healthy GPUs
        (8, 16, 127, True),  # one slot short
        (8, 4, 32, False),  # the inventory's own slots per GPU
        (9, 4, 32, True),
    ],
)
def test_contradiction_table(healthy: int, slots_per_gpu: int, slots: int, refused: bool) -> None:
    why = kubelet_contradiction("n", healthy, slots_per_gpu, slots)
    assert bool(why) == refused, why
    if refused:
        assert f"lists {healthy} healthy GPU(s)" in why and f"offers {slots} {RES_GPU} slot(s)" in why


def _with_slots(obj: dict, slots: int) -> dict:
    obj = copy.deepcopy(obj)
    obj["status"]["allocatable"][RES_GPU] = obj["status"]["capacity"][RES_GPU] = str(slots)
    return obj


def _make(nodes: list[dict]) -> tuple[ClusterView, Extender, list[str]]:
    problems: list[str] = []
    view = ClusterView(on_problem=lambda k, m: problems.append(k))
    view.replace_nodes(nodes)
    view.replace_pods([])
    return view, Extender(view, get_policy(DEFAULT_POLICY), None, clock=lambda: NOW), problems


def _filter(ext: Extender, names: list[str]) -> dict:
    return ext.filter(ExtenderArgs(pod_obj("p", [container("c", 1, 1000, 10)]), names, None))


def test_a_node_whose_inventory_contradicts_its_kubelet_gets_no_gpu_pod_until_they_agree() -> None:
    forged = node_obj("forged", n=8)
    view, ext, problems = _make([node_obj("ok", n=2), _with_slots(forged, SLOTS_PER_GPU)])
    out = _filter(ext, ["ok", "forged"])
    assert out["NodeNames"] == ["ok"], out
    assert "lists 8 healthy GPU(s)" in out["FailedAndUnresolvableNodes"]["forged"]
    assert problems == [KIND]
    status = {n["node"]: n for n in collect(view)["nodes"]}
    assert status["forged"]["inventory_conflict"] and not status["ok"]["inventory_conflict"]
    assert any("lists 8 healthy" in m for m in collect(view)["problems"].values())
    # a heartbeat (same slots, same inventory) reports nothing new
    view.apply_node(_with_slots(forged, SLOTS_PER_GPU))
    assert problems == [KIND]
    # the kubelet catches up (its allocatable grows): the node takes GPU pods again
    view.apply_node(forged)
    assert _filter(ext, ["forged"])["NodeNames"] == ["forged"]
    assert not collect(view)["problems"]
    # the inventory changes instead: an 8,000,000 MiB GPU added to a node the kubelet counts 8 on
    big = inventory("forged", 8)
    big = NodeInventory(gpus=(*big.gpus, GPUInfo(uuid="GPU-forged-x", index=8, model=big.gpus[0].model,
                                                 mem_mib=8_000_000, sm_count=132)))  # fmt: skip
    refused = copy.deepcopy(forged)
    refused["metadata"]["annotations"][ANN_INVENTORY] = big.to_json()
    view.apply_node(refused)
    assert "forged" in _filter(ext, ["forged"])["FailedAndUnresolvableNodes"]
    assert problems == [KIND, KIND]


def test_unhealthy_gpus_do_not_count() -> None:
    inv = inventory("n", 2)
    inv = NodeInventory(gpus=(inv.gpus[0], GPUInfo(uuid=inv.gpus[1].uuid, index=1, model=inv.gpus[1].model,
                                                   mem_mib=inv.gpus[1].mem_mib, sm_count=132, healthy=False)))  # fmt: skip
    obj = _with_slots(node_obj("n", raw_inventory=inv.to_json()), SLOTS_PER_GPU)
    _, ext, problems = _make([obj])
    assert _filter(ext, ["n"])["NodeNames"] == ["n"] and not problems


@pytest.fixture
def extender(cluster: realk8s.ControlPlane, tmp_path: Path) -> Iterator[ExtenderProcess]:
    ext = ExtenderProcess(
        cluster.kubeconfig, tmp_path / "extender.log", "--metrics-port", str(realk8s.free_port())
    )
    try:
        ext.wait_ready(60)
        yield ext
    finally:
        ext.stop()


def test_real_apiserver_a_forged_inventory_is_refused_until_the_kubelet_agrees(
    cluster: realk8s.ControlPlane, extender: ExtenderProcess
) -> None:
    """A node whose kubelet offers one GPU's slots and whose inventory (as another node's plugin
    token could write it on 1.28 before the webhook failed closed) lists an 8,000,000 MiB GPU next
    to its own: /filter refuses it as inventory-contradicts-kubelet and the problems metric counts
    it; once the kubelet's allocatable agrees, the node is offered again."""
    name = "inv-vs-kubelet"
    own = GPUInfo(uuid="GPU-own", index=0, model="NVIDIA-L4", mem_mib=24576, sm_count=58)
    forged = GPUInfo(uuid="GPU-forged", index=1, model="NVIDIA-L4", mem_mib=8_000_000, sm_count=58)
    cluster.make_node(name, extended={RES_GPU: str(SLOTS_PER_GPU)},
                      annotations={ANN_INVENTORY: NodeInventory(gpus=(own, forged)).to_json()})  # fmt: skip
    pod = pod_obj("p", [container("c", 1, 1000, 10)])

    def answer() -> dict:
        r = requests.post(extender.url + "/filter", json={"Pod": pod, "NodeNames": [name]}, timeout=10)
        r.raise_for_status()
        return r.json()

    def refused() -> str:
        failed = answer().get("FailedAndUnresolvableNodes") or {}
        return failed.get(name, "") if "healthy GPU(s)" in failed.get(name, "") else ""

    why = realk8s.until(refused, 30, "the extender to refuse the contradicting inventory")
    assert "lists 2 healthy GPU(s)" in why and f"offers {SLOTS_PER_GPU}" in why
    metrics_port = int(extender.proc.args[extender.proc.args.index("--metrics-port") + 1])
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    assert any(line.startswith("gpupack_extender_annotation_problems_total{") and f'kind="{KIND}"' in line
               and not line.endswith(" 0.0") for line in text.splitlines()), text  # fmt: skip
    # the kubelet agrees (two GPUs' slots): offered again
    realk8s.set_node_status(cluster.core, name, {"cpu": "64", "memory": "512Gi", "pods": "250",
                                                 RES_GPU: str(2 * SLOTS_PER_GPU)})  # fmt: skip
    realk8s.until(lambda: answer().get("NodeNames") == [name], 30, "the node offered once the kubelet agrees")
    assert json.loads(json.dumps(answer()))["NodeNames"] == [name]
