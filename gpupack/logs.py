"""One logging setup for every gpupack process: `--log-level`, `--log-format text|json`, and
key=value fields.

Fields: pass them with `extra=` (`log.info("admitted", extra={"node": n, "pod": key})`) or bind them
once with `with_fields(log, node=n)`. The text format appends them as ` key=value` after the
message; the JSON format writes one object per line with them as keys, for a log pipeline to
index. FIELDS are the names every component uses for the same thing.

The flags' defaults come from $GPUPACK_LOG_LEVEL and $GPUPACK_LOG_FORMAT, so one environment
variable in a manifest (or `gpupack --log-format json COMMAND`) sets them for any command.

A process's first line names gpupack's version and what it runs (`setup` writes it whatever the
level), so a log read after an upgrade says which release wrote it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
# Fields in the order the text format writes them; any other `extra` key given to `with_fields`
# or listed in a record's `fields` mapping follows these.
FIELDS = ("node", "pod", "container", "gpu", "uuid", "reason")
ENV_LEVEL = "GPUPACK_LOG_LEVEL"
ENV_FORMAT = "GPUPACK_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Chatty libraries whose warnings repeat what gpupack reports itself (urllib3 warns on every retry
# of a request whose failure the caller logs): quiet unless debugging.
QUIET = ("urllib3", "kubernetes.client.rest")


def _env_choice(var: str, choices: tuple[str, ...], default: str) -> str:
    v = os.environ.get(var, "").strip().lower()
    return v if v in choices else default


def default_level() -> str:
    return _env_choice(ENV_LEVEL, LEVELS, "info")


def default_format() -> str:
    return _env_choice(ENV_FORMAT, FORMATS, "text")


class _DeprecatedVerbose(argparse.Action):
    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        namespace.log_level = "debug"
        namespace.deprecated_flags = [*getattr(namespace, "deprecated_flags", []), option or "--verbose"]


def add_log_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, verbose_alias: bool = False
) -> None:
    """Add --log-level and --log-format. `verbose_alias` keeps an older `-v/--verbose` working (as
    --log-level debug, with a deprecation warning at setup) without listing it in --help."""
    parser.add_argument(
        "--log-level", choices=LEVELS, default=default_level(),
        help=f"least severe messages logged (default info, or ${ENV_LEVEL})",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", choices=FORMATS, default=default_format(),
        help=f"text: one line per message with key=value fields; json: one JSON object per line "
        f"(default text, or ${ENV_FORMAT})",
    )  # fmt: skip
    if verbose_alias:
        parser.add_argument("-v", "--verbose", nargs=0, action=_DeprecatedVerbose, help=argparse.SUPPRESS)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out = {k: getattr(record, k) for k in FIELDS if getattr(record, k, None) not in (None, "")}
    extra = getattr(record, "fields", None)
    if isinstance(extra, Mapping):
        out.update((str(k), v) for k, v in extra.items() if k not in out and v not in (None, ""))
    return out


def _text_value(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n\t')) else s


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        kv = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        head, nl, rest = line.partition("\n")  # the fields stay on the message's line, before a traceback
        return f"{head} {kv}{nl}{rest}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _fields(record).items():
            out.setdefault(k, v if isinstance(v, int | float | bool) else str(v))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Replace the root logger's handlers with one writing `fmt` at `level` to `stream` (stderr)."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level {level!r} / format {fmt!r}: expected one of {LEVELS} / {FORMATS}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.ERROR)


# the gpupack command this process runs, set by the `gpupack` dispatcher (gpupack/cli.py); a process
# started as `python -m MODULE` (the webhook child, the certs init container) is named by its module
command = ""


def _process_name() -> str:
    if command:
        return command
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        from gpupack.cli import COMMANDS  # here: gpupack.cli imports this module

        by_module = {module: cmd for cmd, (module, _) in COMMANDS.items()}
        return by_module.get(name, name)
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def announce(args: argparse.Namespace) -> None:
    """Write the version line: `gpupack VERSION COMMAND starting`, with version, command, role (the
    extender's) and pid as fields. Handed to the handlers directly, so --log-level cannot hide it."""
    from gpupack import __version__

    name = _process_name()
    fields: dict[str, Any] = {"version": __version__, "command": name}
    if isinstance(getattr(args, "role", None), str):
        fields["role"] = args.role
    fields["pid"] = os.getpid()
    logger = logging.getLogger("gpupack")
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "gpupack %s %s starting",
                               (__version__, name), None, extra={"fields": fields})  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.handle(record)


def setup(args: argparse.Namespace, stream: TextIO | None = None, starting: bool = True) -> None:
    """configure() from the flags add_log_flags added; warns once about a deprecated alias used.
    Logging to the process's stderr (no `stream`: a component starting), the first line is the
    version line (announce); a caller that hands its own stream (a test, an embedding) gets none,
    nor does a one-shot command that serves nothing (`starting=False`: `gpupack status`, the
    device plugin's `--discover`), whose output is its answer."""
    configure(args.log_level, args.log_format, stream)
    if stream is None and starting:
        announce(args)
    for flag in getattr(args, "deprecated_flags", []):
        logging.getLogger("gpupack").warning("%s is deprecated; use --log-level debug", flag)


class FieldsAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger with fields bound; a call's own `extra` adds to them (and wins on a clash)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def with_fields(logger: logging.Logger | logging.LoggerAdapter, **fields: Any) -> FieldsAdapter:  # type: ignore[type-arg]
    """`logger` with `fields` (e.g. node=...) on every record; other keys than FIELDS are written too."""
    if isinstance(logger, FieldsAdapter):
        bound: dict[str, Any] = dict(logger.extra or {})
        fields = {
            **{k: v for k, v in bound.items() if k != "fields"},
            **dict(bound.get("fields") or {}),
            **fields,
        }
    base = logger.logger if isinstance(logger, logging.LoggerAdapter) else logger
    # keys other than FIELDS ride in one mapping: as record attributes they could clash with
    # LogRecord's own (name, msg, args, ...)
    known: dict[str, Any] = {k: v for k, v in fields.items() if k in FIELDS}
    other = {k: v for k, v in fields.items() if k not in FIELDS}
    return FieldsAdapter(base, {**known, "fields": other} if other else known)
