"""Read the openb trace (Alibaba cluster-trace-gpu-v2023) node and pod lists.

Only the columns the replay uses are required (openb_pod_list_multigpu20.csv has five); every
error names the file, the line and the field.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpupack.core.model import FULL

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
MAX_GPUS_PER_NODE = 64

# GPU memory per model, as the published simulator assumes (not in the trace; unused by its pods).
GPU_MEM_MIB = {"T4": 15109, "V100M16": 16160, "P100": 16280, "A10": 22731, "V100M32": 32510}
DEFAULT_GPU_MEM_MIB = 32510


class TraceError(ValueError):
    """Bad trace input; the message is one line: file, line, field, what is wrong."""


@dataclass
class NodeList:
    names: list[str]
    cpu: np.ndarray  # milli
    ram: np.ndarray  # MiB
    gpus: np.ndarray
    model: list[str]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def gpu_capacity(self) -> int:
        return int(self.gpus.sum()) * FULL


@dataclass
class PodList:
    names: list[str]
    cpu: np.ndarray
    ram: np.ndarray
    num_gpu: np.ndarray
    gpu_milli: np.ndarray  # per GPU, clamped to FULL
    spec: list[frozenset[str] | None]  # allowed models; None = any
    # The allowed models as written ("" = any): FGD's target workload keys shapes by this text.
    spec_text: list[str] | None = None

    def __len__(self) -> int:
        return len(self.names)

    @property
    def gpu_request(self) -> np.ndarray:
        return self.num_gpu * self.gpu_milli

    def take(self, idx: np.ndarray | list[int]) -> PodList:
        idx = np.asarray(idx, dtype=np.int64)
        return PodList(
            [self.names[i] for i in idx],
            self.cpu[idx],
            self.ram[idx],
            self.num_gpu[idx],
            self.gpu_milli[idx],
            [self.spec[i] for i in idx],
            None if self.spec_text is None else [self.spec_text[i] for i in idx],
        )


def _rows(path: Path, required: tuple[str, ...]):
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(f"{path}:1: empty file, expected a header with {','.join(required)}") from None
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{path}:1: unreadable header: {e}") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path}:1: missing column {missing[0]!r} (header has {','.join(header)})")
        pos = {h: i for i, h in enumerate(header)}
        line = 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except (csv.Error, UnicodeDecodeError) as e:
                raise TraceError(f"{path}:{line + 1}: malformed row: {e}") from None
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceError(f"{path}:{line}: malformed row: {len(row)} fields, header has {len(header)}")
            yield line, {h: row[i] for h, i in pos.items()}


def _int(path: Path, line: int, row: dict[str, str], field: str, minimum: int = 0) -> int:
    raw = row[field].strip()
    try:
        v = int(raw)
    except ValueError:
        try:
            fv = float(raw)
        except ValueError:
            raise TraceError(f"{path}:{line}: field {field}: {raw!r} is not a number") from None
        if not fv.is_integer():
            raise TraceError(f"{path}:{line}: field {field}: {raw!r} is not a whole number") from None
        v = int(fv)
    if v < minimum:
        raise TraceError(f"{path}:{line}: field {field}: {v} is below {minimum}")
    return v


def read_nodes(path: str | Path) -> NodeList:
    path = Path(path)
    names, cpu, ram, gpus, model = [], [], [], [], []
    for line, row in _rows(path, NODE_COLUMNS):
        names.append(row["sn"].strip())
        cpu.append(_int(path, line, row, "cpu_milli"))
        ram.append(_int(path, line, row, "memory_mib"))
        g = _int(path, line, row, "gpu")
        if g > MAX_GPUS_PER_NODE:
            raise TraceError(f"{path}:{line}: field gpu: {g} is more than {MAX_GPUS_PER_NODE}")
        gpus.append(g)
        m = row["model"].strip()
        if g and not m:
            raise TraceError(f"{path}:{line}: field model: empty for a node with {g} GPUs")
        model.append(m)
    if not names:
        raise TraceError(f"{path}: no nodes")
    return NodeList(names, np.array(cpu, np.int64), np.array(ram, np.int64), np.array(gpus, np.int64), model)


def read_pods(path: str | Path) -> PodList:
    path = Path(path)
    names, cpu, ram, num, milli, spec, text = [], [], [], [], [], [], []
    for line, row in _rows(path, POD_COLUMNS):
        names.append(row["name"].strip())
        cpu.append(_int(path, line, row, "cpu_milli"))
        ram.append(_int(path, line, row, "memory_mib"))
        n = _int(path, line, row, "num_gpu")
        if n > MAX_GPUS_PER_NODE:
            raise TraceError(f"{path}:{line}: field num_gpu: {n} is more than {MAX_GPUS_PER_NODE}")
        m = min(_int(path, line, row, "gpu_milli"), FULL)  # the replay rules clamp above one GPU
        if n == 0:
            m = 0
        elif m == 0:
            raise TraceError(f"{path}:{line}: field gpu_milli: 0 for a pod asking for {n} GPU(s)")
        elif n > 1 and m < FULL:
            raise TraceError(
                f"{path}:{line}: field gpu_milli: {m} < {FULL} with num_gpu {n} (sharing needs one GPU)"
            )
        num.append(n)
        milli.append(m)
        parts = [s.strip() for s in (row.get("gpu_spec") or "").split("|") if s.strip()]
        spec.append(frozenset(parts) or None)
        text.append("|".join(parts) if n else "")
    if not names:
        raise TraceError(f"{path}: no pods")
    return PodList(
        names,
        np.array(cpu, np.int64),
        np.array(ram, np.int64),
        np.array(num, np.int64),
        np.array(milli, np.int64),
        spec,
        text,
    )
