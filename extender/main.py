"""`gpupack extender`: the scheduler extender (HTTP) and the admission webhook (HTTPS).

Every listener is served by guarded.py, which gives a thread only a request that has arrived
whole, so idle or trickling connections hold no thread. The verbs are served in this ONE process,
since the reservation state (assumed pods, per-node bind locks) must live in a single process;
the metrics port, open to the network, by a server of its own in this process (its own loop,
threads and connection budget). The webhook needs TLS on its own port, so it runs in a child
process with its own small node watch (for the largest GPU in the cluster); it holds no
reservation state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from gpupack import logs
from gpupack.contract import SCHEDULER_NAME
from gpupack.core.fgd import Workload, WorkloadError, workload_from_json
from gpupack.core.policies import DEFAULT_POLICY, Policy, UnknownPolicy, get_policy, policy_spec
from gpupack.kubeclient import KubeConfigError

from .controllers import autoscale_flags
from .controllers.dra import flags as dra_flags
from .serve.app import DEFAULT_MAX_BODY, WEBHOOK_MAX_BODY
from .verbs.config import ExtenderConfig

log = logging.getLogger("gpupack.extender")
SWITCH_INTERVAL_S = 0.0005


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupack extender", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address of the verbs (/filter, /prioritize, /bind), which have no authentication: only the "
        "kube-scheduler beside it may call them (default 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=8888, help="extender HTTP port (default 8888)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="also serve /metrics, /healthz and /readyz (nothing else) on this port; 0: none (default)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address of --metrics-port (default 0.0.0.0)")
    p.add_argument(
        "--webhook-host",
        default="0.0.0.0",
        help="address of the webhook (the API server calls it through its Service; default 0.0.0.0)",
    )
    p.add_argument("--webhook-port", type=int, default=8443, help="admission webhook HTTPS port; 0 disables")
    p.add_argument("--tls-cert", help="PEM certificate for the webhook")
    p.add_argument("--tls-key", help="PEM private key for the webhook")
    p.add_argument("--policy", default=None, help=f"placement policy (default {DEFAULT_POLICY})")
    p.add_argument(
        "--policy-seed",
        type=int,
        default=0,
        help="seed of the policy's node order that breaks score ties (as `gpupack simulate` seeds it; default 0)",
    )
    p.add_argument(
        "--keep-cpu-for-gpus",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the gpupack policy refuses a pod asking for no GPU on a node whose free CPU it would leave "
        "short of feeding the node's free GPUs (at the CPU per GPU of the GPU pods seen); such pods go to "
        "nodes with CPU to spare or wait (default on; docs/operator-guide.md)",
    )
    p.add_argument(
        "--filter-keep-best",
        type=int,
        default=0,
        metavar="N",
        help="filter passes only the N fitting nodes the policy scores best (ties as the simulator breaks "
        "them), so kube-scheduler's own scores and random ties cannot override it; 0: every fitting "
        "node (default). Use with percentageOfNodesToScore: 100 (docs/operator-guide.md)",
    )
    p.add_argument(
        "--new-shape-budget-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="a pod shape's filter, until its answer is whole, fits nodes for this long and answers the "
        "best of those (at least 100 looked at and one passing that no other pod's bind holds; the shape "
        "warmer fits the others off kube-scheduler's cycle), as kube-scheduler's percentageOfNodesToScore "
        "samples; 0: every node (default; extender/verbs/sampling.py)",
    )
    p.add_argument(
        "--workload-file",
        metavar="PATH",
        help="JSON pod shapes and counts the policy packs for (`gpupack simulate workload` writes one); "
        "given, the policy does not learn the workload from the pods it sees",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument(
        "--scheduler-name", default=SCHEDULER_NAME, help=f"scheduler name (default {SCHEDULER_NAME})"
    )
    p.add_argument(
        "--set-scheduler-name",
        action="store_true",
        help="webhook sets spec.schedulerName of GPU pods that use the default scheduler",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=512,
        help="threads answering the verbs, at most (each bind holds one while it waits on the API server or "
        "for its turn, so a burst of binds must leave some to filter and prioritize; started as needed; "
        "connections hold none; default 512)",
    )
    p.add_argument(
        "--bind-wait-s", type=float, default=4.0, help="how long a bind waits for a pending handoff"
    )
    p.add_argument(
        "--bind-concurrency",
        type=int,
        default=64,
        help="binds making their API calls at the same time, at most (0: no limit); more wait their turn",
    )
    p.add_argument(
        "--stale-handoff-s", type=float, default=120.0, help="pending handoff age reported as stale"
    )
    p.add_argument(
        "--unbound-grace-s",
        type=float,
        default=None,
        help="deprecated, ignored: a bind is one Binding that carries the assignment, so no pod holds "
        "one unbound any more (an old one is removed when the pod is next filtered or bound)",
    )
    p.add_argument(
        "--sweep-interval-s", type=float, default=5.0, help="how often stale handoffs are looked for"
    )
    p.add_argument(
        "--warm-shapes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute pod shapes' answers before kube-scheduler asks (the shapes of pods waiting to be "
        "scheduled, and after the policy learnt the shapes asked about in the last minute), off its "
        "serial cycle (default on; extender/verbs/warming.py)",
    )
    p.add_argument(
        "--preemption-interval-s",
        type=float,
        default=2.0,
        help="how often the leader looks for pending GPU pods that may preempt lower-priority pods "
        "(docs/operator-guide.md, Preemption); 0 turns GPU-aware preemption off",
    )
    p.add_argument(
        "--api-timeout-s",
        type=float,
        default=2.0,
        help="timeout of each API call on the bind path (a bind makes up to five when a Binding's "
        "outcome must be found out, usually one or two; keep their sum "
        "plus --bind-wait-s below kube-scheduler's extender httpTimeout)",
    )
    p.add_argument(
        "--lease-namespace",
        default="",
        help="namespace of kube-scheduler's leader-election Lease; with --lease-name, this extender "
        "binds only while the scheduler beside it (same --identity) holds that Lease",
    )
    p.add_argument("--lease-name", default="", help="name of kube-scheduler's leader-election Lease")
    p.add_argument(
        "--identity",
        default="",
        help="holder identity of the scheduler beside this extender, or its prefix before `_` "
        "(default: this host name, which kube-scheduler uses as `<hostname>_<uuid>`)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body of a verb accepted"
    )
    p.add_argument(
        "--webhook-max-body-bytes",
        type=int,
        default=WEBHOOK_MAX_BODY,
        help="largest AdmissionReview accepted (default 3.5 MiB: an object and its old version at etcd's "
        "1.5 MiB cap, and the review around them)",
    )
    autoscale_flags.add_flags(p)
    dra_flags.add_flags(p)
    logs.add_log_flags(p)
    p.add_argument("--role", default="all", choices=["all", "extender", "webhook"], help=argparse.SUPPRESS)
    return p


class ConfigError(ValueError):
    """A flag or the file it names that cannot be used; one line for the operator."""


def read_workload(path: str) -> Workload:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(f"--workload-file {path}: cannot read it: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"--workload-file {path}: not valid JSON: {e}") from None
    try:
        return workload_from_json(doc)
    except WorkloadError as e:
        raise ConfigError(f"--workload-file {path}: {e}") from None


def make_policy(args: argparse.Namespace) -> Policy:
    """The policy the flags ask for; ConfigError when they do not go together."""
    name = args.policy or DEFAULT_POLICY
    if args.filter_keep_best < 0:
        raise ConfigError(f"--filter-keep-best must be 0 (off) or more, got {args.filter_keep_best}")
    if not args.workload_file:
        policy = get_policy(name, seed=args.policy_seed)
    else:
        spec = policy_spec(name)
        if not spec.learns:
            raise ConfigError(f"--workload-file: policy {name} does not use a workload")
        policy = spec.make(seed=args.policy_seed, workload=read_workload(args.workload_file))
    if hasattr(policy, "keep_cpu_for_gpus"):  # the policies that keep CPU for GPUs (gpupack)
        policy.keep_cpu_for_gpus = args.keep_cpu_for_gpus
    return policy


def extender_config(args: argparse.Namespace) -> ExtenderConfig:
    """The scheduling settings the flags ask for; ConfigError for one out of range."""
    if args.new_shape_budget_ms < 0:
        raise ConfigError(f"--new-shape-budget-ms must be 0 (off) or more, got {args.new_shape_budget_ms}")
    return ExtenderConfig(
        bind_wait_s=args.bind_wait_s,
        stale_handoff_s=args.stale_handoff_s,
        scheduler_name=args.scheduler_name,
        bind_concurrency=args.bind_concurrency,
        keep_best=args.filter_keep_best,
        new_shape_budget_s=args.new_shape_budget_ms / 1000,
    )


def _extender_factory(
    args: argparse.Namespace,
    listening: threading.Event | None = None,
    alive: Callable[[], str] | None = None,
) -> Callable[[], Any]:
    """The extender's app; `alive` (why the process is unhealthy, "" if it is not) joins the
    metrics port's /healthz, the container's liveness probe."""

    def make() -> Any:
        from gpupack.events import EventRecorder
        from gpupack.kubeclient import KubeClient

        from .api.kube import Kube, api_client
        from .api.lease import LeaseFence
        from .controllers.requeue import Janitor, Requeuer
        from .serve.app import create_extender_app, only_probes, probes_of
        from .state.metrics import Metrics
        from .state.sync import Sync
        from .state.view import ClusterView
        from .verbs.collector import IdleCollector
        from .verbs.framework import Extender

        # kube-scheduler's cycle is serial and waits on each filter answer. The thread answering it
        # wakes with the request's bytes but must win the GIL from binds and watch threads; at the
        # default 5 ms switch interval each wake could cost up to that (measured: CHANGELOG).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        metrics = Metrics()
        view = ClusterView(on_problem=lambda kind, msg: metrics.problems.labels(kind).inc(), track_host=True)
        api = api_client(args.kubeconfig)
        kube = Kube(api, timeout_s=args.api_timeout_s)
        events = EventRecorder(
            KubeClient(api, timeout_s=args.api_timeout_s),
            args.identity or socket.gethostname(),
            "gpupack-extender",
        )
        policy = make_policy(args)
        fence = None
        if args.lease_name:
            identity = args.identity or socket.gethostname()
            # the lease must outlast the longest write started under it
            fence = LeaseFence(kube, args.lease_namespace or "kube-system", args.lease_name, identity,
                               margin_s=args.api_timeout_s + 1.0)  # fmt: skip
            log.info("extender binds only while Lease %s/%s is held by %s",
                     fence.namespace, fence.name, identity)  # fmt: skip
            leading = fence.problem  # the cluster's gauges come from the replica beside the leader only
            metrics.attach_view(view, active=lambda: not leading(fresh=False))
        else:
            metrics.attach_view(view)
        config = extender_config(args)
        ext = Extender(view, policy, kube, config, metrics=metrics, fence=fence, events=events)
        Requeuer(ext).start()  # before the watches: no room they report goes unnoticed
        sync = Sync(view, kube, freeze_heap=True, pause=ext.activity.wait_quiet)
        sync.start()
        marks = None
        if args.warm_shapes:
            from .state.preempt_inputs import Unschedulable
            from .verbs.warming import pending_watcher

            ext.warmer.start(sync.stop)
            marks = Unschedulable() if args.preemption_interval_s > 0 else None
            pending = pending_watcher(
                kube, args.scheduler_name, ext.warmer, sync.stop, ext.activity.wait_quiet, marks
            )
            threading.Thread(target=pending.run, name="watch-pending-pods", daemon=True).start()
        Janitor(ext, args.sweep_interval_s, listening=listening).start()
        if args.preemption_interval_s > 0:
            from .controllers.preemption import Preempter

            Preempter(ext, KubeClient(api, timeout_s=args.api_timeout_s), events, fence,
                      args.preemption_interval_s, marks=marks).start()  # fmt: skip
        dra_flags.start_from_args(
            args, api, None if fence is None else fence.problem, make_policy(args), metrics.registry
        )
        autoscale_flags.start_from_args(
            args, api, None if fence is None else fence.problem, metrics.registry, events
        )
        log.info("extender policy=%s seed=%d filter-keep-best=%d workload=%s; syncing with the API server",
                 policy.name, args.policy_seed, args.filter_keep_best,
                 args.workload_file or "learnt from the pods seen")  # fmt: skip
        IdleCollector(ext.activity, on_collect=metrics.full_collection).install()
        app = create_extender_app(ext, args.max_body_bytes)
        if not args.metrics_port:
            return app
        # the metrics port is open to the network: served apart from the verbs, with a budget of
        # its own, by a server that slow or idle connections cannot stall (guarded.py)
        from .serve.guarded import GuardedServer, metrics_limits

        metrics_server = GuardedServer()
        metrics_server.add(only_probes(app), args.metrics_host, args.metrics_port,
                           metrics_limits(args.max_body_bytes), name="metrics",
                           probes=probes_of(app, alive))  # fmt: skip
        metrics_server.start()
        return app

    return make


def _webhook_factory(args: argparse.Namespace) -> Callable[[], Any]:
    def make() -> Any:
        from .api.kube import Kube, api_client
        from .serve.app import create_webhook_app
        from .serve.webhook import WebhookConfig
        from .state.metrics import Metrics
        from .state.sync import Sync
        from .state.view import ClusterView

        metrics = Metrics()
        view = ClusterView(on_problem=lambda kind, msg: metrics.problems.labels(kind).inc())
        kube = Kube(api_client(args.kubeconfig))
        Sync(view, kube, pods=False).start()  # the webhooks read nodes only
        # pod_lookup: the node of the device plugin pod a token is bound to (plugin-node webhook)
        cfg = WebhookConfig(args.scheduler_name, args.set_scheduler_name, pod_lookup=kube.get_pod)
        return create_webhook_app(cfg, view, metrics, args.webhook_max_body_bytes)

    return make


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        make_policy(args)  # in the arbiter: a bad flag or file is one line and status 2, not a dead worker
        extender_config(args)
    except (UnknownPolicy, ConfigError) as e:
        print(f"gpupack extender: {e}", file=sys.stderr)
        return 2
    if args.threads < 1:
        print(f"gpupack extender: --threads must be 1 or more, got {args.threads}", file=sys.stderr)
        return 2
    if args.role in ("all", "webhook") and args.webhook_port:
        if not args.tls_cert or not args.tls_key:
            print(
                "gpupack extender: the webhook needs --tls-cert and --tls-key (or --webhook-port 0)",
                file=sys.stderr,
            )
            return 2
        for f in (args.tls_cert, args.tls_key):
            if not os.path.isfile(f):
                print(f"gpupack extender: {f}: no such file", file=sys.stderr)
                return 2
    # logging (and its version line) once the flags are known good: a bad flag is one line
    logs.setup(args)
    if args.unbound_grace_s is not None:
        log.warning(
            "--unbound-grace-s is deprecated and ignored: no pod holds an assignment unbound any more"
        )
    try:
        return _serve(args, argv)
    except KubeConfigError as e:  # a kubeconfig or in-cluster account that does not load: one line
        print(f"gpupack extender: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The listeners of `--role` (and the supervised webhook child with role all), until SIGTERM."""
    if args.role == "webhook":
        # open to the network (the API server calls it): served so that slow or idle connections
        # cannot stall admission (guarded.py)
        from .serve.app import probes_of
        from .serve.guarded import GuardedServer, raise_fd_limit, tls_context, webhook_limits

        raise_fd_limit()
        # the loop reads every connection's handshake, head and body and answers the probes itself:
        # a thread parsing a review must hand it the GIL within 0.5 ms, not the default 5 ms
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        server = GuardedServer()
        app = _webhook_factory(args)()
        server.add(app, args.webhook_host, args.webhook_port, webhook_limits(args.webhook_max_body_bytes),
                   tls_context(args.tls_cert, args.tls_key), "webhook", probes=probes_of(app))  # fmt: skip
        server.run()
        return 0

    child = None
    if args.role == "all" and args.webhook_port:
        from .serve.webhook_child import WebhookChild

        # supervised: started again when it exits, and the liveness probe fails while it stays down
        child = WebhookChild(
            [sys.executable, "-m", "extender.main", *(argv if argv is not None else sys.argv[1:]),
             "--role", "webhook"]
        )  # fmt: skip
        child.start()
    from .serve.app import probes_of
    from .serve.guarded import GRACEFUL_S, GuardedServer, raise_fd_limit, verbs_limits

    raise_fd_limit()
    try:
        # kube-scheduler is the verbs' one caller (loopback); the listener is guarded all the same,
        # so that no container beside it can stall scheduling with a few connections
        server = GuardedServer()
        listening = threading.Event()
        alive = None if child is None else child.problem
        app = _extender_factory(args, listening, alive)()
        server.add(app, args.host, args.port, verbs_limits(args.max_body_bytes, args.threads), name="verbs",
                   probes=probes_of(app, alive))  # fmt: skip
        listening.set()  # bound: kube-scheduler's next filter waits in the backlog, is not refused
        server.run(GRACEFUL_S)
    finally:
        if child is not None:
            child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
