"""A fake NVML for tests and the no-GPU demo, with the same interface as `PynvmlFacade`.

Test code, never installed: the plugin process loads it with
`PYTHONPATH=tests/deviceplugin gpupack device-plugin --nvml-module fake_nvml --nvml-config CONFIG`,
where CONFIG is a YAML file or inline YAML/JSON (see :func:`make_nvml`).

It raises the real `pynvml.NVMLError` subclasses, so the code above it runs exactly as on a
real node. Configured from a small YAML/dict:

    gpus: 8                    # how many GPUs
    model: NVIDIA H200         # name NVML reports
    memory_mib: 143771
    sm_count: 132
    numa_nodes: 2              # GPUs are spread evenly over NUMA nodes
    mig: [3]                   # indices of GPUs in MIG mode
    driver: "550.54.15"
    uuid_seed: node-a          # GPU UUIDs derive from it (stable across restarts)
    faults:
      init: DriverNotLoaded    # nvmlInit fails with this NVMLError (LibraryNotFound, ...)
      errors:                  # per-GPU call failures: index -> {method: NVMLError name}
        5: {sm_count: NotSupported}
      xids:                    # XID events delivered after a delay (seconds since watch_xids)
        - {gpu: 2, xid: 79, after_s: 1.5}
      lost:                    # GPUs that fall off the bus after a delay
        - {gpu: 4, after_s: 3}
      xid_file: /tmp/x         # lines "GPU XID" appended to this file are delivered as XID events
                               # (fault injection into a plugin running as its own process)

Tests may also inject faults at run time with :meth:`FakeNvml.inject_xid` and :meth:`FakeNvml.lose`.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import yaml

from deviceplugin.nvml_facade import XidEvent

H200_MIB = 143771
H200_SMS = 132


class FakeConfigError(ValueError):
    pass


def nvml_error(name: str) -> pynvml.NVMLError:
    """An instance of pynvml's exception class for `name` ("GpuIsLost", "NVMLError_Unknown", ...)."""
    cls_name = name if name.startswith("NVMLError_") else f"NVMLError_{name}"
    cls = getattr(pynvml, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, pynvml.NVMLError)):
        raise FakeConfigError(
            f"unknown NVML error {name!r} (use a pynvml.NVMLError_* name such as GpuIsLost)"
        )
    return cls()


def fake_uuid(seed: str, index: int) -> str:
    """A stable, UUID-shaped GPU id: the same config gives the same ids after a restart."""
    h = hashlib.sha1(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass
class FakeGPU:
    index: int
    uuid: str
    name: str
    memory_mib: int
    sm_count: int
    pci_bus_id: str
    numa_node: int
    mig: bool = False
    lost: bool = False
    errors: dict[str, str] = field(default_factory=dict)


class FakeNvml:
    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        cfg = dict(config or {})
        try:
            n = int(cfg.get("gpus", 1))
            model = str(cfg.get("model", "NVIDIA H200"))
            mem = int(cfg.get("memory_mib", H200_MIB))
            sms = int(cfg.get("sm_count", H200_SMS))
            numa = max(1, int(cfg.get("numa_nodes", 1)))
            mig = {int(i) for i in cfg.get("mig", []) or []}
            faults = dict(cfg.get("faults", {}) or {})
        except (TypeError, ValueError) as e:
            raise FakeConfigError(f"fake NVML config: {e}") from e
        if n < 0 or mem <= 0 or sms <= 0:
            raise FakeConfigError("fake NVML config: gpus >= 0, memory_mib > 0 and sm_count > 0 required")
        seed = str(cfg.get("uuid_seed", "gpupack-fake"))
        self.driver = str(cfg.get("driver", "550.54.15"))
        self._init_error = faults.get("init")
        if self._init_error:
            nvml_error(str(self._init_error))  # validate the name now
        self.gpus = [
            FakeGPU(
                index=i,
                uuid=fake_uuid(seed, i),
                name=model,
                memory_mib=mem,
                sm_count=sms,
                pci_bus_id=f"00000000:{0x18 + i * 0x10 & 0xFF:02X}:00.0",
                numa_node=i * numa // max(n, 1),
                mig=i in mig,
            )
            for i in range(n)
        ]
        for idx, errs in (faults.get("errors", {}) or {}).items():
            for method, err in dict(errs).items():
                nvml_error(str(err))
                self._gpu(int(idx)).errors[str(method)] = str(err)
        self._timed: list[tuple[float, str, int, int]] = []  # (after_s, kind, gpu, xid)
        for x in faults.get("xids", []) or []:
            self._timed.append((float(x.get("after_s", 0)), "xid", int(x["gpu"]), int(x["xid"])))
        for x in faults.get("lost", []) or []:
            self._timed.append((float(x.get("after_s", 0)), "lost", int(x["gpu"]), 79))
        self._xid_file = str(faults.get("xid_file") or "")
        self._xid_file_seen = 0  # lines of it already delivered
        self._events: queue.Queue[XidEvent] = queue.Queue()
        self._watch_started: float | None = None
        self._initialized = False
        self._lock = threading.Lock()

    # --- construction helpers -----------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> FakeNvml:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise FakeConfigError(f"fake NVML config {path}: {e}") from e
        if not isinstance(data, dict):
            raise FakeConfigError(f"fake NVML config {path}: expected a mapping")
        return cls(data)

    @classmethod
    def from_text(cls, text: str) -> FakeNvml:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise FakeConfigError(f"fake NVML config: {e}") from e
        if not isinstance(data, dict):
            raise FakeConfigError("fake NVML config: expected a mapping")
        return cls(data)

    # --- run-time fault injection -----------------------------------------------------------------
    def inject_xid(self, index: int, xid: int) -> None:
        self._events.put(XidEvent(uuid=self._gpu(index).uuid, xid=xid))

    def lose(self, index: int) -> None:
        """The GPU falls off the bus: every later call on it raises NVMLError_GpuIsLost."""
        with self._lock:
            self._gpu(index).lost = True

    # --- facade -----------------------------------------------------------------------------------
    def _gpu(self, index: int) -> FakeGPU:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return self.gpus[index]

    def _call(self, index: int, method: str) -> FakeGPU:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        g = self._gpu(index)
        if g.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if method in g.errors:
            raise nvml_error(g.errors[method])
        return g

    def init(self) -> None:
        if self._init_error:
            raise nvml_error(str(self._init_error))
        self._initialized = True

    def shutdown(self) -> None:
        self._initialized = False

    def driver_version(self) -> str:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        return self.driver

    def device_count(self) -> int:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        return len(self.gpus)

    def uuid(self, index: int) -> str:
        return self._call(index, "uuid").uuid

    def name(self, index: int) -> str:
        return self._call(index, "name").name

    def memory_total_mib(self, index: int) -> int:
        return self._call(index, "memory_total_mib").memory_mib

    def sm_count(self, index: int) -> int:
        return self._call(index, "sm_count").sm_count

    def pci_bus_id(self, index: int) -> str:
        return self._call(index, "pci_bus_id").pci_bus_id

    def numa_node(self, index: int) -> int:
        return self._call(index, "numa_node").numa_node

    def mig_enabled(self, index: int) -> bool:
        return self._call(index, "mig_enabled").mig

    def watch_xids(self, indices: list[int]) -> None:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        for i in indices:
            self._call(i, "watch_xids")
        self._watch_started = time.monotonic()

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        if self._watch_started is None:
            raise pynvml.NVMLError_Uninitialized()
        self._fire_timed()
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            self._fire_timed()
            return None

    def _fire_timed(self) -> None:
        assert self._watch_started is not None
        self._fire_file()
        elapsed = time.monotonic() - self._watch_started
        due = [t for t in self._timed if t[0] <= elapsed]
        self._timed = [t for t in self._timed if t[0] > elapsed]
        for _, kind, gpu, xid in sorted(due):
            if kind == "lost":
                self.lose(gpu)
            else:
                self.inject_xid(gpu, xid)

    def _fire_file(self) -> None:
        if not self._xid_file:
            return
        try:
            lines = Path(self._xid_file).read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines[self._xid_file_seen :]:
            gpu, xid = line.split()
            self.inject_xid(int(gpu), int(xid))
        self._xid_file_seen = len(lines)

    def probe(self, index: int) -> None:
        self._call(index, "probe")


def make_nvml(config: str | None) -> FakeNvml:
    """`--nvml-module fake_nvml` entry point: CONFIG is a YAML file or inline YAML/JSON text."""
    if not config:
        return FakeNvml()
    if not config.lstrip().startswith("{") and Path(config).is_file():
        return FakeNvml.from_file(config)
    return FakeNvml.from_text(config)
