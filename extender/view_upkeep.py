"""What the cluster view keeps besides its pods and nodes, and how it falls back: the hooks told of
each node deleted (so that what the answer caches keep per node goes with it) and the size of
every map and set the view holds (for tests and the `gpupack_extender_tracked_entries` gauge)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .view import ClusterView


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


def view_sizes(view: ClusterView) -> dict[str, int]:
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
