"""The openb replay by mode name: the simulator's own (`default`, :mod:`gpupack.simulate.replay`)
or through the model of kube-scheduler in front of the extender (`pipeline`,
:mod:`gpupack.simulate.pipeline`, which builds on the first)."""

from __future__ import annotations

import numpy as np

from gpupack.core.workload import Workload
from gpupack.simulate.openb import NodeList, PodList
from gpupack.simulate.pipeline import PipelineConfig, replay_pipeline
from gpupack.simulate.replay import ReplayResult, replay

REPLAY_MODES = ("default", "pipeline")


def replay_mode(
    mode: str,
    nodes: NodeList,
    pods: PodList,
    policy_name: str,
    seed: int,
    order: np.ndarray | None = None,
    workload: Workload | None = None,
    **pipeline_options: object,
) -> ReplayResult:
    """`default`: :func:`~gpupack.simulate.replay.replay` (decisions kept); `pipeline`: the same
    arrivals through the pipeline model (`pipeline_options` are
    :class:`~gpupack.simulate.pipeline.PipelineConfig` fields)."""
    if mode == "default":
        return replay(nodes, pods, policy_name, seed, order, workload, keep_decisions=True)
    if mode == "pipeline":
        cfg = PipelineConfig(**pipeline_options)  # type: ignore[arg-type]
        return replay_pipeline(nodes, pods, policy_name, seed, order, workload, cfg)
    raise ValueError(f"unknown replay mode {mode!r}; choose one of {', '.join(REPLAY_MODES)}")
