"""The tidal day with GPU-aware preemption (`gpupack simulate --tidal --preemption`): offline batch
jobs fill the night, online demand returns in the morning; with and without preemption.

A discrete-event simulation over a fixed pool of GPU nodes (no autoscaler: preemption matters
when no node can be added), on the same days as `gpupack simulate --tidal` (the embedded fleet,
or one built from the openb trace):

- **Online serving** replicas follow the tidal demand curve of gpupack.simulate.tidal (a cosine
  between each service's peak and peak / swing), re-evaluated every `hpa_interval_s` as an HPA
  would: up at once, down only once demand has been lower for the stabilisation window. Scaling
  down removes pending replicas first, then the newest running ones. Their PriorityClass is the
  example `gpupack-online` (100000, PreemptLowerPriority).
- **Offline batch jobs** (the day's offline pod shapes, or its online shapes run as offline work
  when it has none) arrive as a seeded Poisson process through the night window, each with a run
  time; enough of them that the night offers `offline_load` times the GPU room online leaves at
  its trough. They run to completion where they find room (FIFO), on any GPU online leaves, day
  or night. PriorityClass `gpupack-offline` (1000, preemptionPolicy Never: offline work waits
  rather than evicting other offline work).
- **Placement** through :func:`gpupack.core.policies.schedule` with gpupack's default policy, as
  the extender places pods; online pods first (kube-scheduler's queue orders by priority).
- **Preemption** (mode `preempt`): an online pod that finds no room asks
  :func:`gpupack.core.preemption.choose` for victims among the running pods, as the extender's
  controller does: the room is held (its GPUs taken out of every other pod's choice, as the
  reservation does), the victims terminate for `grace_s` (their terminationGracePeriodSeconds)
  and then the preemptor is placed on the room. A victim loses the progress since its last
  checkpoint (`checkpoint_min`, default 0: no checkpoints, all of it) and is queued again.
  Without preemption (mode `none`) the online pod waits until room frees, as in a cluster
  without it.

The packing invariants (no over-commit, online and offline never on one GPU) are checked after
every scheduling pass (:func:`gpupack.core.model.invariant_violations`); a break stops the run.
Reported per mode, for the measured (last) day: online pods' time to placement, offline work
lost, done and run, and GPU utilisation.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gpupack.contract import CLASS_OFFLINE, CLASS_ONLINE
from gpupack.core.model import FULL, GPU, ClusterState, Node, PlacementError, PodRequest, invariant_violations
from gpupack.core.policies import DEFAULT_POLICY, get_policy, schedule
from gpupack.core.preemption import Choice, Preemptor, Victim, choose, may_evict
from gpupack.simulate.tidal import Day, NodeType, Service, demand_factor, embedded_day, openb_day
from gpupack.simulate.usage import OneLineParser

MODES = ("none", "preempt")
ONLINE_PRIORITY = 100_000  # deploy/examples/priorityclasses.yaml: gpupack-online
OFFLINE_PRIORITY = 1_000  # gpupack-offline, preemptionPolicy: Never


class InvariantBroken(AssertionError):
    """The simulated cluster broke a packing or preemption rule: a bug, never a result."""


@dataclass(frozen=True)
class JobShape:
    name: str
    template: PodRequest  # class offline; key/namespace are filled per job
    weight: float  # share of the arrivals


@dataclass(frozen=True)
class Scenario:
    title: str
    pool: tuple[tuple[NodeType, int], ...]  # node type, how many (fixed)
    online: tuple[Service, ...]
    offline: tuple[JobShape, ...]


@dataclass(frozen=True)
class Settings:
    swing: float = 4.0  # peak / trough online demand
    days: int = 2  # the last one is measured
    hpa_interval_s: int = 60  # replicas follow demand this often
    hpa_down_window_s: int = 300  # HPA scale-down stabilisation
    night: tuple[float, float] = (20.0, 4.0)  # offline jobs arrive between these hours (wrapping)
    offline_load: float = 1.5  # offered offline work / the GPU room online leaves at its trough
    run_h: tuple[float, float] = (2.0, 8.0)  # an offline job's run time, uniform
    checkpoint_min: float = 0.0  # a victim keeps its progress up to its last checkpoint; 0: none
    grace_s: float = 30.0  # victims' terminationGracePeriodSeconds
    online_priority: int = ONLINE_PRIORITY
    offline_priority: int = OFFLINE_PRIORITY
    offline_may_preempt: bool = False  # gpupack-offline's preemptionPolicy: Never
    check: bool = True  # the invariants after every pass
    seed: int = 1

    def validate(self) -> None:
        if not 1.0 < self.swing <= 10.0:
            raise ValueError(f"swing must be in (1, 10], not {self.swing}")
        if self.days < 1 or self.hpa_interval_s < 1 or self.hpa_down_window_s < 0:
            raise ValueError("need days >= 1, hpa_interval_s >= 1 and hpa_down_window_s >= 0")
        if self.offline_load < 0 or self.checkpoint_min < 0 or self.grace_s < 0:
            raise ValueError("offline_load, checkpoint_min and grace_s must be >= 0")
        lo, hi = self.run_h
        if not 0 < lo <= hi:
            raise ValueError(f"run_h must be 0 < low <= high, not {self.run_h}")
        if not all(0 <= h < 24 for h in self.night) or self.night[0] == self.night[1]:
            raise ValueError(f"night must be two different hours in [0, 24), not {self.night}")


@dataclass
class Job:
    key: str
    shape: int
    arrived: float
    run_s: float
    weight: float  # GPU-equivalents it holds while running (GPUs x SM share)
    done_s: float = 0.0  # progress kept from earlier runs (checkpoints)
    started: float | None = None
    gen: int = 0  # bumps on eviction, so a stale finish event is ignored
    evictions: int = 0
    finished: float | None = None
    terminating: bool = False


@dataclass
class Hold:
    """A preemptor's room: its victims terminating, the GPUs held for it until they are gone."""

    choice: Choice
    decided: float
    withdrawn: bool = False  # the preemptor was scaled away; its victims go all the same


@dataclass
class ModeResult:
    mode: str
    online_created: int
    online_placed: int
    online_waited: int  # placed later than created
    online_withdrawn: int  # scaled away while still pending
    online_pending_at_end: int
    wait_mean_s: float
    wait_p50_s: float
    wait_p95_s: float
    wait_p99_s: float
    wait_max_s: float
    preemptions: int  # online pods placed on room freed by evictions
    jobs_evicted: int
    evictions_per_online_placed: float
    offline_gpu_hours_lost: float
    offline_jobs_done: int
    offline_gpu_hours_done: float
    offline_gpu_hours_run: float
    gpu_busy_pct: float  # GPUs holding any pod, time-weighted
    sm_alloc_pct: float  # SM share allocated, time-weighted; online and offline below
    sm_online_pct: float
    sm_offline_pct: float
    handovers_failed: int  # a held room the preemptor could not take (must stay 0)
    series: dict[str, list[float]] = field(default_factory=dict)
    preemption_log: list[dict] = field(default_factory=list)


def job_weight(pod: PodRequest) -> float:
    """GPU-equivalents a pod holds: its GPUs times its SM share (a whole GPU is 1)."""
    return sum(c.gpus * (FULL if c.milli is None else c.milli) / FULL for c in pod.containers)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def offline_arrivals(sc: Scenario, s: Settings) -> list[tuple[float, int, float]]:
    """(time s, shape index, run s) of every offline job, seeded: the same for every mode."""
    if not sc.offline or s.offline_load == 0:
        return []
    rng = random.Random(s.seed)
    capacity = sum(t.gpus * n for t, n in sc.pool)
    trough = sum(max(1, math.ceil(svc.peak / s.swing - 1e-9)) * job_weight(svc.template) for svc in sc.online)
    room = max(0.0, capacity - trough)
    weights = [j.weight for j in sc.offline]
    mean_w = sum(j.weight * job_weight(j.template) for j in sc.offline) / sum(weights)
    mean_run = sum(s.run_h) / 2
    per_hour = s.offline_load * room / (mean_w * mean_run)  # concurrency = rate x run time
    if per_hour <= 0:  # online leaves no room even at its trough
        return []
    start, end = s.night
    window = (end - start) % 24
    out = []
    for day in range(-1, s.days):  # the night before the first day reaches into it when it wraps
        t = (day * 24 + start) * 3600.0
        stop = t + window * 3600
        while True:
            t += rng.expovariate(per_hour) * 3600
            if t >= stop:
                break
            shape = rng.choices(range(len(sc.offline)), weights)[0]
            run = rng.uniform(*s.run_h) * 3600
            if 0 <= t < s.days * 86400:
                out.append((t, shape, run))
    return out


class _Sim:
    def __init__(self, sc: Scenario, mode: str, s: Settings) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.sc, self.mode, self.s = sc, mode, s
        self.state = ClusterState()
        for t, count in sc.pool:
            for i in range(count):
                name = f"{t.name}-{i}"
                gpus = [GPU(f"{name}-gpu{j}", j, t.model, t.mem_mib) for j in range(t.gpus)]
                self.state.add_node(Node(name, gpus, t.cpu_milli, t.ram_mib))
        self.policy = get_policy(DEFAULT_POLICY, seed=s.seed)
        for svc in sc.online:
            for _ in range(svc.peak):
                self.policy.observe(svc.template)
        for j in sc.offline:
            self.policy.observe(j.template)
        self.requests: dict[str, PodRequest] = {}
        self.replicas: dict[str, list[tuple[float, str]]] = {svc.name: [] for svc in sc.online}
        self.history: dict[str, list[int]] = {svc.name: [] for svc in sc.online}
        self.created: dict[str, float] = {}  # online pod -> created at
        self.pending_online: dict[str, None] = {}  # insertion-ordered set
        self.holds: dict[str, Hold] = {}  # preemptor -> its held room
        self.jobs: dict[str, Job] = {}
        self.queue: dict[str, None] = {}  # offline jobs waiting, FIFO
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.serial = 0
        self.room_freed = True
        self.victims_added = False
        self.touched: set[str] = set()  # nodes whose pods changed since the last check
        # Shapes (a service's or job kind's name) that found no room; placing pods only takes
        # room away, so they stay here until some is freed.
        self.shape_of: dict[str, str] = {}
        self.no_room: set[str] = set()
        self.measure_from = (s.days - 1) * 86400.0
        self.end = s.days * 86400.0
        # measured-day tallies
        self.waits: list[float] = []
        self.withdrawn = 0
        self.preemptions = 0
        self.evicted = 0
        self.lost_gh = 0.0
        self.done_jobs = 0
        self.done_gh = 0.0
        self.acc = {"busy": 0.0, "sm": 0.0, "sm_on": 0.0, "sm_off": 0.0}
        self.handovers_failed = 0
        self.log: list[dict] = []
        self.series: dict[str, list[float]] = {
            "hour": [],
            "online_pending": [],
            "sm_online": [],
            "sm_offline": [],
        }

    # --- events -----------------------------------------------------------------------------
    def push(self, t: float, kind: str, key: str = "", gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, key, gen))

    # --- accounting -------------------------------------------------------------------------
    def _usage(self) -> tuple[int, float, float]:
        busy, on, off = 0, 0.0, 0.0
        for n in self.state.nodes.values():
            for g in n.gpus:
                if g.empty:
                    continue
                busy += 1
                used = g.milli_used / FULL
                if g.pod_class == CLASS_OFFLINE:
                    off += used
                else:
                    on += used
        return busy, on, off

    def _integrate(self, t0: float, t1: float) -> None:
        a, b = max(t0, self.measure_from), min(t1, self.end)
        if b <= a:
            return
        dt = (b - a) / 3600.0
        busy, on, off = self._usage()
        self.acc["busy"] += busy * dt
        self.acc["sm"] += (on + off) * dt
        self.acc["sm_on"] += on * dt
        self.acc["sm_off"] += off * dt

    # --- online replicas --------------------------------------------------------------------
    def _desired(self, svc: Service, hour: float) -> int:
        want = max(1, math.ceil(svc.peak * demand_factor(hour, svc.peak_hour, self.s.swing) - 1e-9))
        hist = self.history[svc.name]
        hist.append(want)
        keep = self.s.hpa_down_window_s // self.s.hpa_interval_s + 1
        del hist[:-keep]
        return max(hist)

    def _scale(self, svc: Service, want: int, t: float) -> None:
        cur = self.replicas[svc.name]
        while len(cur) < want:
            self.serial += 1
            key = f"{svc.name}/{svc.name}-{self.serial}"
            pod = replace(svc.template, key=key, namespace=svc.name, owner=("ReplicaSet", svc.name))
            self.requests[key] = pod
            self.shape_of[key] = svc.name
            self.created[key] = t
            cur.append((t, key))
            self.pending_online[key] = None
        if len(cur) <= want:
            return

        # The ReplicaSet's order: unscheduled pods first, then the newest.
        def rank(item: tuple[float, str]) -> tuple[bool, float]:
            return (item[1] in self.state.pods, -item[0])

        for item in sorted(cur, key=rank)[: len(cur) - want]:
            cur.remove(item)
            key = item[1]
            if key in self.state.pods:
                self._release(key)
            else:
                self.pending_online.pop(key, None)
                if self.created[key] >= self.measure_from:
                    self.withdrawn += 1
                hold = self.holds.get(key)
                if hold is not None:  # its victims were told to go: they go at the handover
                    hold.withdrawn = True
            del self.requests[key]
            del self.shape_of[key]

    # --- offline jobs -----------------------------------------------------------------------
    def _arrive(self, shape: int, run_s: float, t: float) -> None:
        self.serial += 1
        js = self.sc.offline[shape]
        key = f"batch/{js.name}-{self.serial}"
        pod = replace(js.template, key=key, namespace="batch", owner=("Job", f"{js.name}-{self.serial}"))
        self.requests[key] = pod
        self.shape_of[key] = f"batch/{js.name}"
        self.jobs[key] = Job(key, shape, t, run_s, job_weight(pod))
        self.queue[key] = None

    def _start(self, job: Job, t: float) -> None:
        job.started = t
        self.victims_added = self.mode == "preempt"
        self.push(t + job.run_s - job.done_s, "finish", job.key, job.gen)

    def _release(self, key: str) -> None:
        self.touched.add(self.state.pods[key][1].node)
        self.state.release(key)
        self.room_freed = True
        self.no_room.clear()

    def _finish(self, job: Job, t: float) -> None:
        self._release(job.key)
        job.finished, job.started = t, None
        if t >= self.measure_from:
            self.done_jobs += 1
            self.done_gh += job.weight * job.run_s / 3600

    def _evicted(self, job: Job, t: float) -> None:
        """A victim is gone: its progress since the last checkpoint is lost; it queues again."""
        assert job.started is not None
        progress = job.done_s + (t - job.started)
        step = self.s.checkpoint_min * 60
        kept = math.floor(progress / step) * step if step > 0 else 0.0
        if t >= self.measure_from:
            self.lost_gh += job.weight * (progress - kept) / 3600
            self.evicted += 1
        self._release(job.key)
        job.done_s, job.started, job.terminating = kept, None, False
        job.gen += 1
        job.evictions += 1
        self.queue[job.key] = None

    # --- preemption -------------------------------------------------------------------------
    def _hold(self, choice: Choice) -> None:
        node = self.state.nodes[choice.node]
        for i in choice.fit.charged:
            node.gpus[i].healthy = False

    def _unhold(self, hold: Hold) -> None:
        node = self.state.nodes[hold.choice.node]
        for i in hold.choice.fit.charged:
            node.gpus[i].healthy = True
        self.no_room.clear()

    def _victims(self) -> dict[str, Victim]:
        """Every running pod as the chooser sees it; terminating ones are already spoken for."""
        out: dict[str, Victim] = {}
        for key, (pod, _, _) in self.state.pods.items():
            job = self.jobs.get(key)
            if job is not None and job.terminating:
                continue
            prio = self.s.offline_priority if pod.pod_class == CLASS_OFFLINE else self.s.online_priority
            out[key] = Victim(key, prio, pod.pod_class)
        return out

    def preemptor(self, pod: PodRequest) -> Preemptor:
        if pod.pod_class == CLASS_OFFLINE:
            return Preemptor(pod, self.s.offline_priority, self.s.offline_may_preempt)
        return Preemptor(pod, self.s.online_priority, True)

    def _preempt(self, key: str, t: float) -> bool:
        pre = self.preemptor(self.requests[key])
        if not pre.may_preempt:
            return False
        pool = self._victims()
        # Only nodes holding a pod this one may evict can help (it fits on none as they are).
        on = {p[1].node for k, p in self.state.pods.items() if k in pool and may_evict(pre, pool[k])}
        choice = choose((self.state.nodes[n] for n in sorted(on)), pre, pool)
        if choice is None:
            return False
        for v in choice.victims:
            if not may_evict(pre, pool[v]):
                raise InvariantBroken(
                    f"{key} (priority {pre.priority}) chose {v} (priority {pool[v].priority})"
                )
        hold = Hold(choice, t)
        if not choice.victims:  # it fits as it is there (the policy's view differed): place it
            self._take(key, hold, t)
            return True
        for v in choice.victims:
            self.jobs[v].terminating = True
        self._hold(choice)
        self.holds[key] = hold
        self.pending_online.pop(key, None)
        self.log.append(
            {
                "t": t,
                "preemptor": key,
                "class": pre.pod.pod_class,
                "priority": pre.priority,
                "node": choice.node,
                "victims": [(v, pool[v].priority, pool[v].pod_class) for v in choice.victims],
            }
        )
        self.push(t + self.s.grace_s, "handover", key)
        return True

    def _handover(self, key: str, t: float) -> None:
        hold = self.holds.pop(key)
        for v in hold.choice.victims:
            job = self.jobs[v]
            if job.terminating and v in self.state.pods:  # (one that finished meanwhile is done)
                self._evicted(job, t)
            job.terminating = False
        self._unhold(hold)
        if not hold.withdrawn:
            self._take(key, hold, t)

    def _take(self, key: str, hold: Hold, t: float) -> None:
        try:
            self.state.place(self.requests[key], hold.choice.fit.placement, hold.choice.fit.charged)
        except PlacementError:
            self.handovers_failed += 1
            self.pending_online[key] = None
            return
        self.touched.add(hold.choice.node)
        self.pending_online.pop(key, None)
        self._placed(key, t, preempted=bool(hold.choice.victims))

    def _placed(self, key: str, t: float, preempted: bool = False) -> None:
        if self.created[key] >= self.measure_from:
            self.waits.append(t - self.created[key])
            self.preemptions += preempted

    # --- the scheduler ----------------------------------------------------------------------
    def _could_fit(self, pod: PodRequest) -> bool:
        """A necessary condition for `schedule` to place the pod: some node has, for each of its
        containers, enough GPUs that could take that container alone. Only saves the simulator
        the failing fits (and their explanations); `schedule` still decides."""
        for node in self.state.nodes.values():
            if not node.schedulable:
                continue
            ok = True
            for c in pod.containers:
                n = 0
                for g in node.gpus:
                    if not g.healthy or (pod.gpu_models is not None and g.model not in pod.gpu_models):
                        continue
                    if g.empty or (
                        not c.exclusive
                        and not g.exclusive
                        and g.pod_class in (None, pod.pod_class)
                        and g.free_mem >= (c.mem_mib or 0)
                        and g.free_milli >= (c.milli or 0)
                    ):
                        n += 1
                if n < c.gpus:
                    ok = False
                    break
            if ok:
                return True
        return False

    def _schedule(self, pod: PodRequest) -> bool:
        if not self._could_fit(pod):
            return False
        d = schedule(self.state, pod, self.policy)
        if d.node is not None:
            self.touched.add(d.node)
        return d.placed

    def _check(self, t: float, full: bool = False) -> None:
        """The packing invariants on the nodes whose pods changed (all of them when `full`): a
        node's checks depend only on its GPUs and the pods placed on it."""
        if not self.s.check:
            return
        names = set(self.state.nodes) if full else self.touched
        self.touched = set()
        if not names:
            return
        sub = ClusterState(
            {n: self.state.nodes[n] for n in names},
            {k: p for k, p in self.state.pods.items() if p[1].node in names},
        )
        bad = invariant_violations(sub)
        if bad:
            raise InvariantBroken(f"t={t:.0f}s: " + "; ".join(bad[:5]))

    def _pass(self, t: float, new_online: bool, new_jobs: bool) -> None:
        # Retried only when something changed that could let a pod in: new pods, room freed, or
        # (with preemption) new running pods that could be victims.
        if self.pending_online and (new_online or self.room_freed or self.victims_added):
            for key in list(self.pending_online):
                shape = self.shape_of[key]
                if shape not in self.no_room:
                    if self._schedule(self.requests[key]):
                        del self.pending_online[key]
                        self._placed(key, t)
                        continue
                    self.no_room.add(shape)
                if self.mode == "preempt":
                    self._preempt(key, t)
        if self.queue and (new_jobs or self.room_freed):
            for key in list(self.queue):
                shape = self.shape_of[key]
                if shape in self.no_room:
                    continue
                if self._schedule(self.requests[key]):
                    del self.queue[key]
                    self._start(self.jobs[key], t)
                else:
                    self.no_room.add(shape)
        self.room_freed = self.victims_added = False
        self._check(t)

    # --- the day ----------------------------------------------------------------------------
    def run(self, arrivals: list[tuple[float, int, float]]) -> ModeResult:
        s = self.s
        for i, (t, shape, _) in enumerate(arrivals):
            self.push(t, "arrive", str(shape), i)
        runs = {i: run for i, (_, _, run) in enumerate(arrivals)}
        t_hpa = 0.0
        while t_hpa < self.end:
            self.push(t_hpa, "hpa")
            t_hpa += s.hpa_interval_s
        sample = 15 * 60.0
        t_sample = self.measure_from
        while t_sample < self.end:
            self.push(t_sample, "sample")
            t_sample += sample
        last = 0.0
        while self.events:
            t = self.events[0][0]
            if t >= self.end:
                break
            self._integrate(last, t)
            last = t
            new_online = new_jobs = False
            for kind, key, gen in self._due(t):
                if kind == "hpa":
                    hour = (t % 86400) / 3600
                    for svc in self.sc.online:
                        n = len(self.replicas[svc.name])
                        self._scale(svc, self._desired(svc, hour), t)
                        new_online = new_online or len(self.replicas[svc.name]) > n
                elif kind == "arrive":
                    self._arrive(int(key), runs[gen], t)
                    new_jobs = True
                elif kind == "finish":
                    job = self.jobs[key]
                    if job.gen == gen and job.started is not None:
                        self._finish(job, t)
                elif kind == "handover":
                    self._handover(key, t)
                elif kind == "sample":
                    self._check(t, full=True)
                    _, on, off = self._usage()
                    cap = sum(len(n.gpus) for n in self.state.nodes.values())
                    self.series["hour"].append(round((t - self.measure_from) / 3600, 3))
                    self.series["online_pending"].append(self._waiting())
                    self.series["sm_online"].append(round(100 * on / cap, 2))
                    self.series["sm_offline"].append(round(100 * off / cap, 2))
            self._pass(t, new_online, new_jobs)
        self._integrate(last, self.end)
        self._check(self.end, full=True)
        return self._result()

    def _waiting(self) -> int:
        """Online pods created and not placed: pending, or waiting for their victims to go."""
        return len(self.pending_online) + sum(not h.withdrawn for h in self.holds.values())

    def _due(self, t: float) -> Iterator[tuple[str, str, int]]:
        while self.events and self.events[0][0] == t:
            _, _, kind, key, gen = heapq.heappop(self.events)
            yield kind, key, gen

    def _result(self) -> ModeResult:
        cap = sum(len(n.gpus) for n in self.state.nodes.values()) * (self.end - self.measure_from) / 3600
        w = self.waits
        placed = len(w)
        run_h = self.acc["sm_off"]
        return ModeResult(
            mode=self.mode,
            online_created=sum(1 for t in self.created.values() if t >= self.measure_from),
            online_placed=placed,
            online_waited=sum(1 for x in w if x > 0),
            online_withdrawn=self.withdrawn,
            online_pending_at_end=self._waiting(),
            wait_mean_s=round(sum(w) / placed, 1) if placed else 0.0,
            wait_p50_s=round(percentile(w, 50), 1),
            wait_p95_s=round(percentile(w, 95), 1),
            wait_p99_s=round(percentile(w, 99), 1),
            wait_max_s=round(max(w, default=0.0), 1),
            preemptions=self.preemptions,
            jobs_evicted=self.evicted,
            evictions_per_online_placed=round(self.evicted / placed, 4) if placed else 0.0,
            offline_gpu_hours_lost=round(self.lost_gh, 2),
            offline_jobs_done=self.done_jobs,
            offline_gpu_hours_done=round(self.done_gh, 2),
            offline_gpu_hours_run=round(run_h, 2),
            gpu_busy_pct=round(100 * self.acc["busy"] / cap, 2),
            sm_alloc_pct=round(100 * self.acc["sm"] / cap, 2),
            sm_online_pct=round(100 * self.acc["sm_on"] / cap, 2),
            sm_offline_pct=round(100 * self.acc["sm_off"] / cap, 2),
            handovers_failed=self.handovers_failed,
            series=self.series,
            preemption_log=self.log,
        )


# --- the scenarios ----------------------------------------------------------------------------


def from_day(day: Day, pool_share: float) -> Scenario:
    """A tidal day as a preemption scenario: its online services follow demand, its offline
    services' shapes (weighted by their peaks) are the night's jobs, or its online shapes run as
    offline work when it has none; the pool is fixed at `pool_share` of each node type's maximum."""
    online = tuple(s for s in day.services if s.template.pod_class != CLASS_OFFLINE)
    offline = tuple(s for s in day.services if s.template.pod_class == CLASS_OFFLINE) or online
    jobs = tuple(
        JobShape(s.name, replace(s.template, pod_class=CLASS_OFFLINE), float(s.peak)) for s in offline
    )
    pool = tuple((t, max(1, round(t.max_nodes * pool_share))) for t in day.node_types)
    return Scenario(day.title.replace("swing", "fixed pool, swing"), pool, online, jobs)


POOL_SHARE = 0.375  # the embedded day's pool: 19 nodes, 104 GPUs, 1.5 times the fleet's


def embedded_scenario(swing: float = 4.0, pool_share: float = POOL_SHARE) -> Scenario:
    """The embedded fleet's day (gpupack simulate --tidal) on a fixed pool."""
    sc = from_day(embedded_day(swing), pool_share)
    assert all(s.template.pod_class == CLASS_ONLINE for s in sc.online)
    return sc


def simulate(sc: Scenario, settings: Settings, modes: tuple[str, ...] = MODES) -> dict:
    """Every mode on the same arrivals (the same online demand and the same offline jobs)."""
    settings.validate()
    arrivals = offline_arrivals(sc, settings)
    results = [_Sim(sc, m, settings).run(arrivals) for m in modes]
    return {
        "day": sc.title,
        "nodes": sum(n for _, n in sc.pool),
        "gpus": sum(t.gpus * n for t, n in sc.pool),
        "online_services": len(sc.online),
        "online_peak_replicas": sum(s.peak for s in sc.online),
        "offline_jobs": len(arrivals),
        "settings": asdict(settings),
        "results": [asdict(r) for r in results],
    }


# --- output -----------------------------------------------------------------------------------


def format_table(out: dict) -> str:
    lines = [
        f"{out['day']}: {out['nodes']} nodes, {out['gpus']} GPUs, {out['online_services']} online services "
        f"({out['online_peak_replicas']} replicas at their peaks), {out['offline_jobs']} offline jobs",
        "online time to placement (s)          waited  mean     p50     p95     p99     max",
    ]
    for r in out["results"]:
        lines.append(
            f"  {r['mode']:<34}{r['online_waited']:>7}/{r['online_placed']:<5}{r['wait_mean_s']:>7.0f}"
            f"{r['wait_p50_s']:>8.0f}{r['wait_p95_s']:>8.0f}{r['wait_p99_s']:>8.0f}{r['wait_max_s']:>8.0f}"
        )
    lines.append("offline work (GPU-h) and utilisation  evicted  per online  lost    done (jobs)    "
                 "busy GPUs  SM online+offline")  # fmt: skip
    for r in out["results"]:
        lines.append(
            f"  {r['mode']:<34}{r['jobs_evicted']:>7}{r['evictions_per_online_placed']:>11.3f}"
            f"{r['offline_gpu_hours_lost']:>7.1f}{r['offline_gpu_hours_done']:>9.1f} ({r['offline_jobs_done']})"
            f"{r['gpu_busy_pct']:>10.1f}%{r['sm_online_pct']:>9.1f}+{r['sm_offline_pct']:.1f}%"
        )
    return "\n".join(lines)


def chart(outs: list[dict], path: Path) -> Path:
    from gpupack.simulate.chart import pyplot
    from gpupack.simulate.chart import save as save_chart

    plt = pyplot()
    fig, axes = plt.subplots(len(outs), 2, figsize=(13, 4.2 * len(outs)), squeeze=False)
    colors = {"none": "#999999", "preempt": "#2ca02c"}
    for row, out in zip(axes, outs, strict=True):
        use, pend = row
        for r in out["results"]:
            c, ser = colors.get(r["mode"], "#1f77b4"), r["series"]
            use.plot(ser["hour"], ser["sm_online"], "-", color=c, label=f"{r['mode']}: online")
            use.plot(ser["hour"], ser["sm_offline"], ":", color=c, label=f"{r['mode']}: offline")
            pend.step(
                ser["hour"],
                ser["online_pending"],
                where="post",
                color=c,
                label=f"{r['mode']}: p99 {r['wait_p99_s']:.0f} s, {r['offline_gpu_hours_lost']:.0f} GPU-h lost",
            )
        use.set_ylabel("SM share allocated, % of the pool")
        pend.set_ylabel("online pods waiting")
        for ax in row:
            ax.set_xlabel("hour of the measured day")
            ax.set_xlim(0, 24)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        use.set_title(out["day"], fontsize=9)
    fig.tight_layout()
    return save_chart(fig, path)


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = OneLineParser(
        prog="gpupack simulate --tidal --preemption",
        description="A day where offline jobs fill the night and online demand returns in the morning, "
        "on a fixed pool, with and without GPU-aware preemption (docs/defrag.md).",
    )
    p.add_argument("--tidal", action="store_true", help=argparse.SUPPRESS)  # accepted from the dispatcher
    p.add_argument("--preemption", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", help="openb pod list CSV: also simulate a day built from it")
    p.add_argument("--nodes", help="openb node list CSV (with --trace)")
    p.add_argument("--sample-nodes", type=int, default=40, help="nodes drawn for the openb day (default 40)")
    p.add_argument(
        "--pool-share",
        type=float,
        default=POOL_SHARE,
        help="the fixed pool, as a share of each node type's maximum in the tidal day "
        f"(default {POOL_SHARE}: the embedded day's 19 nodes, 104 GPUs; the openb day's drawn nodes at 0.5)",
    )
    p.add_argument(
        "--swing", type=float, default=d.swing, help="online peak-to-trough demand ratio (default 4)"
    )
    p.add_argument(
        "--offline-load",
        type=float,
        default=d.offline_load,
        help="offline work offered at night / GPU room online leaves at its trough (default 1.5)",
    )
    p.add_argument(
        "--run-hours", default="2-8", help="offline job run time, uniform LOW-HIGH hours (default 2-8)"
    )
    p.add_argument(
        "--checkpoint-min",
        type=float,
        default=d.checkpoint_min,
        help="an evicted job keeps its progress up to its last checkpoint, every N minutes "
        "(default 0: no checkpoints, all progress lost)",
    )
    p.add_argument(
        "--grace-s", type=float, default=d.grace_s, help="victims' termination grace period (default 30)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--out", default="simulate-out", help="directory for preemption.png (default ./simulate-out)"
    )
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def _run_hours(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split("-", 1))
    except ValueError:
        raise ValueError(f"--run-hours: {text!r} is not LOW-HIGH, e.g. 2-8") from None
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = "gpupack simulate --tidal --preemption"
    if bool(args.trace) != bool(args.nodes):
        print(f"{err}: --trace and --nodes go together", file=sys.stderr)
        return 2
    try:
        settings = Settings(
            swing=args.swing,
            offline_load=args.offline_load,
            run_h=_run_hours(args.run_hours),
            checkpoint_min=args.checkpoint_min,
            grace_s=args.grace_s,
            seed=args.seed,
        )
        settings.validate()
        if not 0 < args.pool_share <= 1:
            raise ValueError(f"--pool-share must be in (0, 1], not {args.pool_share}")
        scenarios = [embedded_scenario(args.swing, args.pool_share)]
        if args.trace:
            day = openb_day(args.trace, args.nodes, nodes=args.sample_nodes, swing=args.swing, seed=args.seed)
            scenarios.append(from_day(day, args.pool_share / POOL_SHARE * 0.5))
    except (OSError, ValueError) as e:
        print(f"{err}: {e}", file=sys.stderr)
        return 2
    outs = [simulate(sc, settings) for sc in scenarios]
    doc: dict = {"days": outs}
    if not args.no_chart:
        from gpupack.simulate.chart import ChartUnavailable

        try:
            doc["chart"] = str(chart(outs, Path(args.out) / "preemption.png"))
        except ChartUnavailable as e:
            print(f"{err}: no chart: {e}", file=sys.stderr)
    for o in outs:
        for r in o["results"]:
            r.pop("preemption_log", None)
            if args.json:
                r.pop("series", None)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for o in outs:
        print(format_table(o))
        print()
    if "chart" in doc:
        print(f"chart {doc['chart']}")
    return 0
