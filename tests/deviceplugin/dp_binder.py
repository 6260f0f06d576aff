"""A small, protocol-following binder for tests: what the extender does at bind.

Per node: a mutex; wait while `gpupack.handoff.blocking_handoff` names another pod; PATCH the
assignment (resourceVersion precondition); POST the Binding; roll back if the Binding fails.
GPU choice is deliberately simple (first GPU with room, or the GPU indices a test names per
container); the packing is not under test here.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from kubernetes import client
from kubernetes.client.rest import ApiException

from gpupack import contract, handoff
from gpupack.contract import Assignment, GPUShare

MERGE = "application/merge-patch+json"


class BindRefused(Exception):
    pass


class TestBinder:
    __test__ = False

    def __init__(self, core: client.CoreV1Api, wait_s: float = 20.0) -> None:
        self.core = core
        self.wait_s = wait_s
        self._mutex: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        self.used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # node -> uuid -> MiB
        self.waits = 0

    def _pods(self, node: str) -> list[dict]:
        r = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False
        )
        return json.loads(r.data)["items"]

    def _inventory(self, node: str) -> contract.NodeInventory:
        n = json.loads(self.core.read_node(node, _preload_content=False).data)
        return contract.decode_inventory(n["metadata"]["annotations"][contract.ANN_INVENTORY], node)

    def bind(
        self, namespace: str, name: str, node: str, gpus: Mapping[str, Sequence[int]] | None = None
    ) -> Assignment:
        """Assign (first fit, or the GPU indices `gpus` names per container) and bind."""
        with self._guard:
            mutex = self._mutex[node]
        with mutex:
            pod = json.loads(self.core.read_namespaced_pod(name, namespace, _preload_content=False).data)
            view = handoff.pod_view(pod)
            deadline = time.monotonic() + self.wait_s
            while (
                blocker := handoff.blocking_handoff(self._pods(node), node, exclude_uid=view.uid)
            ) is not None:
                self.waits += 1
                if time.monotonic() > deadline:
                    raise BindRefused(handoff.blocking_message(node, blocker))
                time.sleep(0.02)
            inv = self._inventory(node)
            containers: dict[str, tuple[GPUShare, ...]] = {}
            for c in handoff.gpu_containers(view):
                mem = contract.parse_int_quantity(c.limits.get(contract.RES_GPU_MEM, "0"), "mem")
                sm = contract.parse_int_quantity(c.limits.get(contract.RES_GPU_SM, "10"), "sm")
                exclusive = mem == 0
                picked = []
                if gpus is not None:
                    picked = [inv.gpus[i] for i in gpus[c.name]]
                for g in inv.gpus if gpus is None else ():
                    if len(picked) == c.gpu_count():
                        break
                    room = g.mem_mib - self.used[node][g.uuid]
                    if g.healthy and (room >= mem if not exclusive else room == g.mem_mib):
                        picked.append(g)
                shares = tuple(
                    GPUShare(
                        g.uuid, g.index, g.mem_mib if exclusive else mem, 100 if exclusive else sm, exclusive
                    )
                    for g in picked
                )
                for s in shares:
                    self.used[node][s.uuid] += s.mem_mib
                containers[c.name] = shares
            a = Assignment(view.uid, node, "online", containers, bound_at=handoff.rfc3339(datetime.now(UTC)))
            for _ in range(5):
                try:
                    self.core.patch_namespaced_pod(
                        name,
                        namespace,
                        {
                            "metadata": {
                                "resourceVersion": view.resource_version,
                                "annotations": handoff.handoff_annotations_for_bind(a),
                            }
                        },
                        _content_type=MERGE,
                        _preload_content=False,
                    )
                    break
                except ApiException as e:
                    if e.status != 409:
                        raise
                    view = handoff.pod_view(
                        json.loads(
                            self.core.read_namespaced_pod(name, namespace, _preload_content=False).data
                        )
                    )
            body = client.V1Binding(
                metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=view.uid),
                target=client.V1ObjectReference(kind="Node", name=node, api_version="v1"),
            )
            try:
                self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)
            except ApiException:
                self.core.patch_namespaced_pod(
                    name,
                    namespace,
                    {"metadata": {"annotations": handoff.rollback_annotations()}},
                    _content_type=MERGE,
                    _preload_content=False,
                )
                raise
            return a
