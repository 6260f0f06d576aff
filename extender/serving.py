"""How the extender's verbs are served (the webhook and the metrics port: guarded.py): gunicorn,
embedded, with its stock `gthread` worker (a poller thread and a pool of request threads), configured through its documented
settings only: nothing here subclasses or calls gunicorn's private classes, so a gunicorn release
cannot take away what serving relies on.

The extender runs ONE worker process: the reservation state (assumed pods, per-node bind locks)
must live in a single process. Kept-alive connections wait in the worker's poller, not in a
thread, and each request is answered by a pool thread; a bind holds its thread while it waits on
the API server (kube-scheduler binds every pod of a burst at once, and binds past
--bind-concurrency wait for a turn), so the pool (`--threads`) is sized for such a burst: a
filter that found every thread taken would wait for a bind to end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.config import KNOWN_SETTINGS

from gpupack import logs

_GUNICORN_SETTINGS = {s.name for s in KNOWN_SETTINGS}
KEEPALIVE_S = 30  # kube-scheduler keeps its connections to the extender open between pods
# kept-alive connections waiting in the poller, beyond the requests in progress (one a thread)
IDLE_CONNECTIONS = 1000
GRACEFUL_S = 3  # binds wait at most --bind-wait-s; the scheduler retries the rest


class Server(BaseApplication):
    """gunicorn running `factory()` (called in the worker, after fork) with `options`."""

    def __init__(self, factory: Callable[[], Any], options: dict[str, Any]) -> None:
        self.factory = factory
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for k, v in self.options.items():
            self.cfg.set(k, v)

    def load(self) -> Any:
        # Runs in the worker after fork: watch threads must start there, not in the arbiter.
        return self.factory()


def options(binds: list[str], threads: int, log_level: str, proc_name: str) -> dict[str, Any]:
    """gunicorn's settings for one worker process of `threads` request threads on `binds`."""
    opts: dict[str, Any] = {
        "bind": binds,
        "workers": 1,
        "worker_class": "gthread",
        "threads": threads,  # started as requests need them, up to this many
        "worker_connections": threads + IDLE_CONNECTIONS,
        "timeout": 120,
        "graceful_timeout": GRACEFUL_S,
        "keepalive": KEEPALIVE_S,
        "loglevel": log_level,
        "accesslog": None,
        "errorlog": "-",
        "logger_class": logs.gunicorn_logger_class(),  # gunicorn's lines in --log-format too
        "proc_name": proc_name,
    }
    if "control_socket_disable" in _GUNICORN_SETTINGS:
        # gunicorn >= 24 opens a control socket under $HOME; a second instance would collide
        opts["control_socket_disable"] = True
    return opts
