"""Builders for extender tests: node inventories, Node and Pod objects, recorded payloads."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpupack.contract import (
    ANN_HANDOFF,
    ANN_INVENTORY,
    ANN_RESERVATIONS,
    HANDOFF_DONE,
    HANDOFF_PENDING,
    LABEL_CLASS,
    LABEL_MANAGED,
    GPUInfo,
    NodeInventory,
    Reservation,
    encode_reservations,
)
from gpupack.testing.kubeapi import KubeAPIServer

H100_MIB = 81559


def shared_dir() -> Path | None:
    env = os.environ.get("GPUPACK_SHARED")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared"
    return d if d.is_dir() else None


def payload_dir(mode: str) -> Path:
    d = shared_dir()
    if d is None or not (d / "payloads" / mode).is_dir():
        pytest.skip("recorded scheduler payloads not found (set GPUPACK_SHARED to the shared/ directory)")
    return d / "payloads" / mode


def payloads(mode: str) -> list[tuple[str, dict[str, Any]]]:
    d = payload_dir(mode)
    out = []
    for f in sorted(d.glob("*.json")):
        if f.name.endswith(".response.json"):
            continue
        out.append((f.stem.split("-", 1)[1], json.loads(f.read_text())))
    return out


def inventory(node: str, n: int = 8, mem: int = H100_MIB, model: str = "NVIDIA-H100-80GB-HBM3") -> NodeInventory:
    return NodeInventory(
        gpus=tuple(GPUInfo(uuid=f"GPU-{node}-{i}", index=i, model=model, mem_mib=mem, sm_count=132) for i in range(n))
    )


def node_obj(
    name: str,
    n: int = 8,
    mem: int = H100_MIB,
    model: str = "NVIDIA-H100-80GB-HBM3",
    reservations: list[Reservation] | None = None,
    raw_inventory: str | None = None,
) -> dict[str, Any]:
    ann = {ANN_INVENTORY: raw_inventory if raw_inventory is not None else inventory(name, n, mem, model).to_json()}
    if reservations is not None:
        ann[ANN_RESERVATIONS] = encode_reservations(reservations)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}, "annotations": ann},
        "spec": {},
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
        },
    }


def container(name: str, gpu: int | None = None, mem: int | str | None = None, sm: int | None = None) -> dict:
    limits: dict[str, str] = {}
    if gpu is not None:
        limits["gpupack.io/gpu"] = str(gpu)
    if mem is not None:
        limits["gpupack.io/gpu-mem"] = str(mem)
    if sm is not None:
        limits["gpupack.io/gpu-sm"] = str(sm)
    return {"name": name, "image": "registry.invalid/x:1", "resources": {"limits": limits, "requests": dict(limits)}}


def pod_obj(
    name: str,
    containers: list[dict],
    cls: str | None = "online",
    namespace: str = "default",
    init: list[dict] | None = None,
    uid: str | None = None,
    owner: tuple[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {}}
    if cls is not None:
        meta["labels"][LABEL_CLASS] = cls
    if uid is not None:
        meta["uid"] = uid
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "uid": f"uid-{owner[1]}", "controller": True}
        ]
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "gpupack-scheduler"}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": "Pending"}}


class FakeKubelet:
    """Plays kubelet + device plugin for the handoff: marks bound pods' handoff done."""

    def __init__(self, server: KubeAPIServer, delay: float = 0.0) -> None:
        self.server, self.delay = server, delay
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.served: list[str] = []

    def run(self) -> None:
        while not self.stop_ev.wait(0.01):
            for p in self.server.list("pods"):
                meta = p["metadata"]
                if meta.get("labels", {}).get(LABEL_MANAGED) and p["spec"].get("nodeName") and \
                        meta.get("annotations", {}).get(ANN_HANDOFF) == HANDOFF_PENDING:
                    time.sleep(self.delay)
                    try:
                        self.server.patch("pods", meta["name"], {"metadata": {"annotations": {ANN_HANDOFF: HANDOFF_DONE}}},
                                          meta["namespace"])
                        self.served.append(meta["name"])
                    except Exception:  # noqa: BLE001 - the pod may be gone meanwhile
                        pass

    def __enter__(self) -> FakeKubelet:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_ev.set()
        self.thread.join(5)
