"""The tidal day (`gpupack simulate --tidal`): replicas that follow a day's demand, an autoscaled
pool of GPU nodes, and night consolidation on or off.

What is simulated, in steps of `step_min` minutes over two days (the second is measured, so the
first night's state is not an artefact of the start):

- **Services** (a pod shape, a peak replica count, the hour of their peak). Demand follows a
  cosine between the peak and peak / `swing` (3-5x peak-to-trough); offline batch services peak
  at night. The replica count is what an HPA would set: up at once, down only once demand has been
  lower for the scale-down stabilisation window (5 min, the HPA default), never below the HPA's
  floor (minReplicas). Scaling down removes the pods a ReplicaSet removes first: pending ones,
  then those on the node with the most replicas of the service, newest first.
- **Placement** of new replicas through :func:`gpupack.core.policies.schedule` with gpupack's
  default policy, as the extender places them, on the nodes that are up.
- **A cluster autoscaler** driven by gpupack's autoscale controller: pods that find no place make
  it add the nodes `gpupack.core.autoscale.plan_scale_up` asks for (the first node type where the
  pod fits an empty node, packing the waiting pods on the nodes that are up, then booting, then
  added), as the real cluster-autoscaler does with gpupack's placeholder pods (calibrated against
  it: tests/extender/test_autoscale_realk8s.py; nodes still booting count, so none is added twice
  for the same pods); an added node takes `boot_min` minutes before it takes pods. A node with no GPU pod for
  `unneeded_min` minutes (CA's scale-down-unneeded-time) is removed. It never drains a node that
  holds gpupack pods (CA finds no place for a pod asking `gpupack.io/gpu-mem`, and gpupack marks
  `scale-down-disabled` on nodes whose pods have no other place).
- **Night consolidation** (`gpupack defrag --objective nodes`), hourly inside the window: the
  planner empties whole nodes within its eviction budget and the plan's verified target state
  replaces the cluster; CA removes the emptied nodes after its unneeded time. Modes: `none` (no
  consolidation), `emptiest` (the baseline: drain the least utilised nodes first, first-fit
  targets) and `gpupack` (cheapest nodes first, tightest targets on the busiest nodes).
- **Morning pre-scale** (optional): from `prescale_at` the HPA floor is raised to each service's
  replicas at `prescale_level_h`, the way deploy/examples' CronJob patches minReplicas; it is
  reset at `prescale_until`. Nodes then boot before the demand arrives.

Reported per mode (measured day): GPU-hours (GPUs holding a pod), node-hours (nodes up or
booting), evictions, and pods pending at the morning peak: replicas that demand asked for but that
were not running, between the `morning` hours (the most at once, and pod-hours). Pods a pre-scale
created ahead of demand are not counted while they wait for their node: nobody needs them yet.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gpupack.core.autoscale import NodeGroup, plan_scale_up
from gpupack.core.defrag import Limits, plan_nodes, verify_plan
from gpupack.core.model import FULL, GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policies import DEFAULT_POLICY, get_policy, schedule
from gpupack.simulate.usage import OneLineParser

MODES = ("none", "emptiest", "gpupack")


@dataclass(frozen=True)
class Service:
    name: str
    template: PodRequest  # key/namespace/owner are filled per replica
    peak: int  # replicas at the peak of demand
    peak_hour: float  # hour of day (0-24) of the peak


@dataclass(frozen=True)
class NodeType:
    name: str
    gpus: int
    model: str
    mem_mib: int
    cpu_milli: int = 0
    ram_mib: int = 0
    max_nodes: int = 10


@dataclass(frozen=True)
class Day:
    title: str
    services: tuple[Service, ...]
    node_types: tuple[NodeType, ...]


@dataclass(frozen=True)
class Settings:
    swing: float = 4.0  # peak / trough demand
    step_min: int = 5
    days: int = 2  # the last one is measured
    hpa_down_window_min: int = 5  # HPA scale-down stabilisation (default 300 s)
    boot_min: int = 10  # a node added by the autoscaler takes this long to take pods
    unneeded_min: int = 10  # CA --scale-down-unneeded-time
    window: tuple[float, float] = (1.0, 5.0)  # night consolidation window, hours
    every_min: int = 60  # a consolidation run every ... inside the window
    max_evictions: int = 20  # per consolidation run
    max_workload_share: float = 0.5
    prescale: bool = True
    prescale_at: float = 6.0  # the CronJob raising the HPA floors
    prescale_level_h: float = 10.0  # ... to the replicas demand asks for at this hour
    prescale_until: float = 11.0  # the CronJob putting the floors back
    morning: tuple[float, float] = (6.0, 12.0)  # the window "pending at the morning peak" covers
    seed: int = 1


@dataclass
class ModeResult:
    mode: str
    prescale: bool
    gpu_hours: float
    node_hours: float
    evictions: int
    consolidation_runs: int
    nodes_emptied: int
    morning_pending_max: int  # replicas demand asked for that were not running, most at once
    morning_pending_pod_hours: float  # ... summed over the morning window
    pending_pod_hours: float  # pods waiting for a place (pre-scaled ones too), whole measured day
    peak_nodes: int
    min_nodes: int
    plan_seconds: float
    series: dict[str, list[float]] = field(default_factory=dict)  # per step of the measured day


def demand_factor(hour: float, peak_hour: float, swing: float) -> float:
    """1 at the peak, 1/swing at the trough twelve hours away, a cosine in between."""
    trough = 1.0 / swing
    return trough + (1.0 - trough) * (0.5 + 0.5 * math.cos(2 * math.pi * (hour - peak_hour) / 24.0))


def replicas_at(svc: Service, hour: float, swing: float) -> int:
    return max(1, math.ceil(svc.peak * demand_factor(hour, svc.peak_hour, swing) - 1e-9))


def hpa_floor(svc: Service, swing: float) -> int:
    return max(1, math.ceil(svc.peak / swing - 1e-9))


class _Sim:
    def __init__(self, day: Day, mode: str, s: Settings) -> None:
        self.day, self.mode, self.s = day, mode, s
        self.state = ClusterState()
        self.policy = get_policy(DEFAULT_POLICY, seed=s.seed)
        for svc in day.services:
            for _ in range(svc.peak):
                self.policy.observe(svc.template)
        self.pool: dict[str, NodeType] = {}
        self.up_order: list[str] = []
        for t in day.node_types:
            for i in range(t.max_nodes):
                self.pool[f"{t.name}-{i}"] = t
        self.booting: dict[str, int] = {}  # node -> step it becomes ready
        self.empty_since: dict[str, int] = {}
        self.pods: dict[str, list[tuple[int, str]]] = {svc.name: [] for svc in day.services}  # (created, key)
        self.pending: list[str] = []  # keys, in creation order
        self.requests: dict[str, PodRequest] = {}
        self.history: dict[str, list[int]] = {svc.name: [] for svc in day.services}
        self.serial = 0

    # --- nodes ------------------------------------------------------------------------------
    def _new_node(self, name: str) -> Node:
        t = self.pool[name]
        gpus = [GPU(f"{name}-gpu{j}", j, t.model, t.mem_mib) for j in range(t.gpus)]
        return Node(name, gpus, t.cpu_milli, t.ram_mib)

    def _free_names(self, t: NodeType) -> list[str]:
        return [
            n
            for n, tt in self.pool.items()
            if tt is t and n not in self.state.nodes and n not in self.booting
        ]

    def autoscale_up(self, step: int) -> None:
        """CA scale-up as gpupack's autoscale controller drives it (extender/controllers/autoscale.py): the nodes
        `gpupack.core.autoscale.plan_scale_up` asks for the waiting pods, counting the nodes still
        booting as upcoming, as the real autoscaler counts them (tests/extender/
        test_autoscale_realk8s.py: no node is added twice for the same pods)."""
        if not self.pending:
            return
        groups = [
            NodeGroup(
                t.name,
                t.model,
                t.gpus,
                t.mem_mib,
                max_new=len(self._free_names(t)),
                cpu_milli=t.cpu_milli,
                ram_mib=t.ram_mib,
            )  # fmt: skip
            for t in self.day.node_types
        ]
        upcoming = Counter(self.pool[n].name for n in self.booting)
        plan = plan_scale_up(self.state, [self.requests[k] for k in self.pending], groups, upcoming)
        boot = max(1, round(self.s.boot_min / self.s.step_min))
        for t in self.day.node_types:
            for name in self._free_names(t)[: plan.nodes.get(t.name, 0)]:
                self.booting[name] = step + boot

    def autoscale_down(self, step: int) -> None:
        unneeded = max(1, round(self.s.unneeded_min / self.s.step_min))
        for name, node in list(self.state.nodes.items()):
            if any(not g.empty for g in node.gpus):
                self.empty_since.pop(name, None)
                continue
            since = self.empty_since.setdefault(name, step)
            if step - since >= unneeded:
                del self.state.nodes[name]
                self.empty_since.pop(name, None)

    def boot(self, step: int) -> None:
        for name, ready in list(self.booting.items()):
            if ready <= step:
                del self.booting[name]
                self.state.add_node(self._new_node(name))

    # --- replicas ---------------------------------------------------------------------------
    def desired(self, svc: Service, hour: float) -> int:
        want = replicas_at(svc, hour, self.s.swing)
        hist = self.history[svc.name]
        hist.append(want)
        keep = max(1, round(self.s.hpa_down_window_min / self.s.step_min) + 1)
        del hist[:-keep]
        n = max(hist)  # scale down only once the lower demand lasted the stabilisation window
        floor = hpa_floor(svc, self.s.swing)
        if self.s.prescale and self.s.prescale_at <= hour < self.s.prescale_until:
            floor = max(floor, replicas_at(svc, self.s.prescale_level_h, self.s.swing))
        return max(n, floor)

    def scale(self, svc: Service, want: int, step: int) -> None:
        cur = self.pods[svc.name]
        if want > len(cur):
            for _ in range(want - len(cur)):
                self.serial += 1
                key = f"{svc.name}/{svc.name}-{self.serial}"
                pod = replace(svc.template, key=key, namespace=svc.name, owner=("ReplicaSet", svc.name))
                self.requests[key] = pod
                cur.append((step, key))
                self.pending.append(key)
        elif want < len(cur):
            # The ReplicaSet's choice: unscheduled first, then the node with most replicas, newest.
            per_node = Counter(self.state.pods[k][1].node for _, k in cur if k in self.state.pods)

            def rank(item: tuple[int, str]) -> tuple:
                created, k = item
                if k not in self.state.pods:
                    return (0, 0, -created)
                return (1, -per_node[self.state.pods[k][1].node], -created)

            for item in sorted(cur, key=rank)[: len(cur) - want]:
                cur.remove(item)
                k = item[1]
                if k in self.state.pods:
                    self.state.release(k)
                else:
                    self.pending.remove(k)
                del self.requests[k]

    def place_pending(self) -> None:
        left = []
        for key in self.pending:
            d = schedule(self.state, self.requests[key], self.policy)
            if not d.placed:
                left.append(key)
        self.pending = left

    # --- consolidation ----------------------------------------------------------------------
    def consolidate(self) -> tuple[int, int, float]:
        limits = Limits(
            max_evictions=self.s.max_evictions,
            max_per_node=0,
            max_per_namespace=0,
            max_workload_share=self.s.max_workload_share,
        )
        t0 = time.perf_counter()
        plan = plan_nodes(self.state, None, limits, order="emptiest" if self.mode == "emptiest" else "ratio")
        took = time.perf_counter() - t0
        if plan.moves:
            self.state = verify_plan(self.state, plan)
        return plan.evictions, len(plan.nodes_freed), took

    # --- the day ----------------------------------------------------------------------------
    def run(self) -> ModeResult:
        s = self.s
        steps_per_day = 24 * 60 // s.step_min
        hours = s.step_min / 60.0
        measured_from = (s.days - 1) * steps_per_day
        # Start with the first night's pods already placed (nodes added as needed, at once).
        for svc in self.day.services:
            self.scale(svc, self.desired(svc, 0.0), 0)
        for _ in range(50):
            self.place_pending()
            if not self.pending:
                break
            self.autoscale_up(0)
            self.boot(10**9)
        gpu_h = node_h = pend_h = morning_h = 0.0
        evictions = runs = emptied = morning_max = 0
        nodes_seen: list[int] = []
        plan_s = 0.0
        series: dict[str, list[float]] = {"hour": [], "nodes": [], "gpus_used": [], "pending": []}
        every = max(1, round(s.every_min / s.step_min))
        for step in range(s.days * steps_per_day):
            hour = (step % steps_per_day) * s.step_min / 60.0
            self.boot(step)
            for svc in self.day.services:
                self.scale(svc, self.desired(svc, hour), step)
            self.place_pending()
            measured = step >= measured_from
            in_window = s.window[0] <= hour < s.window[1]
            if self.mode != "none" and in_window and (step % steps_per_day) % every == 0:
                ev, fr, took = self.consolidate()
                if measured:
                    evictions += ev
                    emptied += fr
                    runs += 1
                    plan_s += took
            self.autoscale_up(step)
            self.autoscale_down(step)
            if measured:
                used = sum(1 for n in self.state.nodes.values() for g in n.gpus if not g.empty)
                nodes = len(self.state.nodes) + len(self.booting)
                gpu_h += used * hours
                node_h += nodes * hours
                pend_h += len(self.pending) * hours
                if s.morning[0] <= hour < s.morning[1]:
                    # What users feel: replicas demand asks for that are not running. Pods a
                    # pre-scale created ahead of demand may wait for their node without harm.
                    short = 0
                    for svc in self.day.services:
                        running = sum(1 for _, k in self.pods[svc.name] if k in self.state.pods)
                        short += max(0, replicas_at(svc, hour, s.swing) - running)
                    morning_h += short * hours
                    morning_max = max(morning_max, short)
                nodes_seen.append(nodes)
                series["hour"].append(round(hour, 4))
                series["nodes"].append(nodes)
                series["gpus_used"].append(used)
                series["pending"].append(len(self.pending))
        return ModeResult(
            mode=self.mode,
            prescale=s.prescale,
            gpu_hours=round(gpu_h, 2),
            node_hours=round(node_h, 2),
            evictions=evictions,
            consolidation_runs=runs,
            nodes_emptied=emptied,
            morning_pending_max=morning_max,
            morning_pending_pod_hours=round(morning_h, 3),
            pending_pod_hours=round(pend_h, 3),
            peak_nodes=max(nodes_seen),
            min_nodes=min(nodes_seen),
            plan_seconds=round(plan_s, 3),
            series=series,
        )


def simulate(day: Day, settings: Settings, modes: tuple[str, ...] = MODES) -> dict:
    """Every mode on the same day (same services, pool and seed), with the morning pre-scale and
    (when it is on) without; no consolidation and the emptiest-first baseline are in the same run."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    variants = [settings, replace(settings, prescale=False)] if settings.prescale else [settings]
    results = [_Sim(day, m, v).run() for v in variants for m in modes]
    base = {r.prescale: r for r in results if r.mode == "none"}
    out: dict = {
        "day": day.title,
        "services": len(day.services),
        "peak_replicas": sum(s.peak for s in day.services),
        "pool_nodes": sum(t.max_nodes for t in day.node_types),
        "settings": asdict(settings),
        "results": [],
    }
    for r in results:
        d = asdict(r)
        b = base.get(r.prescale)
        if b is not None:  # against no consolidation with the same pre-scale setting
            d["node_hours_saved"] = round(b.node_hours - r.node_hours, 2)
            d["node_hours_saved_pct"] = round(100 * (b.node_hours - r.node_hours) / b.node_hours, 2)
            d["gpu_hours_saved"] = round(b.gpu_hours - r.gpu_hours, 2)
        out["results"].append(d)
    return out


# --- the days --------------------------------------------------------------------------------


def embedded_day(swing: float = 4.0) -> Day:
    """The embedded inference fleet (gpupack.simulate.fleet) as a day: each service's peak is twice
    its replica count there; online services peak in the afternoon (staggered by kind), offline
    batch work at night. Node types are the fleet's, up to four times its node counts."""
    from gpupack.simulate.fleet import FLEET, GIB, SERVICES

    kind_peak = {"classifier": 14.0, "embedding": 15.0, "speech": 13.0, "llm": 16.0, "diffusion": 18.0}
    services = []
    for svc in SERVICES:
        mem = int(svc.mem_gib * GIB)
        fits = frozenset(m.name for m, _, _ in FLEET if m.mem_mib >= mem)
        if svc.whole:
            c = ContainerRequest("server", svc.gpus)
        else:
            c = ContainerRequest("server", svc.gpus, mem_mib=mem, milli=svc.sm_pct * 10)
        tpl = PodRequest("", svc.pod_class, (c,), gpu_models=fits)
        peak_h = 3.0 if svc.pod_class == "offline" else kind_peak.get(svc.kind, 15.0)
        services.append(Service(svc.name, tpl, max(1, 2 * svc.replicas), peak_h))
    types = tuple(
        NodeType(f"{m.name.lower()}", per, m.name, m.mem_mib, max_nodes=4 * count) for m, per, count in FLEET
    )
    return Day(f"embedded fleet: {len(services)} services, swing {swing:g}x", tuple(services), types)


def _hour_histogram(path: Path) -> dict[tuple, list[float]]:
    """Per GPU pod shape, the hours of day its pods were created in the trace (creation_time is
    seconds from the trace's start)."""
    out: dict[tuple, list[float]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            try:
                num, milli = int(row["num_gpu"]), min(int(row["gpu_milli"]), FULL)
                created = float(row.get("creation_time") or "nan")
            except (KeyError, ValueError):
                continue
            if num <= 0 or math.isnan(created):
                continue
            shape = (
                num,
                milli,
                (row.get("gpu_spec") or "").strip(),
                int(row["cpu_milli"]),
                int(row["memory_mib"]),
            )
            out.setdefault(shape, []).append((created % 86400) / 3600.0)
    return out


def openb_day(
    pod_csv: str | Path,
    node_csv: str | Path,
    nodes: int = 40,
    services: int = 24,
    fill: float = 0.8,
    swing: float = 4.0,
    seed: int = 1,
) -> Day:
    """A day built from the openb trace: its `services` most common GPU pod shapes (GPU count,
    share, model constraint, CPU and memory) become services, each peaking at the circular mean
    of the hour of day its pods were created at in the trace (the trace counts seconds from its
    own start, not from local midnight, so all peaks are turned together until the busiest hour
    is 15:00; the services keep their spread), with peak replicas in proportion to
    the shape's frequency so that the peak asks for `fill` of the GPUs of `nodes` nodes drawn
    (seeded) from the trace's node list; those node types form the autoscaled pool (each up to
    twice its count in the draw)."""
    from gpupack.simulate.openb import DEFAULT_GPU_MEM_MIB, GPU_MEM_MIB, read_nodes

    node_list = read_nodes(node_csv)
    rng = random.Random(seed)
    idx = sorted(rng.sample(range(len(node_list)), min(nodes, len(node_list))))
    kinds: Counter = Counter()
    spec: dict[tuple, tuple[int, int, int]] = {}
    for i in idx:
        g = int(node_list.gpus[i])
        if g == 0:
            continue
        k = (node_list.model[i], g, int(node_list.cpu[i]), int(node_list.ram[i]))
        kinds[k] += 1
        spec[k] = (g, int(node_list.cpu[i]), int(node_list.ram[i]))
    types = tuple(
        NodeType(
            f"{model.lower()}-{g}g-{j}",
            g,
            model,
            GPU_MEM_MIB.get(model, DEFAULT_GPU_MEM_MIB),
            cpu,
            ram,
            max_nodes=2 * n,
        )
        for j, ((model, g, cpu, ram), n) in enumerate(sorted(kinds.items()))
    )
    models = {t.model for t in types}
    hist = _hour_histogram(Path(pod_csv))
    shapes = [
        (sh, hrs)
        for sh, hrs in sorted(hist.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        if not sh[2] or set(sh[2].split("|")) & models
    ][:services]
    if not shapes:
        raise ValueError(f"{pod_csv}: no GPU pod shapes with a creation_time that fit the drawn nodes")
    cap = sum(t.gpus * (t.max_nodes // 2) for t in types) * FULL
    weight = sum(len(h) * sh[0] * sh[1] for sh, h in shapes)

    def circular_mean(hours: list[float], weights: list[float]) -> float:
        ang = [2 * math.pi * h / 24 for h in hours]
        x = sum(w * math.cos(a) for a, w in zip(ang, weights, strict=True))
        y = sum(w * math.sin(a) for a, w in zip(ang, weights, strict=True))
        return (math.atan2(y, x) * 24 / (2 * math.pi)) % 24

    means = [circular_mean(hrs, [1.0] * len(hrs)) for _, hrs in shapes]
    busiest = circular_mean(means, [len(h) * sh[0] * sh[1] for sh, h in shapes])
    out = []
    for n, (sh, hrs) in enumerate(shapes):
        num, milli, gspec, cpu, ram = sh
        peak_h = (means[n] - busiest + 15.0) % 24
        share = len(hrs) * num * milli / weight
        peak = max(1, round(fill * cap * share / (num * milli)))
        c = ContainerRequest("main", num) if milli >= FULL else ContainerRequest("main", 1, milli=milli)
        allowed = frozenset(gspec.split("|")) & models if gspec else None
        tpl = PodRequest("", "online", (c,), cpu_milli=cpu, ram_mib=ram, gpu_models=allowed or None)
        out.append(Service(f"openb-{n:02d}", tpl, peak, round(peak_h, 2)))
    return Day(
        f"openb day: {len(out)} services from {Path(pod_csv).name}, {len(idx)} nodes drawn from "
        f"{Path(node_csv).name}, swing {swing:g}x",
        tuple(out),
        types,
    )


# --- output -----------------------------------------------------------------------------------


def format_table(out: dict) -> str:
    lines = [
        f"{out['day']}: {out['services']} services, {out['peak_replicas']} replicas at their peaks, "
        f"pool of {out['pool_nodes']} nodes",
        f"{'consolidation':<14}{'pre-scale':>10}{'node-h':>9}{'saved':>8}{'GPU-h':>9}{'evictions':>11}"
        f"{'emptied':>9}{'morning pending max':>21}{'pod-h':>8}{'nodes min-max':>15}",
    ]
    for r in out["results"]:
        saved = r.get("node_hours_saved_pct")
        lines.append(
            f"{r['mode']:<14}{'on' if r['prescale'] else 'off':>10}{r['node_hours']:>9.1f}"
            f"{'' if saved is None else f'{saved:.1f}%':>8}{r['gpu_hours']:>9.1f}{r['evictions']:>11}"
            f"{r['nodes_emptied']:>9}{r['morning_pending_max']:>21}{r['morning_pending_pod_hours']:>8.2f}"
            f"{str(r['min_nodes']) + '-' + str(r['peak_nodes']):>15}"
        )
    return "\n".join(lines)


def chart(outs: list[dict], path: Path) -> Path:
    from gpupack.simulate.chart import pyplot
    from gpupack.simulate.chart import save as save_chart

    plt = pyplot()

    fig, axes = plt.subplots(len(outs), 2, figsize=(13, 4.2 * len(outs)), squeeze=False)
    colors = {"none": "#999999", "emptiest": "#ff7f0e", "gpupack": "#2ca02c"}
    for row, out in zip(axes, outs, strict=True):
        ax, bars = row
        for r in out["results"]:
            style = "-" if r["prescale"] else ":"
            label = f"{r['mode']}" + ("" if r["prescale"] else " (no pre-scale)")
            ax.plot(r["series"]["hour"], r["series"]["nodes"], style, color=colors[r["mode"]], label=label)
        ax.set_xlabel("hour of day")
        ax.set_ylabel("nodes up or booting")
        ax.set_xlim(0, 24)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(out["day"], fontsize=9)
        names = [r["mode"] + ("" if r["prescale"] else "\nno pre-scale") for r in out["results"]]
        vals = [r["node_hours"] for r in out["results"]]
        b = bars.bar(range(len(vals)), vals, color=[colors[r["mode"]] for r in out["results"]])
        for rect, r in zip(b, out["results"], strict=True):
            bars.annotate(
                f"{r['node_hours']:.0f} node-h\n{r['gpu_hours']:.0f} GPU-h\n{r['evictions']} evictions\n"
                f"{r['morning_pending_max']} pending 6-12h",
                (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        bars.set_xticks(range(len(vals)), names, fontsize=8)
        bars.set_ylim(0, max(vals) * 1.35)
        bars.set_ylabel("node-hours (measured day)")
    fig.tight_layout()
    return save_chart(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="gpupack simulate --tidal", description="A tidal day with and without night consolidation."
    )
    p.add_argument("--tidal", action="store_true", help=argparse.SUPPRESS)  # accepted from the dispatcher
    p.add_argument(
        "--preemption",
        action="store_true",
        help="instead: offline jobs fill the night, online demand returns, with and without GPU-aware "
        "preemption (options: gpupack simulate --tidal --preemption --help)",
    )
    p.add_argument("--trace", help="openb pod list CSV: also simulate a day built from it")
    p.add_argument("--nodes", help="openb node list CSV (with --trace)")
    p.add_argument("--sample-nodes", type=int, default=40, help="nodes drawn for the openb day (default 40)")
    p.add_argument("--swing", type=float, default=4.0, help="peak-to-trough demand ratio, 3-5 (default 4)")
    p.add_argument(
        "--max-evictions", type=int, default=20, help="evictions per consolidation run (default 20)"
    )
    p.add_argument("--no-prescale", action="store_true", help="no morning pre-scale")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="simulate-out", help="directory for tidal.png (default ./simulate-out)")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1.0 < args.swing <= 10.0 or args.max_evictions < 0:
        print("gpupack simulate --tidal: need 1 < --swing <= 10 and --max-evictions >= 0", file=sys.stderr)
        return 2
    if bool(args.trace) != bool(args.nodes):
        print("gpupack simulate --tidal: --trace and --nodes go together", file=sys.stderr)
        return 2
    settings = Settings(
        swing=args.swing, max_evictions=args.max_evictions, prescale=not args.no_prescale, seed=args.seed
    )
    outs = [simulate(embedded_day(args.swing), settings)]
    if args.trace:
        try:
            day = openb_day(args.trace, args.nodes, nodes=args.sample_nodes, swing=args.swing, seed=args.seed)
        except (OSError, ValueError) as e:
            print(f"gpupack simulate --tidal: {e}", file=sys.stderr)
            return 2
        outs.append(simulate(day, settings))
    doc: dict = {"days": outs}
    if not args.no_chart:
        doc["chart"] = str(chart(outs, Path(args.out) / "tidal.png"))
    if args.json:
        for o in doc["days"]:
            for r in o["results"]:
                r.pop("series", None)
        print(json.dumps(doc, indent=2))
        return 0
    for o in outs:
        print(format_table(o))
        print()
    if "chart" in doc:
        print(f"chart {doc['chart']}")
    return 0
