"""The extender's listeners and their budgets. The server itself (deadlines, connection limits,
one asyncio loop, threads only for whole requests) is gpupack/guarded.py, shared with the device
plugin's metrics port; its names are re-exported here for the extender."""

from __future__ import annotations

from gpupack.guarded import GuardedServer, Limits, Listener, raise_fd_limit, tls_context

__all__ = [
    "GRACEFUL_S",
    "KEEPALIVE_S",
    "GuardedServer",
    "Limits",
    "Listener",
    "metrics_limits",
    "raise_fd_limit",
    "tls_context",
    "verbs_limits",
    "webhook_limits",
]

KEEPALIVE_S = 30.0  # kube-scheduler keeps its connections to the extender open between pods
GRACEFUL_S = 3.0  # on SIGTERM, for the requests in hand (binds wait at most --bind-wait-s; the scheduler retries the rest)


def webhook_limits(max_body: int) -> Limits:
    # admission reviews come from the API server, a few at a time; 8 threads answer them
    return Limits(max_connections=2048, max_body=max_body, threads=8)


def verbs_limits(max_body: int, threads: int) -> Limits:
    """kube-scheduler's verbs: it keeps connections alive between pods and sends filters,
    prioritizes and binds at once; a bind holds its thread while it waits on the API server, so
    `threads` (--threads) is sized for a burst of binds with threads to spare for filter."""
    return Limits(idle_s=KEEPALIVE_S, max_connections=2048, max_header_bytes=65536, max_body=max_body,
                  threads=threads, chunked=True)  # fmt: skip


def metrics_limits(max_body: int) -> Limits:
    # scrapes and probes: a small budget of its own, apart from the verbs'
    return Limits(max_connections=1024, max_body=min(max_body, 65536), threads=2)
