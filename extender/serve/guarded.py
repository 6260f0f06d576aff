"""The extender's listeners and their budgets. The server itself (deadlines, connection limits,
one asyncio loop, threads only for whole requests) is gpupack/guarded.py, shared with the device
plugin's metrics port; its names are re-exported here for the extender."""

from __future__ import annotations

from gpupack.guarded import GuardedServer, Limits, Listener, Probe, raise_fd_limit, tls_context

__all__ = [
    "GRACEFUL_S",
    "KEEPALIVE_S",
    "GuardedServer",
    "Limits",
    "Listener",
    "Probe",
    "WEBHOOK_BODY_BYTES_IN_FLIGHT",
    "metrics_limits",
    "raise_fd_limit",
    "tls_context",
    "verbs_limits",
    "webhook_limits",
]

KEEPALIVE_S = 30.0  # kube-scheduler keeps its connections to the extender open between pods
GRACEFUL_S = 3.0  # on SIGTERM, for the requests in hand (binds wait at most --bind-wait-s; the scheduler retries the rest)


# The webhook's port is open to the network: bodies being read or waiting for one of its 8
# threads hold at most this much between them (a 503 past it; the API server retries a review's
# call per its failurePolicy). Reviews of real pods are tens of kilobytes, so 64 MiB is hundreds
# of them at once; 100 connections each declaring a body near the limit and stalling hold no more
# than this (tests/extender/test_guarded_budgets.py measures the process's RSS).
WEBHOOK_BODY_BYTES_IN_FLIGHT = 64 * 1024 * 1024


def webhook_limits(max_body: int) -> Limits:
    # admission reviews come from the API server, a few at a time; 8 threads answer them
    return Limits(max_connections=2048, max_body=max_body, threads=8,
                  max_body_bytes_in_flight=max(WEBHOOK_BODY_BYTES_IN_FLIGHT, max_body), max_queued=256)  # fmt: skip


def verbs_limits(max_body: int, threads: int) -> Limits:
    """kube-scheduler's verbs: it keeps connections alive between pods and sends filters,
    prioritizes and binds at once; a bind holds its thread while it waits on the API server, so
    `threads` (--threads) is sized for a burst of binds with threads to spare for filter."""
    return Limits(idle_s=KEEPALIVE_S, max_connections=2048, max_header_bytes=65536, max_body=max_body,
                  threads=threads, chunked=True)  # fmt: skip


def metrics_limits(max_body: int) -> Limits:
    # scrapes and probes (no bodies): a small budget of its own, apart from the verbs'
    return Limits(max_connections=1024, max_body=min(max_body, 65536), threads=2,
                  max_body_bytes_in_flight=4 << 20, max_queued=64)  # fmt: skip
