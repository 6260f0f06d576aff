"""One logging setup (gpupack/logs.py): the flags every command shares, key=value fields in text,
one JSON object per line, and the deprecated -v alias."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupack import logs

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["deviceplugin.main", "extender.controllers.defrag.cli", "extender.status_cli", "gpupack.certs"]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {n: logging.getLogger(n).level for n in logs.QUIET}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for n, lv in quiet.items():
        logging.getLogger(n).setLevel(lv)


def _parse(argv: list[str], verbose_alias: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    logs.add_log_flags(p, verbose_alias=verbose_alias)
    return p.parse_args(argv)


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_has_the_same_log_flags(module):
    parser = importlib.import_module(module).build_parser()
    args = parser.parse_args(["--log-level", "warning", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("warning", "json")
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])


def test_text_format_appends_fields_as_key_value(restore_logging):
    out = io.StringIO()
    logs.setup(_parse(["--log-level", "debug"]), stream=out)
    log = logs.with_fields(logging.getLogger("gpupack.test"), node="n1")
    log.info("allocated %d", 2, extra={"pod": "ns/p", "gpu": 0})
    log.debug("with a space", extra={"reason": "two words"})
    logs.with_fields(log, attempt=3).info("bound")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("INFO gpupack.test: allocated 2 node=n1 pod=ns/p gpu=0"), lines
    assert lines[1].endswith('DEBUG gpupack.test: with a space node=n1 reason="two words"'), lines
    assert lines[2].endswith("gpupack.test: bound node=n1 attempt=3"), lines


def test_json_format_is_one_object_per_line_with_fields_and_traceback(restore_logging):
    out = io.StringIO()
    logs.setup(_parse(["--log-format", "json"]), stream=out)
    log = logging.getLogger("gpupack.test")
    log.debug("not at info")
    log.warning("GPU %s unhealthy", "GPU-1", extra={"node": "n1", "uuid": "GPU-1", "gpu": 3})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed", extra={"pod": "ns/p"})
    recs = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    assert len(recs) == 2
    assert {k: recs[0][k] for k in ("level", "logger", "msg", "node", "uuid", "gpu")} == {
        "level": "warning", "logger": "gpupack.test", "msg": "GPU GPU-1 unhealthy", "node": "n1",
        "uuid": "GPU-1", "gpu": 3,
    }  # fmt: skip
    assert recs[1]["pod"] == "ns/p" and "RuntimeError: boom" in recs[1]["exc"]
    assert "exc" not in recs[0] and recs[0]["time"].endswith("+00:00")


def test_library_retry_warnings_only_when_debugging(restore_logging):
    out = io.StringIO()
    logs.setup(_parse([]), stream=out)
    logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2))")
    assert out.getvalue() == ""
    logs.setup(_parse(["--log-level", "debug"]), stream=out)
    logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2))")
    assert "Retrying" in out.getvalue()


def test_verbose_is_a_deprecated_alias_for_debug(restore_logging):
    args = _parse(["-v"], verbose_alias=True)
    assert args.log_level == "debug"
    out = io.StringIO()
    logs.setup(args, stream=out)
    assert "-v is deprecated; use --log-level debug" in out.getvalue()
    assert _parse(["--verbose", "--log-level", "error"], verbose_alias=True).log_level == "error"  # last wins
    p = argparse.ArgumentParser()
    logs.add_log_flags(p, verbose_alias=True)
    assert "--verbose" not in p.format_help() and "--log-format" in p.format_help()


def test_environment_sets_the_defaults(monkeypatch):
    monkeypatch.setenv(logs.ENV_LEVEL, "WARNING")
    monkeypatch.setenv(logs.ENV_FORMAT, "json")
    assert (_parse([]).log_level, _parse([]).log_format) == ("warning", "json")
    monkeypatch.setenv(logs.ENV_FORMAT, "yaml")  # not a format: the built-in default
    assert _parse([]).log_format == "text"


@pytest.mark.slow
def test_global_options_before_the_command_reach_it():
    # defrag with the old -v: after the version line, its deprecation warning is the first thing it
    # logs, in JSON as asked
    r = subprocess.run(
        [sys.executable, "-m", "gpupack", "--log-format", "json", "defrag", "-v", "--kubeconfig", "/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    version, first = (json.loads(line) for line in r.stderr.splitlines()[:2])
    assert version["command"] == "defrag" and "version" in version, r.stderr
    assert first["level"] == "warning" and "deprecated" in first["msg"], r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "gpupack", "--log-format=xml", "status"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--log-format 'xml'" in r.stderr
