"""`gpupack dra-plugin`: the per-node DRA kubelet plugin for driver gpu.gpupack.io.

    gpupack dra-plugin --node-name N [--kubeconfig FILE] [--cdi-dir /var/run/cdi]
                       [--registry-dir /var/lib/kubelet/plugins_registry] [--plugins-dir /var/lib/kubelet/plugins]
                       [--enforcement hami-core|mps|both] [--offline-class gpupack-offline ...]
                       [--probe-interval 5] [--metrics-port P [--metrics-addr A]]
                       [--nvml-module MODULE [--nvml-config TEXT]]

The same NVML discovery and health as `gpupack device-plugin` (deviceplugin.discovery, .health);
instead of extended resources it publishes a ResourceSlice (draplugin.publish) and prepares
ResourceClaims as CDI devices (draplugin.service); with --metrics-port it serves Prometheus /metrics
and the kubelet's /healthz and /readyz probes (draplugin.metrics). Refused, in one line, where the cluster serves
no resource.k8s.io/v1 (Kubernetes before 1.34): there the device plugin is the way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from deviceplugin.discovery import NvmlUnavailable, discover, init_nvml
from deviceplugin.main import NvmlModuleError, make_nvml
from draplugin import cdi
from draplugin.api import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from draplugin.cdi import DEFAULT_CDI_DIR
from draplugin.claims import DEFAULT_OFFLINE_CLASSES
from gpupack import handoff, kubeclient, logs

PROG = "gpupack dra-plugin"
log = logging.getLogger("gpupack.draplugin")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="gpupack's DRA kubelet plugin (driver gpu.gpupack.io)")
    p.add_argument(
        "--node-name", default=os.environ.get("NODE_NAME", ""), help="this node (default $NODE_NAME)"
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    p.add_argument(
        "--registry-dir",
        default=DEFAULT_REGISTRY_DIR,
        help=f"the kubelet's plugin registry (default {DEFAULT_REGISTRY_DIR})",
    )
    p.add_argument(
        "--plugins-dir",
        default=DEFAULT_PLUGINS_DIR,
        help=f"where the DRA service socket goes, under gpu.gpupack.io/ (default {DEFAULT_PLUGINS_DIR})",
    )
    p.add_argument(
        "--cdi-dir", default=DEFAULT_CDI_DIR, help=f"CDI spec directory (default {DEFAULT_CDI_DIR})"
    )
    p.add_argument(
        "--enforcement",
        choices=handoff.ENFORCEMENT_MODES,
        default=handoff.ENFORCE_BOTH,
        help="which limits a shared GPU's container gets: HAMi-core, MPS, or both (default)",
    )
    p.add_argument(
        "--offline-class",
        action="append",
        default=None,
        metavar="DEVICECLASS",
        help="a DeviceClass whose claims are offline (repeatable; default gpupack-offline); "
        "every other class is online, and the two never share a GPU",
    )
    p.add_argument(
        "--nvml-module", metavar="MODULE", default=None, help="import MODULE's make_nvml(config) (tests)"
    )
    p.add_argument(
        "--nvml-config", metavar="TEXT", default=None, help="passed to the --nvml-module's make_nvml"
    )
    p.add_argument("--probe-interval", type=float, default=5.0, help="seconds between GPU health probes")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics, /healthz and /readyz on this port (default: none)",
    )
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address for /metrics (default 0.0.0.0)")
    logs.add_log_flags(p)
    return p


def dra_served(api: object) -> bool:
    """Whether the cluster serves resource.k8s.io/v1 ResourceSlices (Kubernetes 1.34 and later)."""
    from kubernetes import client

    try:
        res = client.ResourceV1Api(api).get_api_resources(_request_timeout=10)
    except kubeclient.ApiException as e:
        if e.status == 404:
            return False
        raise
    return any(r.name == "resourceslices" for r in res.resources or [])


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args)
    if not args.node_name:
        print(f"{PROG}: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    try:
        api_client = kubeclient.api_client(args.kubeconfig)
        served = dra_served(api_client)
    except kubeclient.KubeConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except (kubeclient.ApiException, OSError) as e:
        reason = kubeclient.api_reason(e) if isinstance(e, kubeclient.ApiException) else str(e)
        print(f"{PROG}: cannot ask the API server which APIs it serves: {reason}", file=sys.stderr)
        return 1
    if not served:
        print(
            f"{PROG}: this cluster does not serve resource.k8s.io/v1 (DRA needs Kubernetes 1.34 or later); "
            "use gpupack device-plugin",
            file=sys.stderr,
        )
        return 1
    try:
        nvml = make_nvml(args)
        driver_version = init_nvml(nvml)
        found = discover(nvml)
    except (NvmlUnavailable, NvmlModuleError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if not found.gpus:
        print(
            f"{PROG}: no usable GPU on this node ({'; '.join(found.skipped) or 'NVML reports none'})",
            file=sys.stderr,
        )
        return 1
    for s in found.skipped:
        log.warning("skipped %s", s)

    from deviceplugin.health import DeviceState, HealthWatcher
    from draplugin.metrics import Metrics, not_ready
    from draplugin.publish import SlicePublisher
    from draplugin.registration import Sockets
    from draplugin.service import Driver

    kube = kubeclient.KubeClient(api_client, timeout_s=10)
    state = DeviceState(found.gpus, found.skipped)
    driver = Driver(
        node=args.node_name,
        cdi_dir=args.cdi_dir,
        state=state,
        kube=kube,
        enforcement=args.enforcement,
        offline_classes=frozenset(args.offline_class or DEFAULT_OFFLINE_CLASSES),
    )
    publisher = SlicePublisher(
        kube, args.node_name, state, driver_version, holds=lambda: cdi.holds(args.cdi_dir)
    )
    driver.on_change = publisher.wake
    health = HealthWatcher(nvml, state, probe_interval_s=args.probe_interval)
    sockets = Sockets(driver, args.registry_dir, args.plugins_dir)
    done = threading.Event()
    metrics = Metrics(
        args.node_name,
        state,
        args.cdi_dir,
        counts=lambda: {
            "gpupack_draplugin_slice_publishes": publisher.syncs,
            "gpupack_draplugin_slice_publish_errors": publisher.errors,
            "gpupack_draplugin_kubelet_registrations": sockets.registration.registrations,
        },
    )
    driver.observe = metrics.observe

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics_server = None
    try:
        publisher.start()
        health.start()
        sockets.start()
        if args.metrics_port is not None:
            metrics_server = metrics.serve(
                args.metrics_port,
                args.metrics_addr,
                lambda: not_ready(
                    done.is_set,
                    (sockets.dra_sock, sockets.reg_sock),
                    sockets.registered.is_set,
                    publisher.synced.is_set,
                ),
            )
            log.info("metrics on http://%s:%d/metrics", args.metrics_addr, metrics_server.port)
    except OSError as e:
        print(f"{PROG}: cannot start: {e}", file=sys.stderr)
        sockets.stop()
        return 1
    while not done.wait(1.0):
        pass
    if metrics_server is not None:
        metrics_server.stop()
    sockets.stop()
    publisher.stop()
    health.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
