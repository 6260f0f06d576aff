"""GPU discovery through the NVML facade: what this node has, and what it cannot offer."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pynvml

from deviceplugin.nvml_facade import NvmlFacade
from gpupack.contract import GPUInfo


class NvmlUnavailable(RuntimeError):
    """No driver or no NVML library: the plugin cannot run on this node."""


@dataclass(frozen=True)
class DiscoveredGPU:
    info: GPUInfo
    mig: bool = False


@dataclass(frozen=True)
class Discovery:
    driver: str
    gpus: tuple[GPUInfo, ...]  # offered to the scheduler
    skipped: tuple[str, ...]  # not offered, each with its reason

    def to_json(self) -> str:
        return json.dumps(
            {"driver": self.driver, "gpus": [asdict(g) for g in self.gpus], "skipped": list(self.skipped)},
            indent=2,
        )

    def table(self) -> str:
        head = ("IDX", "UUID", "MODEL", "MEM MiB", "SMs", "PCI BUS", "NUMA", "HEALTH")
        rows = [
            (
                str(g.index),
                g.uuid,
                g.model,
                str(g.mem_mib),
                str(g.sm_count),
                g.pci_bus_id,
                str(g.numa_node),
                "healthy" if g.healthy else f"unhealthy: {g.unhealthy_reason}",
            )
            for g in self.gpus
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [f"driver {self.driver}, {len(self.gpus)} GPU(s) offered"]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]
        ]
        lines += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def _err(e: pynvml.NVMLError) -> str:
    return f"{type(e).__name__}: {e}"


def init_nvml(nvml: NvmlFacade) -> str:
    """nvmlInit and the driver version; NvmlUnavailable with a one-line reason on failure."""
    try:
        nvml.init()
        return nvml.driver_version()
    except pynvml.NVMLError as e:
        hint = ""
        if isinstance(e, pynvml.NVMLError_LibraryNotFound | pynvml.NVMLError_DriverNotLoaded):
            hint = " (is the NVIDIA driver installed and libnvidia-ml.so.1 visible to this container?)"
        raise NvmlUnavailable(f"NVML is not available: {_err(e)}{hint}") from e


def discover(nvml: NvmlFacade) -> Discovery:
    """Enumerate GPUs (NVML must be initialised). A GPU that fails a query is skipped, not fatal.

    GPUs in MIG mode are skipped: gpupack shares whole GPUs by memory and SM percentage, which
    does not apply to MIG instances (those are partitioned by the hardware already).
    """
    try:
        driver = nvml.driver_version()
        count = nvml.device_count()
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML is not available: {_err(e)}") from e
    gpus: list[GPUInfo] = []
    skipped: list[str] = []
    for i in range(count):
        try:
            uuid = nvml.uuid(i)
        except pynvml.NVMLError as e:
            skipped.append(f"GPU index {i}: cannot read its UUID ({_err(e)})")
            continue
        try:
            if nvml.mig_enabled(i):
                skipped.append(
                    f"{uuid} (index {i}): MIG mode is enabled; gpupack shares whole GPUs "
                    "(disable MIG, or serve this GPU with a MIG-aware device plugin)"
                )
                continue
            gpus.append(
                GPUInfo(
                    uuid=uuid,
                    index=i,
                    model=nvml.name(i),
                    mem_mib=nvml.memory_total_mib(i),
                    sm_count=nvml.sm_count(i),
                    numa_node=nvml.numa_node(i),
                    pci_bus_id=nvml.pci_bus_id(i),
                )
            )
        except pynvml.NVMLError as e:
            skipped.append(f"{uuid} (index {i}): NVML query failed ({_err(e)})")
    return Discovery(driver=driver, gpus=tuple(gpus), skipped=tuple(skipped))
