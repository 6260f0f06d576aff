"""The openb replay as a real cluster runs it: kube-scheduler v1.28 in front of gpupack's extender.

The default replay (:mod:`gpupack.simulate.replay`) lets the policy place every pod over every node,
knowing each node's CPU and memory and given the trace's workload. A cluster differs where it must:

- **CPU-only pods may not reach the extender.** A profile that lists gpupack's resources as the
  extender's `managedResources` (as the profile once did) has kube-scheduler call it only for pods
  requesting one of them; every other pod is placed by kube-scheduler's default score plugins
  (NodeResourcesFit LeastAllocated over cpu and memory, NodeResourcesBalancedAllocation; the others
  score every node alike here: no taints, affinities, images or spread constraints), ties broken
  at random. `cpu_pods_via_extender=True` models a profile without `managedResources` (the shipped
  one), whose extender is asked about every pod; `fit_strategy="MostAllocated"` a profile that
  packs by requests.
- **kube-scheduler filters only part of the cluster.** With `percentageOfNodesToScore` unset it
  stops after `max(100, n * (50 - n/125) %)` feasible nodes, searching round-robin from where the
  last pod's search stopped; the extender is then asked about those nodes only.
- **The extender's view** may lack CPU and memory (`extender_cpu=False`: nodes built without them,
  as before the extender tracked them), and it **learns the workload** from the pods it is asked
  about, in the extender's batches (:class:`gpupack.core.learning.LearningBatcher`, the rule the
  extender runs) on a simulated clock that advances `seconds_per_pod` per arrival, unless it is
  given the workload (`learn_workload=False`: `--workload-file`).
- **Scores are mixed.** The extender's raw scores are normalised to 0..10 over the nodes it is
  asked about (:func:`gpupack.core.score_scale.normalised`, the extender's prioritize scale),
  multiplied by 10 x the extender's weight and added to the default plugins' scores;
  kube-scheduler takes the highest total, ties at random. With `filter_keep_best=N` the extender's
  filter passes only its N best-scored nodes (ties: the policy's seeded node order).
- The GPUs inside the chosen node are the policy's (the extender's bind runs the same fit).

Bound pods are never deleted, one pod is decided before the next arrives; a pod that fits nowhere
is dropped, as in the default replay (the benchmark deletes it from the real cluster).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from gpupack.core.fit import Fit
from gpupack.core.learning import LearningBatcher
from gpupack.core.model import ClusterState, Node, PodRequest
from gpupack.core.policies import Policy, policy_spec
from gpupack.core.score_scale import normalised
from gpupack.core.workload import Workload
from gpupack.simulate.openb import NodeList, PodList
from gpupack.simulate.replay import (
    Curve,
    ReplayResult,
    arrival_order,
    build_state,
    pod_request,
    trace_workload,
)

# kube-scheduler v1.28 (pkg/scheduler/schedule_one.go, framework/interface.go)
MIN_FEASIBLE_NODES_TO_FIND = 100
MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND = 5
MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10


# What one pod takes in benchmarks/replay_realk8s.py, one pod at a time with its 100 ms pause: 191 s
# for 1,054 pods (seed 42) and 195 s for 1,076 (seed 43) on 150 nodes, on a 2-core machine shared
# with other runs. The learning batches follow wall-clock gaps, so the model needs the pace.
SECONDS_PER_POD = 0.18


@dataclass(frozen=True)
class PipelineConfig:
    """What the modelled cluster runs: the scheduler profile and the extender's flags."""

    extender_cpu: bool = True  # the extender's nodes carry CPU/memory allocatable and requested
    learn_workload: bool = True  # False: the extender is given the workload (--workload-file)
    filter_keep_best: int = 0  # 0: the extender's filter passes every node the pod fits
    percentage_of_nodes_to_score: int = 0  # kube-scheduler's; 0 = its adaptive default
    extender_weight: int = 10  # deploy/scheduler/config.yaml
    # Simulated seconds from one pod's arrival to the next's: the clock of the extender's learning
    # batches (benchmarks/replay_realk8s.py submits a pod once the last one is decided).
    seconds_per_pod: float = SECONDS_PER_POD
    max_pods: int = 250  # pods allocatable per node
    # The extender is called for every pod (its `managedResources` empty), not only GPU pods.
    cpu_pods_via_extender: bool = False
    # NodeResourcesFit's scoringStrategy: LeastAllocated (kube's default) or MostAllocated.
    fit_strategy: str = "LeastAllocated"
    extender_seed: int = 0  # the extender's policy seed (its node tie order)


def num_feasible_nodes_to_find(percentage: int, num_all: int) -> int:
    """kube-scheduler v1.28 `numFeasibleNodesToFind` (no profile override)."""
    if num_all < MIN_FEASIBLE_NODES_TO_FIND or percentage >= 100:
        return num_all
    adaptive = percentage
    if adaptive <= 0:
        adaptive = max(50 - num_all // 125, MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND)
    n = num_all * adaptive // 100
    return max(n, MIN_FEASIBLE_NODES_TO_FIND)


def _least_allocated(req: int, cap: int) -> int:
    if cap == 0 or req > cap:
        return 0
    return (cap - req) * MAX_NODE_SCORE // cap


def _most_allocated(req: int, cap: int) -> int:
    if cap == 0:
        return 0
    return min(req, cap) * MAX_NODE_SCORE // cap


def _balanced(cpu_req: int, cpu_cap: int, mem_req: int, mem_cap: int) -> int:
    fc = min(1.0, cpu_req / cpu_cap) if cpu_cap else 1.0
    fm = min(1.0, mem_req / mem_cap) if mem_cap else 1.0
    std = abs((fc - fm) / 2)
    return int((1 - std) * MAX_NODE_SCORE)


def _normalise(raw: list[float]) -> list[int]:
    """The extender's prioritize: raw scores to 0..10 over the lowest..highest."""
    norm = normalised(raw)
    return [norm[v] for v in raw]


class Pipeline:
    """kube-scheduler's bookkeeping (requests per node, the round-robin search start) and the
    extender's view, fed one pod at a time."""

    def __init__(self, nodes: NodeList, policy: Policy, config: PipelineConfig, rng: random.Random) -> None:
        self.cfg = config
        self.names = list(nodes.names)
        self.n = len(nodes)
        self.cpu_cap = [int(v) for v in nodes.cpu]
        self.mem_cap = [int(v) for v in nodes.ram]
        self.cpu_req = [0] * self.n
        self.mem_req = [0] * self.n
        self.pods = [0] * self.n
        self.next_start = 0
        self.to_find = num_feasible_nodes_to_find(config.percentage_of_nodes_to_score, self.n)
        self.state: ClusterState = build_state(nodes)
        if not config.extender_cpu:
            for nd in self.state.nodes.values():
                nd.cpu_milli = nd.ram_mib = 0
        self.policy = policy
        self.policy.rank_nodes(self.names)
        self.clock = 0.0  # simulated seconds: the arrival time of the pod being scheduled
        self.learner: LearningBatcher[PodRequest] | None = (
            LearningBatcher(policy.observe, lambda: self.clock)
            if config.learn_workload and policy.learn
            else None
        )
        self.rng = rng
        self.tied = False  # the last decision was a random draw among equal totals
        self.best: list[int] = []  # the last decision's nodes of equal highest total

    def _kube_filter(self, cpu: int, mem: int) -> list[int]:
        feasible: list[int] = []
        processed = 0
        for k in range(self.n):
            i = (self.next_start + k) % self.n
            processed += 1
            if (
                self.pods[i] < self.cfg.max_pods
                and self.cpu_req[i] + cpu <= self.cpu_cap[i]
                and self.mem_req[i] + mem <= self.mem_cap[i]
            ):
                feasible.append(i)
                if len(feasible) >= self.to_find:
                    break
        self.next_start = (self.next_start + processed) % self.n if self.n else 0
        return feasible

    def _plugin_score(self, i: int, cpu: int, mem: int) -> int:
        c, m = self.cpu_req[i] + cpu, self.mem_req[i] + mem
        f = _most_allocated if self.cfg.fit_strategy == "MostAllocated" else _least_allocated
        return (f(c, self.cpu_cap[i]) + f(m, self.mem_cap[i])) // 2 + _balanced(
            c, self.cpu_cap[i], m, self.mem_cap[i]
        )

    def _select(self, cands: list[int], totals: list[int]) -> int:
        top = max(totals)
        best = [c for c, t in zip(cands, totals, strict=True) if t == top]
        self.tied = len(best) > 1
        self.best = best
        return best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]

    def _pick(self, cands: list[int], totals: list[int], forced: int | None) -> int:
        chosen = self._select(cands, totals)
        if forced is None:
            return chosen
        if forced >= 0 and forced not in cands:
            raise ValueError(f"node {self.names[forced]} was not among the nodes the pipeline could choose")
        return forced

    def schedule(
        self, pod: PodRequest, forced: int | None = None, at: float | None = None
    ) -> tuple[int, tuple[int, ...]]:
        """Place one pod: (node index, sorted GPU indexes) or (-1, ()). With `forced`, the pod goes
        to that node (-1: nowhere) instead of kube-scheduler's draw among `best`, to follow a real
        cluster's decisions; a forced node the pipeline could not choose raises ValueError. `at`:
        the pod's arrival, in seconds (default: `seconds_per_pod` after the last pod's)."""
        cpu, mem = pod.cpu_milli, pod.ram_mib
        self.tied = False
        self.best = []
        self.clock = self.clock + self.cfg.seconds_per_pod if at is None else at
        feasible = self._kube_filter(cpu, mem)
        if not feasible:
            return -1, ()
        fit: Fit | None = None
        if not pod.containers and not self.cfg.cpu_pods_via_extender:
            totals = [self._plugin_score(i, cpu, mem) for i in feasible]
            chosen = self._pick(feasible, totals, forced)
        else:
            seen = pod if self.cfg.extender_cpu else replace(pod, cpu_milli=0, ram_mib=0)
            if self.learner is not None:
                self.learner.offer(seen.uid or seen.key, seen)
            fits: dict[int, Fit] = {}
            raw: dict[int, float] = {}
            for i in feasible:
                node: Node = self.state.nodes[self.names[i]]
                r = self.policy.fit(node, seen)
                if isinstance(r, Fit):
                    fits[i] = r
                    raw[i] = self.policy.node_score(node, seen, r)
            if not fits:
                return -1, ()
            passed = list(fits)
            if self.cfg.filter_keep_best > 0:
                key = self.policy.tie_key
                passed.sort(key=lambda i: (-raw[i], key[self.names[i]]))
                passed = sorted(passed[: self.cfg.filter_keep_best])
            ext = _normalise([raw[i] for i in passed])
            scale = self.cfg.extender_weight * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
            totals = [e * scale + self._plugin_score(i, cpu, mem) for i, e in zip(passed, ext, strict=True)]
            chosen = self._pick(passed, totals, forced)
            if chosen < 0:
                return -1, ()
            fit = fits[chosen]
        if chosen < 0:
            return -1, ()
        self.cpu_req[chosen] += cpu
        self.mem_req[chosen] += mem
        self.pods[chosen] += 1
        node = self.state.nodes[self.names[chosen]]
        if fit is not None:
            self.state.place(replace(pod, cpu_milli=node.cpu_milli and cpu, ram_mib=node.ram_mib and mem),
                             fit.placement, fit.charged)  # fmt: skip
            return chosen, tuple(sorted(fit.charged))
        if self.cfg.extender_cpu:  # the extender counts every pod's requests on its nodes
            node.cpu_used += cpu
            node.ram_used += mem
        return chosen, ()


def _policy(name: str, pods: PodList, workload: Workload | None, cfg: PipelineConfig) -> Policy:
    """The extender's policy: a learning one is given `workload` (default: the trace's) unless it
    learns (`cfg.learn_workload`)."""
    spec = policy_spec(name)
    if spec.learns and not cfg.learn_workload:
        return spec.make(cfg.extender_seed, workload if workload is not None else trace_workload(pods))
    return spec.make(cfg.extender_seed)


def replay_pipeline(
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    seed: int,
    order: np.ndarray | None = None,
    workload: Workload | None = None,
    config: PipelineConfig | None = None,
    arrivals: Sequence[float] | None = None,
) -> ReplayResult:
    """The replay of :func:`gpupack.simulate.replay.replay` through the modelled pipeline: same
    arrival order and definitions (curve, unallocated at 100 %), decisions always kept.
    `arrivals`: each pod's arrival in seconds (a real run's), instead of one per `seconds_per_pod`."""
    cfg = config or PipelineConfig()
    if order is None:
        order = arrival_order(pods, nodes.gpu_capacity, seed)
    pipe = Pipeline(nodes, _policy(policy_name, pods, workload, cfg), cfg, random.Random(seed))
    curve = Curve(nodes.gpu_capacity)
    arrived = allocated = placed = failed = 0
    decisions: list[tuple[int, tuple[int, ...]]] = []
    tied: list[int] = []
    for step, p in enumerate(order):
        pod = pod_request(pods, int(p), f"default/p{step}")
        req = int(pods.num_gpu[p] * pods.gpu_milli[p])
        arrived += req
        n, gpus = pipe.schedule(pod, at=None if arrivals is None else arrivals[step])
        decisions.append((n, gpus))
        if pipe.tied:
            tied.append(step)
        if n >= 0:
            allocated += req
            placed += 1
        else:
            failed += req
        curve.add(arrived, allocated)
    return ReplayResult(policy_name, seed, curve.values(), len(order), placed, failed, decisions, tied)


def follow_pipeline(
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    order: np.ndarray,
    decisions: list[tuple[int, tuple[int, ...]]],
    workload: Workload | None = None,
    config: PipelineConfig | None = None,
    arrivals: Sequence[float] | None = None,
) -> list[tuple[list[int], tuple[int, ...]]]:
    """Replay `order` through the pipeline model, each pod forced where `decisions` (a real
    cluster's) put it, and return per pod what the model would have done in that same state: the
    nodes of equal highest total kube-scheduler draws from ([] when the pod fits nowhere) and the
    GPUs the extender's bind picks on the followed node. Whether each decision was among those best
    is the caller's check; the follow stops (returns what it has, the last entry that pod's) at a
    node the pod could not go to at all (kube-scheduler's filters or the extender's fit refuse it).
    `arrivals`: as :func:`replay_pipeline`'s (the real run's, so the model learns in its batches)."""
    cfg = config or PipelineConfig()
    pipe = Pipeline(nodes, _policy(policy_name, pods, workload, cfg), cfg, random.Random(0))
    out: list[tuple[list[int], tuple[int, ...]]] = []
    for step, (p, (node, _)) in enumerate(zip(order, decisions, strict=True)):
        try:
            at = None if arrivals is None else arrivals[step]
            _, gpus = pipe.schedule(pod_request(pods, int(p), f"default/p{step}"), forced=node, at=at)
        except ValueError:
            out.append((list(pipe.best), ()))
            break
        out.append((list(pipe.best), gpus))
    return out
