"""`gpupack device-plugin`: the per-node kubelet device plugin.

    gpupack device-plugin --node-name N [--kubelet-dir DIR] [--pod-resources-socket SOCK] [--metrics-port P]
                          [--enforcement hami-core|mps|both] [--kubeconfig FILE]
                          [--nvml-module MODULE [--nvml-config TEXT]]
    gpupack device-plugin --discover [--json] [--nvml-module ...]

`--nvml-module` replaces NVML by another implementation of `NvmlFacade` (tests and demos use the
fake in tests/deviceplugin/fake_nvml.py, which is not part of the installed package): the module
is imported and its `make_nvml(config)` is called with the `--nvml-config` text.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from deviceplugin.api import DEFAULT_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.discovery import NvmlUnavailable, discover, init_nvml
from deviceplugin.nvml_facade import NvmlFacade
from gpupack import handoff, logs

PROG = "gpupack device-plugin"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="gpupack's kubelet device plugin (resource gpupack.io/gpu)"
    )
    p.add_argument(
        "--node-name", default=os.environ.get("NODE_NAME", ""), help="this node (default $NODE_NAME)"
    )
    p.add_argument("--kubelet-dir", default=DEFAULT_PLUGIN_DIR, help="kubelet device plugin directory")
    p.add_argument(
        "--pod-resources-socket",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        help="the kubelet's PodResources API socket, asked in PreStartContainer which pod holds a "
        f"container's GPUs (default {DEFAULT_POD_RESOURCES_SOCKET})",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    p.add_argument(
        "--nvml-module",
        metavar="MODULE",
        default=None,
        help="import MODULE and use its make_nvml(config) instead of NVML (tests, demos)",
    )
    p.add_argument(
        "--nvml-config", metavar="TEXT", default=None, help="passed to the --nvml-module's make_nvml"
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address for /metrics (default 0.0.0.0)")
    p.add_argument(
        "--enforcement",
        choices=handoff.ENFORCEMENT_MODES,
        default=handoff.ENFORCE_BOTH,
        help="which env a shared container gets: HAMi-core, MPS, or both (default)",
    )
    p.add_argument(
        "--device-list-strategy",
        choices=("envvar", "volume-mounts", "both"),
        default="envvar",
        help="how the container runtime is told a container's GPUs: NVIDIA_VISIBLE_DEVICES (default), "
        "mounts under /var/run/nvidia-container-devices (with the NVIDIA toolkit's "
        "accept-nvidia-visible-devices-as-volume-mounts; tenants cannot forge them), or both",
    )
    p.add_argument("--probe-interval", type=float, default=5.0, help="seconds between GPU health probes")
    p.add_argument("--discover", action="store_true", help="print the GPU inventory and exit")
    p.add_argument("--json", action="store_true", help="with --discover: print JSON")
    logs.add_log_flags(p, verbose_alias=True)
    return p


class NvmlModuleError(RuntimeError):
    pass


def make_nvml(args: argparse.Namespace) -> NvmlFacade:
    if args.nvml_module:
        try:
            mod = importlib.import_module(args.nvml_module)
        except ImportError as e:
            raise NvmlModuleError(f"--nvml-module {args.nvml_module}: {e}") from e
        factory = getattr(mod, "make_nvml", None)
        if not callable(factory):
            raise NvmlModuleError(f"--nvml-module {args.nvml_module} has no make_nvml(config) function")
        try:
            return factory(args.nvml_config)
        except (ValueError, OSError) as e:  # the module's own configuration errors
            one_line = " ".join(str(e).split())  # the plugin reports a failed start in one line
            raise NvmlModuleError(f"--nvml-module {args.nvml_module}: {one_line}") from e
    if args.nvml_config is not None:
        raise NvmlModuleError("--nvml-config needs --nvml-module")
    from deviceplugin.nvml_facade import PynvmlFacade

    return PynvmlFacade()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args, starting=not args.discover)
    try:
        nvml = make_nvml(args)
        init_nvml(nvml)
        found = discover(nvml)
    except (NvmlUnavailable, NvmlModuleError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if args.discover:
        print(found.to_json() if args.json else found.table())
        nvml.shutdown()
        return 0
    if not args.node_name:
        print(f"{PROG}: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if not found.gpus:
        print(
            f"{PROG}: no usable GPU on this node ({'; '.join(found.skipped) or 'NVML reports none'})",
            file=sys.stderr,
        )
        return 1

    from deviceplugin.kube import KubeError, load_api_client
    from deviceplugin.plugin import DevicePlugin, PluginConfig

    try:
        api_client = load_api_client(args.kubeconfig)
    except KubeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    cfg = PluginConfig(
        node=args.node_name,
        kubelet_dir=args.kubelet_dir,
        enforcement=args.enforcement,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        probe_interval_s=args.probe_interval,
        device_list_strategy=args.device_list_strategy,
        pod_resources_socket=args.pod_resources_socket,
    )
    for s in found.skipped:
        logging.getLogger("gpupack.deviceplugin").warning("skipped %s", s)
    plugin = DevicePlugin(cfg, nvml, found, api_client)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("gpupack.deviceplugin").info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        plugin.start()
    except OSError as e:
        print(f"{PROG}: cannot start: {e}", file=sys.stderr)
        plugin.stop()
        return 1
    while not done.wait(1.0):
        pass
    plugin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
