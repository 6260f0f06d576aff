"""`gpupack` command line: a thin dispatcher; each subcommand lives with its component."""

from __future__ import annotations

import importlib
import os
import sys

from gpupack import logs

# subcommand -> (module, help). Imported lazily so `gpupack simulate` never loads gRPC or Flask.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": (
        "gpupack.simulate.cli",
        "compare placements offline: embedded fleet or an openb trace replay",
    ),
    "extender": ("extender.main", "run the kube-scheduler extender and admission webhook (HTTP)"),
    "device-plugin": ("deviceplugin.main", "run the per-node kubelet device plugin (gRPC)"),
    "dra-plugin": ("draplugin.main", "run the per-node DRA kubelet plugin (gRPC; Kubernetes 1.34+)"),
    "status": ("extender.status_cli", "show per-node, per-GPU reservations from the cluster"),
    "defrag": (
        "extender.controllers.defrag.cli",
        "plan (and with --apply, run) evict-and-repack defragmentation",
    ),
    "certs": ("gpupack.certs", "create or renew the admission webhook's TLS certificate and caBundle"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: gpupack [--log-level LEVEL] [--log-format text|json] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `gpupack COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        args = _global_log_options(args)
    except ValueError as e:
        print(f"gpupack: {e}\n\n{_usage()}", file=sys.stderr)
        return 2
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
    # a command without log flags of its own (simulate) logs as asked too; one with them sets up again
    logs.configure(logs.default_level(), logs.default_format())
    logs.command = name  # the command's first log line names it (logs.announce)
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(args[1:]) or 0)


def _global_log_options(args: list[str]) -> list[str]:
    """Take --log-level/--log-format given before the command; they become the defaults of the
    command's own flags (through the environment variables those read)."""
    env = {"--log-level": (logs.ENV_LEVEL, logs.LEVELS), "--log-format": (logs.ENV_FORMAT, logs.FORMATS)}
    while args and args[0].split("=", 1)[0] in env:
        flag, eq, value = args[0].partition("=")
        if not eq:
            if len(args) < 2:
                raise ValueError(f"{flag} needs a value")
            value, args = args[1], args[2:]
        else:
            args = args[1:]
        var, choices = env[flag]
        if value not in choices:
            raise ValueError(f"{flag} {value!r}: choose from {', '.join(choices)}")
        os.environ[var] = value
    return args


def kubectl_main() -> int:
    """Entry point for the kubectl plugin `kubectl gpupack ...` (defaults to `status`)."""
    args = sys.argv[1:] or ["status"]
    return main(args)


if __name__ == "__main__":
    sys.exit(main())
