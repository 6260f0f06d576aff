"""The per-GPU gauges' exposition text, kept per node between scrapes.

At 5,000 nodes × 8 GPUs a scrape holds ~160,000 per-GPU samples, and prometheus_client formatted
each one anew (label names checked, values escaped, floats converted): 1.6 s of CPU a scrape,
holding the GIL beside the scheduling verbs, and the copy of every GPU under the view's lock
before it. A node's lines change only when the node changes, and every change that can change them
(a pod charged or released there, its inventory or health) gives the node a new version
(journal.Journal: versions never repeat). So each node's lines are formatted once per version and
kept; a scrape copies, under the view's lock, only the GPUs of nodes whose version moved, and
joins the rest.

The text is the one prometheus_client writes for the same samples, byte for byte (labels sorted by
name, values through its floatToGoString): `render` writes a registry with these families from the
kept text and every other family through prometheus_client. A `GpuFamily` is still a whole
`Metric`: anything reading `samples` (prometheus_client's own handler, a test) gets them, built
from the kept GPU rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gpupack.core.model import FULL

from .view import ClusterView

MIB = 1 << 20
# prometheus_client's own float format, so the text is the one it writes
_float: Callable[[float], str] = floatToGoString

# (name, help): the families, in the order they are written
FAMILIES = (
    ("gpupack_gpu_reserved_memory_bytes", "GPU memory reserved by gpupack pods"),
    ("gpupack_gpu_memory_bytes", "GPU memory of each GPU"),
    ("gpupack_gpu_reserved_sm_ratio", "Share of the SMs reserved on each GPU (0-1)"),
    ("gpupack_gpu_class", "1 for the class of the pods on a GPU"),
)

# One GPU as copied under the view's lock: node, index, uuid, model, reserved MiB, MiB, reserved
# milli-SMs, class of its pods (None when empty), healthy, free MiB, holds a pod.
Row = tuple[str, int, str, str, int, int, int, "str | None", bool, int, bool]


def _escape(v: str) -> str:
    """A label value as the text format wants it (prometheus_client's escaping)."""
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(row: Row) -> dict[str, str]:
    name, index, uuid, model = row[0], row[1], row[2], row[3]
    return {"node": name, "uuid": uuid, "index": str(index), "model": model}


def _values(row: Row) -> tuple[float, float, float]:
    return row[4] * MIB, row[5] * MIB, row[6] / FULL


@dataclass(frozen=True)
class _NodeText:
    version: int
    rows: tuple[Row, ...]
    lines: tuple[str, str, str, str]  # each family's lines for this node
    free_total: int  # free MiB on its healthy GPUs
    free_partial: int  # of which on GPUs holding a pod


def _node_text(version: int, rows: tuple[Row, ...]) -> _NodeText:
    mem: list[str] = []
    total: list[str] = []
    sm: list[str] = []
    cls: list[str] = []
    free_total = free_partial = 0
    for row in rows:
        name, index, uuid, model, _, _, _, pod_class, healthy, free, held = row
        # sorted by label name, as prometheus_client writes them: index, model, node, uuid
        labels = f'index="{index}",model="{_escape(model)}",node="{_escape(name)}",uuid="{_escape(uuid)}"'
        used, size, share = _values(row)
        mem.append(f"{FAMILIES[0][0]}{{{labels}}} {_float(used)}\n")
        total.append(f"{FAMILIES[1][0]}{{{labels}}} {_float(size)}\n")
        sm.append(f"{FAMILIES[2][0]}{{{labels}}} {_float(share)}\n")
        if pod_class:
            cls.append(f'{FAMILIES[3][0]}{{class="{_escape(pod_class)}",{labels}}} 1.0\n')
        if healthy:
            free_total += free
            if held:
                free_partial += free
    return _NodeText(version, rows, ("".join(mem), "".join(total), "".join(sm), "".join(cls)), free_total,
                     free_partial)  # fmt: skip


class GpuFamily(Metric):
    """One per-GPU gauge family, its text already written (`text`); `samples` built when read."""

    def __init__(self, position: int, nodes: list[_NodeText]) -> None:
        name, doc = FAMILIES[position]
        super().__init__(name, doc, "gauge")
        self.position = position
        self.nodes = nodes
        self.text = f"# HELP {name} {doc}\n# TYPE {name} gauge\n" + "".join(n.lines[position] for n in nodes)

    @property
    def samples(self) -> list[Sample]:
        out: list[Sample] = []
        for n in self.nodes:
            for row in n.rows:
                labels, values = _labels(row), _values(row)
                if self.position < 3:
                    out.append(Sample(self.name, labels, values[self.position]))
                elif row[7]:
                    out.append(Sample(self.name, {**labels, "class": str(row[7])}, 1.0))
        return out

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        pass  # Metric.__init__ sets []; the samples are the nodes'


@dataclass(frozen=True)
class Snapshot:
    families: list[GpuFamily]
    fragmentation: float  # share of the free GPU memory (healthy GPUs) on GPUs holding a pod
    pods: int
    pending: int


class GpuGauges:
    """Each node's lines, kept per node version (see the module's doc)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self._kept: dict[str, _NodeText] = {}
        self._lock = threading.Lock()  # one scrape at a time updates what is kept
        self.formatted = 0  # nodes whose lines were written (tests, benchmarks)

    def snapshot(self) -> Snapshot:
        with self._lock:
            changed: list[tuple[str, int, tuple[Row, ...]]] = []
            order: list[str] = []
            with self.view.lock:
                kept, infos = self._kept, self.view.nodes
                for name, node in self.view.state.nodes.items():
                    order.append(name)
                    info = infos.get(name)
                    version = info.version if info is not None else -1
                    old = kept.get(name)
                    if old is not None and version >= 0 and old.version == version:
                        continue
                    rows = tuple(
                        (
                            name,
                            g.index,
                            g.uuid,
                            g.model,
                            g.mem_used,
                            g.mem_mib,
                            g.milli_used,
                            g.pod_class,
                            g.healthy,
                            g.free_mem,
                            not g.empty,
                        )
                        for g in node.gpus
                    )
                    changed.append((name, version, rows))
                pods = len(self.view.pods)
                pending = sum(len(s) for s in self.view.locks.pending.values())
            for name, version, rows in changed:
                self._kept[name] = _node_text(version, rows)
            self.formatted += len(changed)
            if len(self._kept) > len(order):
                self._kept = {n: self._kept[n] for n in order}
            nodes = [self._kept[n] for n in order]
        free_total = sum(n.free_total for n in nodes)
        free_partial = sum(n.free_partial for n in nodes)
        return Snapshot(
            [GpuFamily(i, nodes) for i in range(len(FAMILIES))],
            free_partial / free_total if free_total else 0.0,
            pods,
            pending,
        )

    def forget(self) -> None:
        """Drop what is kept (a replica that stopped exporting: its memory back)."""
        with self._lock:
            self._kept = {}


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return (self.metric,)


def render(registry: Collector) -> bytes:
    """The registry's text exposition (prometheus_client's format, version 0.0.4): a GpuFamily from
    its kept text, every other family through prometheus_client."""
    return b"".join(_parts(registry))


def _parts(registry: Collector) -> Iterator[bytes]:
    for metric in registry.collect():
        if isinstance(metric, GpuFamily):
            yield metric.text.encode()
        else:
            yield generate_latest(_One(metric))
