"""The small slice of NVML the device plugin uses, behind one interface.

`PynvmlFacade` calls the real library (nvidia-ml-py); the tests' `FakeNvml`
(tests/deviceplugin/fake_nvml.py, loaded with `--nvml-module`) implements the same methods and
raises the same `pynvml.NVMLError` subclasses, so discovery and health code cannot tell them apart.
Devices are addressed by NVML index.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml

# XIDs that signal application errors, not a broken GPU (as NVIDIA's device plugin skips them):
# 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
# 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True)
class XidEvent:
    uuid: str  # "" when NVML could not say which GPU (then every GPU is suspect)
    xid: int


class NvmlFacade(Protocol):
    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def uuid(self, index: int) -> str: ...
    def name(self, index: int) -> str: ...
    def memory_total_mib(self, index: int) -> int: ...
    def sm_count(self, index: int) -> int: ...
    def pci_bus_id(self, index: int) -> str: ...
    def numa_node(self, index: int) -> int: ...
    def mig_enabled(self, index: int) -> bool: ...
    def watch_xids(self, indices: list[int]) -> None: ...
    def wait_xid(self, timeout_s: float) -> XidEvent | None: ...
    def probe(self, index: int) -> None:
        """Raise pynvml.NVMLError (GpuIsLost, Unknown, ...) when the GPU no longer answers."""
        ...


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class PynvmlFacade:
    """The real NVML through nvidia-ml-py."""

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._uuid_by_handle: dict[int, str] = {}

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        if self._events is not None:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(self._events)
            self._events = None
        pynvml.nvmlShutdown()

    def _h(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def driver_version(self) -> str:
        return _str(pynvml.nvmlSystemGetDriverVersion())

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def uuid(self, index: int) -> str:
        return _str(pynvml.nvmlDeviceGetUUID(self._h(index)))

    def name(self, index: int) -> str:
        return _str(pynvml.nvmlDeviceGetName(self._h(index)))

    def memory_total_mib(self, index: int) -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(self._h(index)).total) // (1024 * 1024)

    def sm_count(self, index: int) -> int:
        return int(pynvml.nvmlDeviceGetAttributes(self._h(index)).multiprocessorCount)

    def pci_bus_id(self, index: int) -> str:
        return _str(pynvml.nvmlDeviceGetPciInfo(self._h(index)).busId)

    def numa_node(self, index: int) -> int:
        try:
            return int(pynvml.nvmlDeviceGetNumaNodeId(self._h(index)))
        except (pynvml.NVMLError, AttributeError):
            pass
        # Older drivers: the kernel knows the NUMA node of the PCI device.
        bus = self.pci_bus_id(index).lower()
        # NVML's bus id has an 8-digit domain; sysfs uses 4.
        sysfs = bus[4:] if len(bus.split(":")[0]) == 8 else bus
        try:
            return int(Path(f"/sys/bus/pci/devices/{sysfs}/numa_node").read_text().strip())
        except (OSError, ValueError):
            return -1

    def mig_enabled(self, index: int) -> bool:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(self._h(index))
        except pynvml.NVMLError_NotSupported:
            return False
        return current == pynvml.NVML_DEVICE_MIG_ENABLE

    def watch_xids(self, indices: list[int]) -> None:
        self._events = pynvml.nvmlEventSetCreate()
        registered = 0
        for i in indices:
            h = self._h(i)
            try:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError_NotSupported:
                continue  # this GPU cannot deliver events; probes still watch it
            self._uuid_by_handle[_handle_key(h)] = self.uuid(i)
            registered += 1
        if indices and not registered:
            raise pynvml.NVMLError_NotSupported()

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        if self._events is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        try:
            data = pynvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except pynvml.NVMLError_Timeout:
            return None
        if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
            return None
        return XidEvent(uuid=self._uuid_by_handle.get(_handle_key(data.device), ""), xid=int(data.eventData))

    def probe(self, index: int) -> None:
        # Any query against a GPU that fell off the bus raises NVMLError_GpuIsLost.
        pynvml.nvmlDeviceGetUUID(self._h(index))


def _handle_key(h: Any) -> int:
    try:
        import ctypes

        return int(ctypes.cast(h, ctypes.c_void_p).value or 0)
    except (TypeError, ValueError):
        return id(h)
