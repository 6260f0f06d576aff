"""A gunicorn worker that serves each connection in a thread of its own (`--serving connection`).

kube-scheduler calls filter (and prioritize) one pod at a time over a kept-alive connection, and
binds over a few more. gunicorn's gthread worker hands every request on a kept-alive connection
from its poller thread to a pool thread and back again (two more threads that must each get the
GIL, on a CPU shared with binds and watch events); here the thread that owns the connection is
woken by the request's bytes and answers it at once. Requests go through gunicorn's own parser
and its ThreadWorker.handle_request, so the answers, access log, keep-alive and limits are the
same; only the threading differs. Connections at once are capped by `worker_connections`.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
import time
from typing import Any

from gunicorn.http import errors as http_errors
from gunicorn.workers.gthread import TConn, ThreadWorker

ACCEPT_POLL_S = 0.5  # how soon an accept loop sees the worker stopping
# A connection's thread waits this long for the next connection before it ends. kube-scheduler's
# HTTP client keeps only 2 idle connections to the extender, so binds in parallel open (and close)
# new ones all the time: a thread started per connection was ~6% of the extender's CPU in a burst.
IDLE_THREAD_S = 30.0
IDLE_THREADS_MAX = 64


class ConnectionThreadWorker(ThreadWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stopping = threading.Event()
        self._conn_lock = threading.Lock()
        self._open = 0
        self._room = threading.Semaphore(max(1, self.cfg.worker_connections))
        self._idle: list[_Handoff] = []  # threads between connections, newest last

    def handle_exit(self, sig: Any, frame: Any) -> None:
        self.alive = False
        self._stopping.set()

    def run(self) -> None:
        for listener in self.sockets:
            threading.Thread(target=self._accept_loop, args=(listener,), name="accept", daemon=True).start()
        while self.alive:
            self.notify()
            if not self.is_parent_alive():
                break
            self._stopping.wait(1.0)
        self.alive = False
        # stop accepting, then give the requests in progress (binds) the graceful timeout
        deadline = time.monotonic() + self.cfg.graceful_timeout
        while time.monotonic() < deadline:
            with self._conn_lock:
                if self._open == 0:
                    break
            self.notify()
            time.sleep(0.05)
        for s in self.sockets:
            s.close()

    def _accept_loop(self, listener: Any) -> None:
        while self.alive:
            if not self._room.acquire(timeout=ACCEPT_POLL_S):
                continue
            try:
                ready, _, _ = select.select([listener], [], [], ACCEPT_POLL_S)
                if not ready or not self.alive:
                    self._room.release()
                    continue
                sock, client = listener.accept()
            except OSError as e:
                self._room.release()
                if e.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK, errno.EINTR):
                    continue
                if not self.alive:
                    return
                self.log.warning("accept failed: %s", e)
                time.sleep(0.1)
                continue
            with self._conn_lock:
                self._open += 1
                idle = self._idle.pop() if self._idle else None
            job = (listener, sock, client)
            if idle is not None:
                idle.give(job)
            else:
                threading.Thread(target=self._conn_loop, args=(job,), name="conn", daemon=True).start()

    def _conn_loop(self, job: tuple[Any, socket.socket, Any]) -> None:
        """Serve `job`, then wait (idle) for the next connection the accept loop hands over."""
        me = _Handoff()
        while True:
            self._serve(*job)
            with self._conn_lock:
                if not self.alive or len(self._idle) >= IDLE_THREADS_MAX:
                    return
                self._idle.append(me)
            nxt = me.take(IDLE_THREAD_S)
            if nxt is None:
                with self._conn_lock:
                    if me in self._idle:
                        self._idle.remove(me)
                        return
                nxt = me.take(None)  # handed a connection just as the wait ran out
                assert nxt is not None
            job = nxt

    def _serve(self, listener: Any, sock: socket.socket, client: Any) -> None:
        req = None
        conn = TConn(self.cfg, sock, client, listener.getsockname())
        try:
            conn.sock.setblocking(True)
            conn.init()
            # an idle kept-alive connection is closed after `keepalive` seconds, as gthread does
            conn.sock.settimeout(self.cfg.keepalive or None)
            while self.alive:
                req = next(conn.parser)
                if not req:
                    break
                if not self._keepalive_after(conn, self.handle_request(req, conn)):
                    break
                req = None
        except (StopIteration, http_errors.NoMoreData, TimeoutError):
            pass
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                self.log.exception("socket error processing request")
        except Exception as e:
            self.handle_error(req, conn.sock, conn.client, e)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._conn_lock:
                self._open -= 1
            self._room.release()


class _Handoff:
    """One idle thread's mailbox: the accept loop puts the next connection in, the thread takes it."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._job: tuple[Any, socket.socket, Any] | None = None

    def give(self, job: tuple[Any, socket.socket, Any]) -> None:
        self._job = job
        self._ready.set()

    def take(self, timeout: float | None) -> tuple[Any, socket.socket, Any] | None:
        if not self._ready.wait(timeout):
            return None
        self._ready.clear()
        job, self._job = self._job, None
        return job
