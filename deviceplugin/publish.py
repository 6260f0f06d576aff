"""Publishes this node's GPU inventory (contract.NodeInventory) on its Node object.

Written at start and again on every health change, by a background thread that retries until
the API accepts it, so a health change is never lost to a transient API error or to gpupack's
plugin-node webhook being down (Kubernetes 1.28-1.29, where it fails closed).
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import UTC, datetime

from kubernetes.client.rest import ApiException

from deviceplugin.health import DeviceState
from deviceplugin.kube import Kube, webhook_refusal
from gpupack import contract
from gpupack.contract import ANN_INVENTORY, LABEL_GPU_COUNT, LABEL_GPU_MODEL, LABEL_GPU_NODE, NodeInventory

log = logging.getLogger("gpupack.deviceplugin.publish")


def model_label(model: str) -> str:
    """A label value for a GPU model: "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"."""
    v = re.sub(r"[^A-Za-z0-9_.-]+", "-", model.strip())[:63]
    return v.strip("-_.") or "unknown"


def build_inventory(state: DeviceState, enforcement: str) -> NodeInventory:
    return NodeInventory(
        gpus=state.gpus(),
        slots_per_gpu=contract.SLOTS_PER_GPU,
        enforcement=enforcement,
        updated=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        skipped=state.skipped,
    )


def node_patch(state: DeviceState, enforcement: str) -> tuple[dict[str, str], dict[str, str]]:
    gpus = state.gpus()
    models = sorted({g.model for g in gpus})
    labels = {
        LABEL_GPU_NODE: "true",
        LABEL_GPU_MODEL: model_label(models[0]) if len(models) == 1 else "mixed",
        LABEL_GPU_COUNT: str(len(gpus)),
    }
    return labels, {ANN_INVENTORY: build_inventory(state, enforcement).to_json()}


class Publisher:
    def __init__(
        self, kube: Kube, node: str, state: DeviceState, enforcement: str, retry_s: float = 2.0
    ) -> None:
        self.kube = kube
        self.node = node
        self.state = state
        self.enforcement = enforcement
        self.retry_s = retry_s
        self.published_version = -1
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpupack-publish", daemon=True)
        state.add_listener(self._wake.set)

    def start(self) -> None:
        self._wake.set()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def publish_once(self) -> None:
        version = self.state.version
        labels, annotations = node_patch(self.state, self.enforcement)
        self.kube.patch_node(self.node, labels, annotations)
        self.published_version = version
        log.info(
            "published inventory of node %s (%d GPU(s), state version %d)",
            self.node,
            len(self.state.gpus()),
            version,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            while self.published_version != self.state.version or self.published_version < 0:
                try:
                    self.publish_once()
                except Exception as e:  # keep trying: the extender needs the inventory
                    why = f"{e.status} {e.reason}" if isinstance(e, ApiException) else str(e)
                    hook = webhook_refusal(e)
                    if hook:  # Kubernetes 1.28-1.29: the plugin-node webhook fails closed
                        why = (
                            f"the API server refuses the device plugin's writes while admission webhook {hook}"
                            " is unavailable (gpupack-scheduler's webhook port down or stalled)"
                        )
                    log.warning(
                        "cannot publish inventory of node %s: %s; retrying in %.0fs",
                        self.node,
                        why,
                        self.retry_s,
                    )
                    if self._stop.wait(self.retry_s):
                        return
