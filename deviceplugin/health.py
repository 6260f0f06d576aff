"""Device state shared by serving, publishing and metrics, and the NVML health watcher.

`DeviceState` holds each GPU's health with a version number; ListAndWatch streams and the
inventory publisher wait on it. `HealthWatcher` turns NVML XID events and failed probes into
health changes. A GPU, once unhealthy, stays so until the plugin restarts (as NVIDIA's plugin).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import pynvml

from deviceplugin.nvml_facade import APPLICATION_XIDS, NvmlFacade
from gpupack.contract import GPUInfo

log = logging.getLogger("gpupack.deviceplugin.health")


class DeviceState:
    def __init__(self, gpus: tuple[GPUInfo, ...], skipped: tuple[str, ...] = ()) -> None:
        self._gpus = {g.uuid: g for g in gpus}
        self._order = [g.uuid for g in gpus]
        self.skipped = skipped
        self.version = 0
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    def gpus(self) -> tuple[GPUInfo, ...]:
        with self._cond:
            return tuple(self._gpus[u] for u in self._order)

    def health_map(self) -> dict[str, bool]:
        with self._cond:
            return {u: g.healthy for u, g in self._gpus.items()}

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def mark_unhealthy(self, uuid: str, reason: str) -> bool:
        """Return True when this changed anything."""
        with self._cond:
            g = self._gpus.get(uuid)
            if g is None or not g.healthy:
                return False
            self._gpus[uuid] = dataclasses.replace(g, healthy=False, unhealthy_reason=reason)
            self.version += 1
            self._cond.notify_all()
        log.warning(
            "GPU %s (index %d) marked unhealthy: %s",
            uuid,
            g.index,
            reason,
            extra={"gpu": g.index, "uuid": uuid},
        )
        for fn in self._listeners:
            try:
                fn()
            except Exception:  # a listener's failure must not stop health tracking
                log.exception("health listener failed")
        return True

    def wait_change(self, seen_version: int, timeout_s: float) -> int:
        """Block until version != seen_version or the timeout; return the current version."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen_version, timeout=timeout_s)
            return self.version

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()


class HealthWatcher:
    """Waits for XID events and probes every GPU; runs until stop()."""

    def __init__(
        self,
        nvml: NvmlFacade,
        state: DeviceState,
        probe_interval_s: float = 5.0,
        wait_s: float = 0.5,
        ignored_xids: frozenset[int] = APPLICATION_XIDS,
    ) -> None:
        self.nvml = nvml
        self.state = state
        self.probe_interval_s = probe_interval_s
        self.wait_s = wait_s
        self.ignored_xids = ignored_xids
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._index = {g.uuid: g.index for g in state.gpus()}

    def start(self) -> None:
        try:
            self.nvml.watch_xids(list(self._index.values()))
            self._events = True
        except pynvml.NVMLError as e:
            # Some GPUs (e.g. in containers without the capability) cannot deliver events;
            # probing still catches a GPU that is gone.
            log.warning("XID events unavailable (%s: %s); health relies on probes", type(e).__name__, e)
            self._events = False
        self._thread = threading.Thread(target=self._run, name="gpupack-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def handle_xid(self, uuid: str, xid: int) -> None:
        if xid in self.ignored_xids:
            log.info("XID %d on %s is an application error; GPU stays healthy", xid, uuid or "?")
            return
        targets = [uuid] if uuid in self._index else list(self._index)
        for u in targets:
            self.state.mark_unhealthy(u, f"XID {xid}")

    def probe_all(self) -> None:
        for uuid, index in self._index.items():
            try:
                self.nvml.probe(index)
            except pynvml.NVMLError_GpuIsLost:
                self.state.mark_unhealthy(uuid, "GPU is lost (fell off the bus)")
            except pynvml.NVMLError as e:
                self.state.mark_unhealthy(uuid, f"NVML probe failed ({type(e).__name__}: {e})")

    def _run(self) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_probe:
                    self.probe_all()
                    next_probe = time.monotonic() + self.probe_interval_s
                if self._events:
                    ev = self.nvml.wait_xid(self.wait_s)
                    if ev is not None:
                        self.handle_xid(ev.uuid, ev.xid)
                else:
                    self._stop.wait(self.wait_s)
            except pynvml.NVMLError as e:
                log.warning("NVML error in health loop (%s: %s)", type(e).__name__, e)
                self._stop.wait(self.wait_s)
