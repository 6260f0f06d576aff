"""What the cluster view keeps besides its pods and nodes, and how it falls back: the hooks told of
each node deleted (so that what the answer caches keep per node goes with it) and the size of
every map and set the view holds (for tests and the `gpupack_extender_tracked_entries` gauge)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

from .view_shared import HostCounts, ViewShared


class Sized(Protocol):
    """A part of the view that says how many entries its maps hold."""

    def tracked_sizes(self) -> dict[str, int]: ...


class SizedHost(HostCounts, Sized, Protocol):
    """The host ledger as view_sizes reads it."""


class SizedView(ViewShared, Protocol):
    """The view as view_sizes reads it: the parts' state, and each part's own sizes."""

    @property
    def consumed(self) -> dict[str, set[str]]: ...
    @property
    def host(self) -> SizedHost: ...
    @property
    def locks(self) -> Sized: ...


class NodeGoneHooks:
    """Bound methods told of each node deleted (view lock held). Held weakly: an Extender built
    on a view and dropped (a test's probe) is not kept alive by it, and its hook goes with it.
    Without them a long-lived pod shape's tables would keep an entry for every node an
    autoscaled cluster ever had."""

    def __init__(self) -> None:
        self._hooks: list[weakref.WeakMethod[Callable[[str], None]]] = []

    def add(self, fn: Callable[[str], None]) -> None:
        self._hooks = [r for r in self._hooks if r() is not None]
        self._hooks.append(weakref.WeakMethod(fn))

    def fire(self, name: str) -> None:
        alive = []
        for ref in self._hooks:
            fn = ref()
            if fn is not None:
                fn(name)
                alive.append(ref)
        self._hooks = alive


def view_sizes(view: SizedView) -> dict[str, int]:
    """How many entries each map and set the view keeps holds (a nested map counts its inner
    entries too): what must fall back when pods and nodes go. For tests, and the
    `gpupack_extender_tracked_entries` gauge. Takes the lock."""
    with view.lock:
        return {
            "view.nodes": len(view.nodes),
            "view.pods": len(view.pods),
            "view.state.nodes": len(view.state.nodes),
            "view.state.pods": len(view.state.pods),
            "view.slot_use": len(view.slot_use) + sum(map(len, view.slot_use.values())),
            "view.consumed": len(view.consumed) + sum(map(len, view.consumed.values())),
            "view.problems": len(view.problems),
            "view.reserved": len(view.reserved),
            "view.journal": len(view.journal.entries),  # capped (journal.JOURNAL_MAX)
            **view.host.tracked_sizes(),
            **view.locks.tracked_sizes(),
        }
