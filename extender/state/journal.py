"""The order in which nodes changed: what the extender's answer caches follow to look again only
at the nodes changed since they last answered."""

from __future__ import annotations

from .records import NodeInfo

JOURNAL_MAX = 200_000


class Journal:
    """Every change that can change a fit, in order: entries[i - base] is the node changed at
    sequence number i. A node's version is the sequence number of its last change, so versions
    never repeat, not even for a node deleted and created again. Guarded by the view's lock."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self.base = 0

    def touch(self, info: NodeInfo) -> None:
        """Record a change of the node: it gets a new version."""
        seq = self.base + len(self.entries)
        info.version = seq + 1
        self.entries.append(info.name)
        if len(self.entries) > JOURNAL_MAX:
            # Readers further behind than what is kept start over from a full pass.
            drop = len(self.entries) // 2
            del self.entries[:drop]
            self.base += drop

    def changed_since(self, pos: int) -> list[str] | None:
        """Nodes changed from sequence number `pos` on (repeats possible); None when the journal
        no longer reaches back that far."""
        if pos < self.base:
            return None
        return self.entries[pos - self.base :]

    @property
    def seq(self) -> int:
        """The sequence number the next change will get."""
        return self.base + len(self.entries)
