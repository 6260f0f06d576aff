"""Small helpers shared by the device plugin tests (a uniquely named module, unlike conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable

NODE = "node-a"


def until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
