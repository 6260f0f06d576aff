"""Write and remove defrag reservations in a Node's `gpupack.io/reservations` annotation.

Read-modify-write with the Node's resourceVersion as precondition (409 -> read again), so a
concurrent writer (the device plugin's inventory, another tool) is never overwritten. Expired
reservations are dropped on every write. A corrupt annotation is never rewritten blindly: the
move that needs it is skipped with the decoder's message.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from gpupack.contract import (
    ANN_RESERVATIONS,
    ContractError,
    Reservation,
    decode_reservations,
    encode_reservations,
)
from gpupack.kubeclient import ApiException, KubeClient

from ...state.reservations import is_active


class ReserveError(RuntimeError):
    pass


class ReservationWriter:
    def __init__(self, kc: KubeClient, attempts: int = 8) -> None:
        self.kc = kc
        self.attempts = attempts

    def _read(self, node: str) -> tuple[list[Reservation], str]:
        raw = self.kc.json(self.kc.core.read_node, node)
        meta = raw.get("metadata") or {}
        text = (meta.get("annotations") or {}).get(ANN_RESERVATIONS)
        current: list[Reservation] = []
        if text:
            try:
                current = decode_reservations(text, node)
            except ContractError as e:
                raise ReserveError(f"node {node}: {e}; not rewriting it") from None
        return current, str(meta.get("resourceVersion", ""))

    def _update(
        self, node: str, change: Callable[[list[Reservation]], list[Reservation]], now: datetime
    ) -> list[Reservation]:
        last: ApiException | None = None
        for _ in range(self.attempts):
            current, rv = self._read(node)
            new = [r for r in change(current) if is_active(r, now)]
            if [r.id for r in new] == [r.id for r in current]:
                return new  # nothing to write
            value = encode_reservations(new) if new else None
            body: dict[str, Any] = {
                "metadata": {"resourceVersion": rv, "annotations": {ANN_RESERVATIONS: value}}
            }
            try:
                self.kc.merge_patch(self.kc.core.patch_node, node, body)
                return new
            except ApiException as e:
                if e.status != 409:
                    raise
                last = e
        raise ReserveError(
            f"node {node}: reservations kept changing ({last.status if last else '?'} Conflict)"
        )

    def add(self, node: str, r: Reservation, now: datetime) -> None:
        self._update(node, lambda cur: [x for x in cur if x.id != r.id] + [r], now)

    def remove(self, node: str, ids: set[str], now: datetime) -> None:
        self._update(node, lambda cur: [x for x in cur if x.id not in ids], now)
