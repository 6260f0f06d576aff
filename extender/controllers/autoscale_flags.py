"""`gpupack extender`'s flags for the autoscale controller (extender/controllers/autoscale.py) and its start
from them: off unless --autoscale-templates is given; every duration checked before the thread
starts, so a bad flag is one line and status 2, not a controller that loops."""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable

from kubernetes import client
from prometheus_client import CollectorRegistry

from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient

from .autoscale import AutoscaleConfig, AutoscaleController

log = logging.getLogger("gpupack.extender.autoscale")


def add_flags(p: argparse.ArgumentParser) -> None:
    """`gpupack extender`'s flags for this controller (off unless --autoscale-templates is given)."""
    p.add_argument(
        "--autoscale-templates",
        default="",
        help="NAMESPACE/NAME of the ConfigMap whose key `templates` lists the cluster autoscaler's "
        "node-group templates (a kind: List of Nodes); turns on the autoscale controller",
    )
    p.add_argument(
        "--autoscale-group-label",
        default="gpupack.io/node-group",
        help="node label whose value is the node group (on the templates and the group's nodes)",
    )
    p.add_argument(
        "--autoscale-namespace",
        default=os.environ.get("POD_NAMESPACE", "gpupack-system"),
        help="namespace of the placeholder pods (default: $POD_NAMESPACE, else gpupack-system)",
    )
    p.add_argument("--autoscale-interval-s", type=float, default=10.0, help="time between passes")
    p.add_argument(
        "--autoscale-backoff-s",
        type=float,
        default=60.0,
        help="a node group's first pause after the autoscaler added no node for its placeholder; "
        "doubled for each failure in a row",
    )
    p.add_argument("--autoscale-backoff-max-s", type=float, default=1800.0, help="the longest such pause")
    p.add_argument(
        "--autoscale-scale-up-timeout-s",
        type=float,
        default=1200.0,
        help="a placeholder older than this had no node: a failed scale-up (keep it above the "
        "autoscaler's --max-node-provision-time)",
    )


def start_from_args(
    args: argparse.Namespace,
    api: client.ApiClient,
    leading: Callable[[], str] | None,
    registry: CollectorRegistry | None = None,
    events: EventRecorder | None = None,
) -> None:
    if not args.autoscale_templates:
        return
    if "/" not in args.autoscale_templates:
        raise ValueError("--autoscale-templates must be NAMESPACE/NAME")
    for flag in ("interval_s", "backoff_s", "backoff_max_s", "scale_up_timeout_s"):
        v = getattr(args, f"autoscale_{flag}")
        if not (math.isfinite(v) and 0 < v <= 7 * 86400):
            raise ValueError(
                f"--autoscale-{flag.replace('_', '-')} must be a number of seconds in (0, 604800]"
            )
    cfg = AutoscaleConfig(args.autoscale_templates, args.autoscale_namespace, args.autoscale_group_label,
                          args.scheduler_name, args.autoscale_interval_s, args.autoscale_backoff_s,
                          args.autoscale_backoff_max_s, args.autoscale_scale_up_timeout_s)  # fmt: skip
    AutoscaleController(KubeClient(api, timeout_s=10.0), cfg, leading, events, registry).start()
    log.info("autoscale controller on: templates %s, group label %s, placeholders in %s",
             cfg.templates, cfg.group_label, cfg.namespace)  # fmt: skip
