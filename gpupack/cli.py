"""`gpupack` command line: a thin dispatcher; each subcommand lives with its component."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). Imported lazily so `gpupack simulate` never loads gRPC or Flask.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("gpupack.simulate.cli", "compare placements offline: embedded fleet or an openb trace replay"),
    "extender": ("extender.main", "run the kube-scheduler extender and admission webhook (HTTP)"),
    "device-plugin": ("deviceplugin.main", "run the per-node kubelet device plugin (gRPC)"),
    "status": ("extender.status_cli", "show per-node, per-GPU reservations from the cluster"),
    "defrag": ("extender.defrag.cli", "plan (and with --apply, run) evict-and-repack defragmentation"),
    "certs": ("gpupack.certs", "create or renew the admission webhook's TLS certificate and caBundle"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: gpupack COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `gpupack COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from gpupack import __version__

        print(f"gpupack {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"gpupack: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(args[1:]) or 0)


def kubectl_main() -> int:
    """Entry point for the kubectl plugin `kubectl gpupack ...` (defaults to `status`)."""
    args = sys.argv[1:] or ["status"]
    return main(args)


if __name__ == "__main__":
    sys.exit(main())
