"""GPU nodes whose admission goes through the kubelet's real device manager (``devicemanager-harness``,
Kubernetes v1.28.7) and a real ``gpupack device-plugin`` process per node (the fake NVML of
tests/deviceplugin), for soaks of the bind -> Allocate handoff.

Each node has a long-lived plugin process, which publishes the node's GPU inventory and labels as on
a real node. A bound pod is admitted by one harness run against that plugin, one pod at a time per
node as the kubelet admits (nodes admit in parallel); the env each container would receive (the
harness's "allocate" events) is compared with ``handoff.container_env`` of the pod's assignment. A
pod whose admission fails is set Failed, as the kubelet does (UnexpectedAdmissionError). The plugin
of a node can be SIGKILLed and restarted (:meth:`DeviceManagerNode.restart_plugin`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import realk8s
from kubernetes import client

from gpupack import handoff
from gpupack.contract import (
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    ANN_INVENTORY,
    RES_GPU,
    SLOTS_PER_GPU,
    ContractError,
    decode_assignment,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deviceplugin"))
from harness import HarnessDir, harness_pod, plugin_command  # noqa: E402

H100_MIB = 81559


class DeviceManagerNode:
    """One fake node: its Node object, its plugin process and its device manager runs."""

    def __init__(self, cp: realk8s.ControlPlane, name: str, gpus: int, kubeconfig: Path) -> None:
        self.cp, self.name, self.gpus, self.kubeconfig = cp, name, gpus, kubeconfig
        self.dirs = HarnessDir()
        # the kubelet admits one pod at a time; a plugin restart waits for the admission in flight
        self.lock = threading.Lock()
        self.nvml = {"gpus": gpus, "numa_nodes": 1, "uuid_seed": name,
                     "model": "NVIDIA H100 80GB HBM3", "memory_mib": H100_MIB}  # fmt: skip
        self.plugin: subprocess.Popen[bytes] | None = None
        self.plugin_starts = 0
        cp.make_node(name, extended={RES_GPU: str(gpus * SLOTS_PER_GPU)})
        self._start_plugin()

    def _start_plugin(self) -> None:
        self.plugin_starts += 1
        log = (self.dirs.base / f"plugin-{self.plugin_starts}.log").open("w")
        self.plugin = subprocess.Popen(
            ["/bin/sh", "-c", plugin_command(self.name, self.dirs.kubelet_dir, self.kubeconfig, self.nvml)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def wait_inventory(self, timeout: float = 60) -> None:
        realk8s.until(
            lambda: ANN_INVENTORY in (self.cp.core.read_node(self.name).metadata.annotations or {}),
            timeout, f"the device plugin's inventory on {self.name}",
        )  # fmt: skip

    def restart_plugin(self) -> float:
        """SIGKILL the plugin between two admissions (pods bound here keep waiting) and start a new
        one; seconds until the new process runs."""
        with self.lock:
            t0 = time.monotonic()
            self._kill_plugin(signal.SIGKILL)
            self._start_plugin()
            return time.monotonic() - t0

    def _kill_plugin(self, sig: int) -> None:
        if self.plugin is not None and self.plugin.poll() is None:
            os.killpg(self.plugin.pid, sig)
            try:
                self.plugin.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.plugin.pid, signal.SIGKILL)
                self.plugin.wait(5)

    def admit(self, pod: dict[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
        """One device manager run for `pod`: exit code, container -> "allocate" event."""
        h = self.dirs.harness
        rc = h.run([harness_pod(pod)], keep_checkpoint=True, wait_s=30)
        with (self.dirs.base / "admissions.log").open("a") as f:  # what each run saw, for a post-mortem
            evs = [{k: e.get(k) for k in ("event", "container", "device_ids", "error", "exit")} for e in h.events
                   if e.get("event") in ("allocate", "error", "done")]  # fmt: skip
            ann = pod["metadata"].get("annotations") or {}
            line = {"t": time.time(), "pod": pod["metadata"]["name"], "rv": pod["metadata"].get("resourceVersion"),
                    "handoff": ann.get(ANN_HANDOFF), "assignment": ann.get(ANN_ASSIGNMENT), "rc": rc, "events": evs}  # fmt: skip
            f.write(json.dumps(line) + "\n")
        return rc, h.allocations(pod["metadata"]["uid"])

    def close(self, keep_logs: Path | None = None) -> None:
        """Stop the plugin; its and the harness's logs are copied to `keep_logs`/<node> first."""
        self._kill_plugin(signal.SIGTERM)
        if keep_logs is not None:
            dest = keep_logs / self.name
            dest.mkdir(parents=True, exist_ok=True)
            for f in self.dirs.base.glob("*.log"):
                shutil.copy(f, dest / f.name)
        self.dirs.close()


def handoff_state(pod: dict[str, Any]) -> str:
    ann = pod["metadata"].get("annotations") or {}
    return f"{ann.get(ANN_HANDOFF)!r} (rv {pod['metadata'].get('resourceVersion')})"


def env_mismatches(pod: dict[str, Any], allocs: dict[str, dict[str, Any]]) -> list[str]:
    """How the env (and device IDs) each GPU container received differ from its assignment."""
    name = pod["metadata"]["name"]
    try:
        a = decode_assignment((pod["metadata"].get("annotations") or {})[ANN_ASSIGNMENT], pod=name)
    except (KeyError, ContractError) as e:
        return [f"{name}: no readable assignment ({e})"]
    out = []
    for c in handoff.gpu_containers(handoff.pod_view(pod)):
        shares = a.containers.get(c.name)
        ev = allocs.get(c.name)
        if not shares or ev is None:
            out.append(f"{name}/{c.name}: assigned {shares}, allocate event {ev is not None}")
            continue
        want = handoff.container_env(shares)
        if ev.get("envs") != want:
            out.append(f"{name}/{c.name}: env {ev.get('envs')} != {want}")
        got = {d.split("::")[0] for d in (ev.get("device_ids") or {}).get(RES_GPU, [])}
        if got != {s.uuid for s in shares}:
            out.append(f"{name}/{c.name}: device IDs {ev.get('device_ids')} for {[s.uuid for s in shares]}")
    return out


class DeviceManagerKubelet(realk8s.KubeletEmulator):
    """A KubeletEmulator whose admission is a real device manager run on the pod's node: Running and
    Ready when it succeeds, Failed (UnexpectedAdmissionError) when it does not, as the kubelet."""

    def __init__(self, cp: realk8s.ControlPlane, namespace: str, nodes: dict[str, DeviceManagerNode]) -> None:
        super().__init__(cp, namespace)
        self.nodes = nodes
        self.api = client.CoreV1Api(cp.new_api_client())
        self.mu = threading.Lock()
        self.admitted: dict[str, str] = {}  # pod name -> node
        self.rejected: dict[str, str] = {}  # pod name -> why
        self.env_mismatches: list[str] = []
        self.env_checked = 0  # containers whose env was compared
        self.harness_runs = 0
        self.harness_s = 0.0
        self.in_flight: dict[str, threading.Event] = {}  # pod uid -> set when its admission has ended
        # pod name -> its admission waits for this (a late admission: the soak's janitor gives up the
        # pod's handoff and lets the next pod be bound first)
        self.hold: dict[str, threading.Event] = {}
        self.started: dict[str, int] = {}  # pod name -> containers that started (got run options)

    def _handle(self, pod: Any) -> None:
        meta = pod.metadata
        done = self.in_flight.get(meta.uid)
        if (
            meta.deletion_timestamp is not None
            and pod.spec.node_name
            and done is not None
            and not done.is_set()
        ):
            # the kubelet's sync loop ends an admission before it handles that pod's deletion: the
            # pod object stays until then, as on a real node
            threading.Thread(target=self._confirm_after, args=(pod, done), daemon=True).start()
            return
        super()._handle(pod)

    def _confirm_after(self, pod: Any, done: threading.Event) -> None:
        done.wait(120)
        realk8s.confirm_deletion(self.api, pod)

    def _read(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.api.read_namespaced_pod(name, ns, _preload_content=False).data)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def _admit(self, v1pod: Any) -> None:
        ns, name = v1pod.metadata.namespace, v1pod.metadata.name
        node = self.nodes.get(v1pod.spec.node_name)
        if name in self.hold:
            self.hold[name].wait(60)
        try:
            if node is None:
                return
            with node.lock:
                done = self.in_flight[v1pod.metadata.uid] = threading.Event()
                try:
                    pod = self._read(ns, name)
                    if pod is None or pod["metadata"].get("deletionTimestamp"):
                        return  # deleted before admission: a kubelet never admits it
                    t0 = time.monotonic()
                    rc, allocs = node.admit(pod)
                    errors = [e.get("error") for e in node.dirs.harness.errors()]  # before the next run
                finally:
                    done.set()
                with self.mu:
                    self.started[name] = len(allocs)
                    self.harness_runs += 1
                    self.harness_s += time.monotonic() - t0
            after = self._read(ns, name)
            if after is None or after["metadata"].get("deletionTimestamp"):
                return  # deleted while it was admitted: nothing of it is left to run
            if rc != 0:
                # containers of a refused pod that started anyway must still have got their own GPU
                bad = env_mismatches(after, allocs) if allocs else []
                with self.mu:
                    self.env_checked += len(allocs)
                    self.env_mismatches.extend(bad)
                    self.rejected[name] = (
                        f"exit {rc} on {node.name}; handoff {handoff_state(pod)} before, {handoff_state(after)}"
                        f" after: {errors}"
                    )
                status = {"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                     "message": f"device manager run exited {rc}"}}  # fmt: skip
                self.api.patch_namespaced_pod_status(name, ns, status)
                return
            bad = env_mismatches(after, allocs)
            with self.mu:
                self.admitted[name] = node.name
                self.env_checked += len(allocs)
                self.env_mismatches.extend(bad)
            self.api.patch_namespaced_pod_status(name, ns, realk8s.running_ready_status(v1pod))
        except client.ApiException as e:
            if e.status != 404:
                self.errors.append(f"{name}: {e.status} {e.reason}")
        except Exception as e:
            self.errors.append(f"{name}: {e!r}")


def start_nodes(
    cp: realk8s.ControlPlane, names: list[str], gpus: int, kubeconfig: Path
) -> dict[str, DeviceManagerNode]:
    """The nodes with their plugins, once every plugin has published its inventory."""
    nodes = {n: DeviceManagerNode(cp, n, gpus, kubeconfig) for n in names}
    for n in nodes.values():
        n.wait_inventory()
    return nodes


def random_restart(nodes: dict[str, DeviceManagerNode], rng: random.Random) -> str:
    node = nodes[rng.choice(sorted(nodes))]
    took = node.restart_plugin()
    return f"device plugin of {node.name} SIGKILLed and restarted ({took:.1f} s to relaunch)"
