"""Where encoders' embedding pushes land on a prefill worker: the rows of every registered request.

A request is registered here (``expect``, when the router's Prefill call arrives) before the router
lets any encoder push for it, so a push for a request this worker does not hold is late (the
request was cancelled or already finished) or a stranger's: it is refused before anything is
imported (``holds``), its lease goes back to its producer, and nothing is ever parked.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from epd.engine.mm_inputs import EmbeddingError, ItemRows


class EmbeddingInbox:
    def __init__(self, *, on_arrival: Callable[[], None] = lambda: None,
                 on_failure: Callable[[str, str], None] = lambda request_id, error: None) -> None:
        """``on_arrival()`` after rows land (wake the engine); ``on_failure(request_id, error)`` when a
        push cannot be used (wrong shape, import failed): the request fails, the worker does not."""
        self._rows: dict[str, ItemRows] = {}
        self._releases: dict[str, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self.on_arrival, self.on_failure = on_arrival, on_failure
        self.num_late_pushes = 0

    def expect(self, request_id: str, lengths: list[int]) -> ItemRows:
        """Register a request's items (rows per item, in prompt order)."""
        rows = ItemRows(lengths)
        with self._lock:
            if request_id in self._rows:
                raise ValueError(f"request {request_id} is already being prefilled here")
            self._rows[request_id] = rows
            self._releases[request_id] = []
        return rows

    def holds(self, request_id: str) -> bool:
        """Whether pushes for ``request_id`` are expected here; counts the late ones."""
        with self._lock:
            if request_id in self._rows:
                return True
            self.num_late_pushes += 1
            return False

    def push(self, request_id: str, index: int, tensor: torch.Tensor, release: Callable[[], None] | None = None
             ) -> bool:
        """Apply one item's rows; False (and the lease released now) for a request not held here."""
        with self._lock:
            rows = self._rows.get(request_id)
            if rows is not None and release is not None:
                self._releases[request_id].append(release)
            if rows is None:
                self.num_late_pushes += 1
        if rows is None:
            if release is not None:
                release()
            return False
        try:
            if not 0 <= index < len(rows.lengths):
                raise EmbeddingError(f"encoder pushed item {index} but the request has {len(rows.lengths)} items")
            rows.set_item(index, tensor)
        except EmbeddingError as err:
            self.on_failure(request_id, str(err))
            return True
        self.on_arrival()
        return True

    def fail(self, request_id: str, error: str) -> None:
        """An item could not be delivered (the push came, its tensor did not): fail the request."""
        with self._lock:
            known = request_id in self._rows
        if known:
            self.on_failure(request_id, error)

    def finish(self, request_id: str) -> None:
        """Forget the request and release every embedding lease it held."""
        with self._lock:
            self._rows.pop(request_id, None)
            releases = self._releases.pop(request_id, [])
        for release in releases:
            release()

    @property
    def num_requests(self) -> int:
        return len(self._rows)
