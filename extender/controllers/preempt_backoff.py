"""The preemption controller's safety net: a hold that expires without its preemptor bound means
the evictions did not place it (some filter the controller could not see refused it), so the
preemptor is backed off (1 minute, doubling, at most 30) before it may evict again; meanwhile
the replacements of its victims are left alone.

The back-off is written on the preemptor (annotation `gpupack.io/preemption-backoff`), so a
restarted leader keeps it, and kept in memory too (the pending list the pass reads may be a moment
old), pruned to the pods still waiting. A tenant may write the annotation on its own pod: it can
only delay that pod's own preemptions, never by more than the cap past now.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpupack import handoff

ANN_BACKOFF = "gpupack.io/preemption-backoff"
FIRST_S = 60.0
CAP_S = 1800.0
MAX_FAILURES = 16  # 60 s x 2^15 is far past the cap already


@dataclass(frozen=True)
class Backoff:
    failures: int  # holds that expired with the pod unbound
    since: str  # RFC 3339: when the last one was noticed
    hold: str  # that hold's reservation id (each counted once)

    def encode(self) -> str:
        return json.dumps(
            {"failures": self.failures, "since": self.since, "hold": self.hold},
            separators=(",", ":"),
            sort_keys=True,
        )

    def until(self, now: datetime) -> datetime:
        """The end of the back-off; `since` is never taken as later than `now`."""
        since = handoff.parse_rfc3339(self.since) or now
        return min(since, now) + timedelta(seconds=delay_s(self.failures))


def delay_s(failures: int) -> float:
    n = max(1, min(failures, MAX_FAILURES))
    return min(FIRST_S * float(2 ** (n - 1)), CAP_S)


def backoff_of(pod: dict[str, Any]) -> Backoff | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_BACKOFF)
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return Backoff(
            max(1, min(int(d["failures"]), MAX_FAILURES)), str(d["since"])[:64], str(d["hold"])[:256]
        )
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


def next_backoff(prev: Backoff | None, hold: str, now: datetime) -> Backoff | None:
    """The back-off after `hold` expired with the pod unbound; None when that hold was counted."""
    if prev is not None and prev.hold == hold:
        return None
    return Backoff(min((prev.failures if prev else 0) + 1, MAX_FAILURES), handoff.rfc3339(now), hold)


class Backoffs:
    """In memory: uid -> back-off, for the pods still waiting (pruned each pass). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_uid: dict[str, Backoff] = {}

    def note(self, uid: str, b: Backoff) -> None:
        with self._lock:
            self._by_uid[uid] = b

    def current(self, uid: str, pod: dict[str, Any]) -> Backoff | None:
        """The pod's back-off: its annotation's, or the one noted here if that is newer."""
        ann = backoff_of(pod)
        with self._lock:
            mine = self._by_uid.get(uid)
        if mine is None or (ann is not None and ann.failures >= mine.failures):
            return ann
        return mine

    def until(self, uid: str, pod: dict[str, Any], now: datetime) -> datetime | None:
        """When the pod's back-off ends, if it is backing off now."""
        b = self.current(uid, pod)
        if b is None:
            return None
        end = b.until(now)
        return end if end > now else None

    def prune(self, live: set[str]) -> None:
        with self._lock:
            for uid in [u for u in self._by_uid if u not in live]:
                del self._by_uid[uid]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_uid)
