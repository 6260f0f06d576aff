"""Crowds of slow clients for the listener tests (issue 31 item 2): connections that are opened and
then left idle, or that trickle a byte of a request head a second."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest


class Crowd:
    """`n` connections to each of `ports`, idle, or trickling `head` a byte a second."""

    def __init__(
        self, ports: list[int], n: int, trickle: bool, head: bytes = b"GET / HTTP/1.1\r\nHost: x\r\n"
    ) -> None:
        self.socks = [socket.create_connection(("127.0.0.1", p), timeout=5) for p in ports for _ in range(n)]
        self.head = head
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True) if trickle else None
        if self.thread:
            self.thread.start()

    def _trickle(self) -> None:
        head, i = self.head, 0
        while not self.stop.wait(1.0):
            for s in self.socks:
                with contextlib.suppress(OSError):  # closed by the server: right for a client this slow
                    s.send(head[i % len(head) : i % len(head) + 1])
            i += 1

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(5)
        for s in self.socks:
            s.close()


@pytest.fixture(name="crowd")
def crowd_fixture() -> Iterator[list[Crowd]]:
    """Crowds a test opens, closed when it ends."""
    made: list[Crowd] = []
    yield made
    for cr in made:
        cr.close()
