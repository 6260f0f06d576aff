"""The allowed time window, e.g. "01:00-05:00" (start inclusive, end exclusive; may wrap midnight)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, time
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_SPEC = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)-([01]?\d|2[0-4]):([0-5]\d)$")


class WindowError(ValueError):
    pass


@dataclass(frozen=True)
class Window:
    start: time
    end: time  # time(0, 0) with `until_midnight` for 24:00
    tz: ZoneInfo
    text: str
    until_midnight: bool = False

    def contains(self, now: datetime) -> bool:
        t = now.astimezone(self.tz).time().replace(tzinfo=None)
        if self.until_midnight:
            return t >= self.start
        if self.start == self.end:
            return True  # "00:00-00:00": always
        if self.start < self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end  # wraps midnight


def parse_window(text: str, tz: str = "UTC") -> Window:
    m = _SPEC.match(text.strip())
    if not m:
        raise WindowError(f"--window {text!r}: expected HH:MM-HH:MM, e.g. 01:00-05:00")
    h1, m1, h2, m2 = (int(x) for x in m.groups())
    if h2 == 24 and m2 != 0:
        raise WindowError(f"--window {text!r}: 24:MM is only valid as 24:00")
    try:
        zone = ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise WindowError(f"--timezone {tz!r}: unknown time zone") from e
    if h2 == 24:
        return Window(time(h1, m1), time(0, 0), zone, text, until_midnight=True)
    return Window(time(h1, m1), time(h2, m2), zone, text)
