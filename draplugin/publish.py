"""Publishing the node's ResourceSlice and keeping it current.

One slice per node (draplugin.slices), owned by the Node (deleted with it). It is written at start,
whenever a GPU's health changes, and whenever the slice on the server stops matching what this
plugin publishes: deleted (the kubelet wipes a node's slices when it starts, and a driver's slices
when its plugin has been gone a while) or changed by someone else. A watch on the node's slices
wakes the sync; a resync every minute covers a watch that missed an event. A restarted plugin
finds its slice by name and updates it (never a second slice); the pool's generation goes up only
when the devices change, so the allocator never sees two generations of one pool at once.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, watch

from deviceplugin.health import DeviceState
from draplugin import slices
from draplugin.claims import parse_quantity
from gpupack import kubeclient

log = logging.getLogger("gpupack.draplugin.publish")
RESYNC_S = 60.0
RETRY_S = 2.0
WATCH_S = 300


def published_devices(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The devices as published, less what the server changes: a taint's timeAdded it adds, and
    quantities it writes in canonical form (81920Mi comes back as 80Gi), compared by value."""
    devs = copy.deepcopy((body.get("spec") or {}).get("devices") or [])
    for d in devs:
        for t in d.get("taints") or []:
            t.pop("timeAdded", None)
        for cap in (d.get("capacity") or {}).values():
            cap["value"] = _q(cap.get("value"))
            policy = cap.get("requestPolicy") or {}
            if "default" in policy:
                policy["default"] = _q(policy["default"])
            for k, v in list((policy.get("validRange") or {}).items()):
                policy["validRange"][k] = _q(v)
    return list(devs)


def _q(v: Any) -> str:
    try:
        return str(parse_quantity(v).normalize())
    except ValueError:
        return str(v)


class SlicePublisher:
    def __init__(
        self,
        kube: kubeclient.KubeClient,
        node: str,
        state: DeviceState,
        driver_version: str = "",
        holds: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.kube = kube
        self.api = client.ResourceV1Api(kube.api)
        self.node = node
        self.state = state
        self.driver_version = driver_version
        self.holds = holds or dict
        self.name = slices.slice_name(node)
        self.syncs = 0  # writes made (tests and the metrics read it)
        self.errors = 0  # failed syncs (the metrics read it)
        self.synced = threading.Event()  # set once the server's slice matched (readiness)
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._node_uid = ""
        self._threads = [
            threading.Thread(target=self._run, name="gpupack-dra-publish", daemon=True),
            threading.Thread(target=self._watch, name="gpupack-dra-slice-watch", daemon=True),
        ]
        state.add_listener(self._dirty.set)

    def wake(self) -> None:
        """Something the slice shows changed (a claim prepared or unprepared): sync soon."""
        self._dirty.set()

    def start(self) -> None:
        self._dirty.set()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        pending = self._dirty.is_set()
        self._stop.set()
        self._dirty.set()
        self._threads[0].join(timeout=5)
        if pending:  # e.g. the last unprepare before a SIGTERM: show it, once, best effort
            try:
                self.sync()
            except (kubeclient.ApiException, KeyError, TypeError, ValueError) as e:
                log.warning("last ResourceSlice sync before stopping failed: %r", e)

    def _node(self) -> str:
        if not self._node_uid:
            node = self.kube.json(self.kube.core.read_node, self.node)
            self._node_uid = str(node["metadata"]["uid"])
        return self._node_uid

    def sync(self) -> bool:
        """Make the server's slice what this node publishes; True when it wrote anything."""
        try:
            current: dict[str, Any] | None = self.kube.json(self.api.read_resource_slice, self.name)
        except kubeclient.ApiException as e:
            if e.status != 404:
                raise
            current = None
        gen = int(((current or {}).get("spec") or {}).get("pool", {}).get("generation") or 0)
        desired = slices.resource_slice(
            self.node, self.state.gpus(), generation=max(gen, 1), node_uid=self._node(),
            driver_version=self.driver_version, holds=self.holds(),
        )  # fmt: skip
        if current is None:
            self.kube.json(self.api.create_resource_slice, desired)
            log.info("published ResourceSlice %s (%d GPUs)", self.name, len(desired["spec"]["devices"]))
        else:
            same_devices = published_devices(current) == published_devices(desired)
            same_rest = (current["spec"].get("nodeName"), current["spec"].get("driver"), (current["metadata"].get("ownerReferences") or [{}])[0].get("uid")) == (
                self.node, slices.DRIVER, self._node_uid
            )  # fmt: skip
            if same_devices and same_rest:
                return False
            if not same_devices:
                desired["spec"]["pool"]["generation"] = gen + 1  # consumers drop the older generation
            desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            self.kube.json(self.api.replace_resource_slice, self.name, desired)
            log.info(
                "updated ResourceSlice %s (pool generation %d)",
                self.name,
                desired["spec"]["pool"]["generation"],
            )
        self._remove_others()
        self.syncs += 1
        return True

    def _remove_others(self) -> None:
        """Slices of this driver for this node under another name (an older release's, a copy)."""
        raw = self.kube.json(self.api.list_resource_slice, field_selector=f"spec.nodeName={self.node}")
        for s in raw.get("items") or []:
            name = s["metadata"]["name"]
            if s["spec"].get("driver") == slices.DRIVER and name != self.name:
                try:
                    self.kube.json(self.api.delete_resource_slice, name)
                    log.info("deleted ResourceSlice %s (another slice of this node's pool)", name)
                except kubeclient.ApiException as e:
                    if e.status != 404:
                        raise

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(RESYNC_S)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self.sync()
                self.synced.set()
            except (kubeclient.ApiException, KeyError, TypeError, ValueError) as e:
                self.errors += 1
                reason = kubeclient.api_reason(e) if isinstance(e, kubeclient.ApiException) else repr(e)
                log.warning(
                    "publishing ResourceSlice %s failed: %s; retrying in %.0fs", self.name, reason, RETRY_S
                )
                self._stop.wait(RETRY_S)
                self._dirty.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(
                    self.api.list_resource_slice,
                    field_selector=f"spec.nodeName={self.node}",
                    timeout_seconds=WATCH_S,
                    _request_timeout=WATCH_S + 30,
                ):
                    if self._stop.is_set():
                        return
                    # any change of the node's slices: sync compares and writes only what differs
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._dirty.set()
            except Exception as e:  # noqa: BLE001 - a broken watch is re-opened; the resync covers the gap
                log.debug("ResourceSlice watch ended: %r", e)
                self._stop.wait(RETRY_S)
