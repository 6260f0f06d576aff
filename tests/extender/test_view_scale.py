"""Issue 29: the view's work per event does not grow with the cluster. The first list counts each
node's host resources once at its end, and must count what applying the pods one by one counts; a
node rebuilt (its inventory changed) or deleted touches its own pods only, and ends charged as a
view built afresh is."""

from __future__ import annotations

import copy
import json
import random

from ext_helpers import node_obj

from extender.state.view import ClusterView
from gpupack.contract import ANN_ASSIGNMENT, ANN_HANDOFF, ANN_INVENTORY, HANDOFF_DONE, Assignment, GPUShare


def _pods(rng: random.Random, nodes: list[str], n: int) -> list[dict]:
    out, next_gpu = [], dict.fromkeys(nodes, 0)
    for i in range(n):
        node = rng.choice(nodes)
        c = {"name": "c", "resources": {"requests": {"cpu": rng.choice(["1", "500m", "2"]),
                                                     "memory": rng.choice(["4Gi", "1Gi"])}}}  # fmt: skip
        ann = {}
        if rng.random() < 0.4 and next_gpu[node] < 8:
            g = next_gpu[node]
            next_gpu[node] += 1
            a = Assignment(f"uid-{i}", node, "online", {"c": (GPUShare(f"GPU-{node}-{g}", g, 20000, 30),)})
            ann = {ANN_ASSIGNMENT: a.to_json(), ANN_HANDOFF: HANDOFF_DONE}
            c["resources"]["limits"] = {
                "gpupack.io/gpu": "1",
                "gpupack.io/gpu-mem": "20000",
                "gpupack.io/gpu-sm": "30",
            }
        out.append({"metadata": {"name": f"p{i}", "namespace": "ns", "uid": f"uid-{i}", "annotations": ann},
                    "spec": {"nodeName": node, "containers": [c]}, "status": {"phase": "Running"}})  # fmt: skip
    return out


def _counts(view: ClusterView) -> dict:
    with view.lock:
        return {
            n: (
                info.requested,
                info.pod_count,
                view.state.nodes[n].cpu_used,
                view.state.nodes[n].ram_used,
                tuple((g.mem_used, g.milli_used) for g in view.state.nodes[n].gpus),
            )
            for n, info in view.nodes.items()
        }


def _view(nodes: list[dict], pods: list[dict], synced_first: bool) -> ClusterView:
    view = ClusterView(track_host=True)
    view.replace_nodes(nodes)
    if synced_first:
        view.synced.set()  # a relist: each pod counted as it comes
    view.replace_assigned_pages([pods[i : i + 7] for i in range(0, len(pods), 7)])
    view.synced.set()
    return view


def test_the_first_list_counts_what_pod_by_pod_counts():
    rng = random.Random(5)
    names = [f"n{i}" for i in range(6)]
    nodes = [node_obj(n) for n in names]
    pods = _pods(rng, names, 80)
    once = _view(nodes, pods, synced_first=False)
    each = _view(nodes, pods, synced_first=True)
    assert _counts(once) == _counts(each)
    assert sum(c[1] for c in _counts(once).values()) == 80
    assert once.host._deferred is None  # nothing left held after the list


def test_a_node_rebuilt_or_deleted_touches_its_own_pods_and_ends_as_a_fresh_view():
    rng = random.Random(7)
    names = [f"n{i}" for i in range(5)]
    nodes = [node_obj(n) for n in names]
    pods = _pods(rng, names, 60)
    view = _view(nodes, pods, synced_first=False)
    before = _counts(view)
    # the inventory's text changes (a device plugin restarted), not the GPUs: the node is rebuilt
    changed = copy.deepcopy(nodes[2])
    inv = json.loads(changed["metadata"]["annotations"][ANN_INVENTORY])
    changed["metadata"]["annotations"][ANN_INVENTORY] = json.dumps(inv, indent=1)
    others = {k for k, p in view.pods.items() if p.node != "n2"}
    seen: list[str] = []

    class Watching(dict):
        def values(self):  # the old rebuild walked every pod record of the cluster
            seen.append("values")
            return super().values()

    view.pods = Watching(view.pods)
    view.apply_node(changed)
    assert not seen
    assert _counts(view) == before
    view.delete_node("n2")
    assert "n2" not in _counts(view)
    assert {k for k, (_, pl, _) in view.state.pods.items()} == others
    view.apply_node(nodes[2])
    assert _counts(view) == before
