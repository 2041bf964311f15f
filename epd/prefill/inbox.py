"""Where encoders' embedding pushes land on a prefill worker.

Pushes and the request itself travel separately (encoder -> prefill, decode -> prefill), in either
order: a push for a request not seen yet is parked until the request arrives or a TTL passes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from epd.engine.mm_inputs import ItemRows


@dataclass
class _Parked:
    arrived_s: float
    items: dict[int, tuple[torch.Tensor | None, str | None, Callable[[], None] | None]] = field(default_factory=dict)


class EmbeddingInbox:
    def __init__(self, park_ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._rows: dict[str, ItemRows] = {}
        self._releases: dict[str, list[Callable[[], None]]] = {}
        self._parked: dict[str, _Parked] = {}
        self._lock = threading.Lock()
        self._park_ttl_s = park_ttl_s
        self._clock = clock
        self.on_arrival: Callable[[], None] = lambda: None

    def expect(self, request_id: str, lengths: list[int]) -> ItemRows:
        """Register a request's items; pushes that came early are applied now."""
        rows = ItemRows(lengths)
        with self._lock:
            if request_id in self._rows:
                raise ValueError(f"request {request_id} is already being prefilled")
            self._rows[request_id] = rows
            parked = self._parked.pop(request_id, None)
        for index, (tensor, error, release) in (parked.items.items() if parked else []):
            self._apply(request_id, rows, index, tensor, error, release)
        return rows

    def push(self, request_id: str, index: int, tensor: torch.Tensor | None, error: str | None,
             release: Callable[[], None] | None = None) -> None:
        with self._lock:
            rows = self._rows.get(request_id)
            if rows is None:
                parked = self._parked.setdefault(request_id, _Parked(self._clock()))
                parked.items[index] = (tensor, error, release)
                return
        self._apply(request_id, rows, index, tensor, error, release)

    def _apply(self, request_id: str, rows: ItemRows, index: int, tensor, error, release) -> None:
        if release is not None:
            with self._lock:
                self._releases.setdefault(request_id, []).append(release)
        if not 0 <= index < len(rows.lengths):
            rows.fail(0, f"encoder pushed item {index} but the request has {len(rows.lengths)} items")
        elif error is not None:
            rows.fail(index, error)
        else:
            try:
                rows.set_item(index, tensor)
            except Exception as err:  # noqa: BLE001 - a wrong shape fails this request clearly
                rows.fail(index, str(err))
        self.on_arrival()

    def fail_request(self, request_id: str, reason: str) -> bool:
        """Fail a request's rows (its prefill call raises ``reason``). An abort may overtake the
        request itself (router -> prefill vs router -> decode -> prefill): then it is parked like
        a push and fails the request the moment it arrives. Returns whether it was registered."""
        with self._lock:
            rows = self._rows.get(request_id)
            if rows is None:
                self._parked.setdefault(request_id, _Parked(self._clock())).items[0] = (None, reason, None)
                return False
        rows.fail(0, reason)
        self.on_arrival()
        return True

    def finish(self, request_id: str) -> None:
        """Forget the request and release every embedding lease it held."""
        with self._lock:
            self._rows.pop(request_id, None)
            self._parked.pop(request_id, None)
            releases = self._releases.pop(request_id, [])
        for release in releases:
            release()

    def sweep(self) -> int:
        """Drop pushes parked past the TTL (their request never came); release their leases."""
        now = self._clock()
        with self._lock:
            stale = [rid for rid, p in self._parked.items() if now - p.arrived_s > self._park_ttl_s]
            dropped = [self._parked.pop(rid) for rid in stale]
        for parked in dropped:
            for _, _, release in parked.items.values():
                if release is not None:
                    release()
        return len(stale)

    @property
    def num_parked(self) -> int:
        return len(self._parked)
