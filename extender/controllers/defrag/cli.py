"""`gpupack defrag`: print the plan (default, changes nothing) or run it with --apply.

Exit status: 0 done (a PDB refusal is a normal skip), 1 the run stopped early (timeout, lost
lease, API error), 2 bad arguments, 3 refused to start (outside the window, another run holds
the lease).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpupack import logs
from gpupack.contract import ANN_ASSIGNMENT, LABEL_MANAGED
from gpupack.core.defrag import Limits, Plan, plan_defrag, plan_nodes
from gpupack.events import EventRecorder
from gpupack.kubeclient import ApiException, KubeClient, api_reason

from .eligibility import Eligibility, why_not
from .executor import (
    CA_SCALE_DOWN_DISABLED,
    TAINT_KEY,
    TAINT_VALUE,
    ExecOptions,
    Executor,
    RunResult,
    set_taint,
)
from .lease import LeaseHeld, RunLease
from .metrics import RunMetrics
from .snapshot import Snapshot, build_snapshot
from .window import Window, WindowError, parse_window

log = logging.getLogger("gpupack.defrag")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpupack defrag",
        description="Plan evict-and-repack moves that free whole GPUs; --apply runs them.",
    )
    p.add_argument(
        "--apply", action="store_true", help="execute the plan (default: dry run, changes nothing)"
    )
    p.add_argument("--json", action="store_true", help="print the plan (and results) as JSON")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument(
        "--objective",
        choices=("gpus", "nodes"),
        default="gpus",
        help="gpus: free whole GPUs (default); nodes: empty whole GPU nodes, cheapest first, for the "
        "cluster autoscaler (or the operator) to remove",
    )
    g = p.add_argument_group("safety")
    _add_limit_flags(g)
    _add_timing_flags(g)
    g.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "gpupack-system"))
    g.add_argument("--lease-name", default="gpupack-defrag")
    g.add_argument("--lease-duration", type=int, default=0, help="lease seconds (default move timeout + 300)")
    o = p.add_argument_group("observability")
    o.add_argument("--metrics-file", help="write the run's metrics here (Prometheus textfile format)")
    o.add_argument("--pushgateway", help="push the run's metrics to this Pushgateway address")
    o.add_argument("--no-events", action="store_true", help="do not record Kubernetes Events")
    logs.add_log_flags(o, verbose_alias=True)
    return p


def _add_limit_flags(g: argparse._ArgumentGroup) -> None:
    """How much one run may disrupt, and which pods it may touch."""
    g.add_argument("--max-evictions", type=int, default=10, help="evictions per run (default 10)")
    g.add_argument(
        "--max-per-node", type=int, default=4, help="evictions per source node (default 4; 0 = no cap)"
    )
    g.add_argument(
        "--max-per-namespace", type=int, default=5, help="evictions per namespace (default 5; 0 = no cap)"
    )
    g.add_argument(
        "--max-workload-share",
        type=float,
        default=0.25,
        help="share of a workload's replicas one run may move (default 0.25; at least one)",
    )
    g.add_argument("--allow-online", action="store_true", help="also move online (latency-sensitive) pods")
    g.add_argument("--allow-jobs", action="store_true", help="also move Job pods (they restart from scratch)")
    g.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        help="only move pods of this namespace (repeatable)",
    )


def _add_timing_flags(g: argparse._ArgumentGroup) -> None:
    """When a run may act, and how long it waits for each step."""
    g.add_argument(
        "--window", help="allowed time window HH:MM-HH:MM, e.g. 01:00-05:00; outside it --apply refuses"
    )
    g.add_argument("--timezone", default="UTC", help="time zone of --window (IANA name, default UTC)")
    g.add_argument("--force", action="store_true", help="run outside --window")
    g.add_argument(
        "--move-timeout",
        type=float,
        default=600.0,
        help="seconds for a replacement to be Running and Ready (default 600)",
    )
    g.add_argument(
        "--poll-interval", type=float, default=2.0, help="seconds between replacement checks (default 2)"
    )
    g.add_argument(
        "--budget-wait",
        type=float,
        default=300.0,
        help="seconds to wait for a PodDisruptionBudget to allow an eviction before skipping the pod "
        "(default 300)",
    )
    g.add_argument(
        "--settle-timeout",
        type=float,
        default=120.0,
        help="seconds to wait at the end for evicted pods to be gone before counting freed GPUs (default 120)",
    )
    g.add_argument(
        "--keep-taint",
        action="store_true",
        help="with --objective nodes: leave the NoSchedule taint on nodes the run emptied (default: removed)",
    )
    g.add_argument(
        "--reservation-ttl",
        type=float,
        default=0.0,
        help="reservation lifetime in s (default move timeout + 120)",
    )


def _table(plan: Plan) -> str:
    rows = [("STEP", "POD", "OWNER", "FROM", "TO", "FREES")]
    frees = {
        g.id: f"{g.node}: {len(g.gpus_freed)} GPU" + ("s" if len(g.gpus_freed) > 1 else "")
        for g in plan.groups
    }
    last_group = -1
    for m in plan.moves:
        rows.append(
            (
                str(m.step),
                m.pod,
                f"{m.owner_kind}/{m.owner_name}",
                f"{m.from_node}[{','.join(u[-8:] for u in m.from_gpus)}]",
                f"{m.to_node}[{','.join(u[-8:] for u in m.to_gpus)}]",
                frees[m.group] if m.group != last_group else "",
            )
        )
        last_group = m.group
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    nodes = ", ".join(plan.nodes_freed) if plan.nodes_freed else "none"
    lines.append("")
    lines.append(
        f"{plan.evictions} eviction(s) free {plan.gpus_freed} whole GPU(s) "
        f"({plan.gpus_per_eviction:.2f} per eviction) and {len(plan.nodes_freed)} whole node(s): {nodes}"
    )
    lines.append(f"used GPUs {plan.used_gpus_before} -> {plan.used_gpus_after}")
    if plan.moves:
        lines.append("pods to evict: " + " ".join(m.pod for m in plan.moves))
    return "\n".join(lines)


def _gpupack_pods(kc: KubeClient) -> list[dict[str, Any]]:
    """Pods that hold or may hold a GPU share: labelled gpupack.io/managed, or carrying an
    assignment without the label (stripped by hand: the share is still in use, and a snapshot
    that missed it would plan moves onto an occupied GPU). All pods are listed, only these kept."""
    out: list[dict[str, Any]] = []
    for items, _rv in kc.pages(kc.core.list_pod_for_all_namespaces):
        for p in items:
            meta = p.get("metadata") or {}
            if LABEL_MANAGED in (meta.get("labels") or {}) or ANN_ASSIGNMENT in (
                meta.get("annotations") or {}
            ):
                out.append(p)
    return out


def _snapshot(kc: KubeClient) -> Snapshot:
    return build_snapshot(kc.list_all(kc.core.list_node), _gpupack_pods(kc), datetime.now(UTC))


def run(args: argparse.Namespace, kc: KubeClient) -> int:
    now = datetime.now(UTC)
    window = parse_window(args.window, args.timezone) if args.window else None
    metrics = RunMetrics()
    outside = window is not None and not window.contains(now)
    if outside and args.apply and not args.force:
        print(
            f"gpupack defrag: outside the allowed window {args.window} ({args.timezone}); "
            "not running (use --force to override)",
            file=sys.stderr,
        )
        metrics.result.labels("refused-window").set(1)
        metrics.export(args.metrics_file, args.pushgateway)
        return 3
    if outside:
        print(
            f"gpupack defrag: note: outside the allowed window {args.window}; dry run only", file=sys.stderr
        )

    run_id = f"defrag-{now.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}"
    holder = f"{socket.gethostname()}/{os.getpid()}/{run_id}"
    lease = None
    if args.apply:
        lease = RunLease(
            kc,
            args.lease_namespace,
            args.lease_name,
            holder,
            args.lease_duration or int(args.move_timeout + 300),
        )
        try:
            lease.acquire()
        except LeaseHeld as e:
            print(f"gpupack defrag: {e}; not running", file=sys.stderr)
            metrics.result.labels("refused-lease").set(1)
            metrics.export(args.metrics_file, args.pushgateway)
            return 3
    try:
        return _plan_and_apply(_Run(args, kc, run_id, metrics, lease, window))
    finally:
        if lease is not None:
            lease.release()
        metrics.export(args.metrics_file, args.pushgateway)


@dataclass(frozen=True)
class _Run:
    """What one invocation plans and applies with."""

    args: argparse.Namespace
    kc: KubeClient
    run_id: str
    metrics: RunMetrics
    lease: RunLease | None
    window: Window | None


def _plan_and_apply(r: _Run) -> int:
    args, run_id, metrics = r.args, r.run_id, r.metrics
    snap = _snapshot(r.kc)
    for msg in snap.problems:
        log.warning("%s", msg)
    movable, excluded = _movable(snap, args)
    plan, protected = _plan(snap, movable, args, metrics)
    log.info(
        "plan %s: %d eviction(s) free %d GPU(s), %d node(s); %d movable pod(s), excluded %s",
        run_id,
        plan.evictions,
        plan.gpus_freed,
        len(plan.nodes_freed),
        len(movable),
        dict(excluded),
    )
    out: dict[str, Any] = {
        "run": run_id,
        "dry_run": not args.apply,
        "objective": args.objective,
        "plan": plan.to_dict(),
        "movable": len(movable),
        "excluded": dict(sorted(excluded.items())),
    }
    if protected:
        out["protected_nodes"] = protected
    if not args.json:
        _print_plan(plan, movable, excluded, protected)
    if not args.apply:
        metrics.result.labels("dry-run").set(1)
        if args.json:
            print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    result = _apply(r, plan, snap)
    out["result"] = result.to_dict()
    metrics.result.labels("aborted" if result.aborted else "ok").set(1)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        _print_result(result)
    return 1 if result.aborted else 0


def _movable(snap: Snapshot, args: argparse.Namespace) -> tuple[set[str], Counter[str]]:
    """The GPU pods this run may move, and how many were excluded for each reason."""
    rules = Eligibility(
        allow_online=args.allow_online,
        allow_jobs=args.allow_jobs,
        namespaces=frozenset(args.namespaces) if args.namespaces else None,
    )
    movable: set[str] = set()
    excluded: Counter[str] = Counter()
    for key, (req, _, _) in snap.state.pods.items():
        obj = snap.pods.get(key)
        why = "no-pod-object" if obj is None else why_not(obj, req, rules)
        if why is None:
            movable.add(key)
        else:
            excluded[why] += 1
    return movable, excluded


def _scale_down_disabled(snap: Snapshot) -> list[str]:
    """Nodes the cluster autoscaler must never remove: emptying them gains nothing."""
    protected: list[str] = []
    for name, obj in sorted(snap.nodes.items()):
        ann = (obj.get("metadata") or {}).get("annotations") or {}
        if str(ann.get(CA_SCALE_DOWN_DISABLED, "")).lower() == "true":
            protected.append(name)
    return protected


def _plan(
    snap: Snapshot, movable: set[str], args: argparse.Namespace, metrics: RunMetrics
) -> tuple[Plan, list[str]]:
    """The plan for the run's objective, and the nodes it must not empty."""
    limits = Limits(
        max_evictions=args.max_evictions,
        max_per_node=args.max_per_node,
        max_per_namespace=args.max_per_namespace,
        max_workload_share=args.max_workload_share,
    )
    protected = _scale_down_disabled(snap) if args.objective == "nodes" else []
    t0 = time.perf_counter()
    if args.objective == "nodes":
        plan = plan_nodes(snap.state, movable, limits, protected=protected)
    else:
        plan = plan_defrag(snap.state, movable, limits)
    metrics.plan_seconds.set(time.perf_counter() - t0)
    metrics.planned_evictions.set(plan.evictions)
    metrics.planned_gpus.set(plan.gpus_freed)
    return plan, protected


def _print_plan(plan: Plan, movable: set[str], excluded: Counter[str], protected: list[str]) -> None:
    print(_table(plan))
    print(
        f"movable pods: {len(movable)}; not movable: "
        + (", ".join(f"{k} {v}" for k, v in sorted(excluded.items())) or "none")
    )
    if protected:
        print(f"not emptied ({CA_SCALE_DOWN_DISABLED}=true): {', '.join(protected)}")


def _exec_options(args: argparse.Namespace, window: Window | None) -> ExecOptions:
    return ExecOptions(
        move_timeout_s=args.move_timeout,
        poll_s=args.poll_interval,
        reservation_ttl_s=args.reservation_ttl,
        window=window,
        force=args.force,
        budget_wait_s=args.budget_wait,
        settle_s=args.settle_timeout,
        objective=args.objective,
        keep_taint=args.keep_taint,
    )


def _remove_stale_taints(kc: KubeClient, snap: Snapshot) -> None:
    """A run that crashed while emptying a node left its taint: this run holds the lease now, so
    no other run is using it."""
    for name, obj in sorted(snap.nodes.items()):
        for t in (obj.get("spec") or {}).get("taints") or []:
            if t.get("key") == TAINT_KEY and t.get("value") == TAINT_VALUE:
                log.info("removing a stale %s taint from node %s (an earlier run stopped)", TAINT_KEY, name)
                set_taint(kc, name, None)


def _apply(r: _Run, plan: Plan, snap: Snapshot) -> RunResult:
    kc = r.kc
    events = EventRecorder(None if r.args.no_events else kc, r.run_id)
    opts = _exec_options(r.args, r.window)
    _remove_stale_taints(kc, snap)
    ex = Executor(kc, lambda: _snapshot(kc), opts, r.run_id, events, r.metrics, r.lease)
    return ex.run(plan)


def _print_result(result: RunResult) -> None:
    for r in result.moves:
        print(
            f"move {r.step} {r.pod}: {r.outcome}"
            + (f" ({r.detail})" if r.detail else "")
            + (f" -> {r.replacement}" if r.replacement else "")
        )
    if result.used_gpus_after >= 0:
        print(
            f"GPUs in use {result.used_gpus_before} -> {result.used_gpus_after} "
            f"({result.used_gpus_before - result.used_gpus_after} fewer), nodes in use "
            f"{result.used_nodes_before} -> {result.used_nodes_after}"
        )
    print(
        f"evicted {result.evictions}; freed {len(result.gpus_freed)} GPU(s), "
        f"{len(result.nodes_freed)} node(s)"
        + (f" ({', '.join(result.nodes_freed)})" if result.nodes_freed else "")
        + (
            f"; {len(result.still_terminating)} evicted pod(s) still terminating, not counted"
            if result.still_terminating
            else ""
        )
        + (f"; stopped: {result.aborted}" if result.aborted else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args)
    for name, v in (
        ("--max-evictions", args.max_evictions),
        ("--max-per-node", args.max_per_node),
        ("--max-per-namespace", args.max_per_namespace),
    ):
        if v < 0:
            print(f"gpupack defrag: {name} must be >= 0", file=sys.stderr)
            return 2
    if args.budget_wait < 0 or args.settle_timeout < 0:
        print("gpupack defrag: --budget-wait and --settle-timeout must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.max_workload_share <= 1 or args.move_timeout <= 0 or args.poll_interval <= 0:
        print(
            "gpupack defrag: --max-workload-share must be in 0..1, --move-timeout and --poll-interval > 0",
            file=sys.stderr,
        )
        return 2
    try:
        if args.window:
            parse_window(args.window, args.timezone)
        kc = KubeClient.from_kubeconfig(args.kubeconfig)
    except WindowError as e:
        print(f"gpupack defrag: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # kubeconfig missing or unreadable: one line, no traceback
        print(f"gpupack defrag: cannot load Kubernetes configuration: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, kc)
    except ApiException as e:
        status, _, detail = api_reason(e).partition(" ")
        print(f"gpupack defrag: Kubernetes API error {status}: {detail}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"gpupack defrag: cannot reach the Kubernetes API: {e}", file=sys.stderr)
        return 1
