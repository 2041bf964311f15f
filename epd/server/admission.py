"""A worker's own admission: how much it holds at once, never how many threads it has.

A tier holds a request from its call's start to its end: queued, computing, or (prefill) waiting
for its rows. Past ``max_requests`` requests, or ``max_imported_bytes`` of other workers' tensors
held for them (embeddings at prefill, KV at decode), a new call is refused with RESOURCE_EXHAUSTED
and a retry hint; the router waits and retries within the request's deadline, or answers 429.
Used on the server's event loop only, so it needs no lock.
"""
from __future__ import annotations

import contextlib

from epd.errors import Overloaded

_RETRY_AFTER_S = 0.5  # a held request frees its place within a few steps


class TierAdmission:
    def __init__(self, tier: str, max_requests: int, max_imported_bytes: int) -> None:
        self.tier, self.max_requests, self.max_imported_bytes = tier, max_requests, max_imported_bytes
        self.num_requests = 0
        self.imported_bytes = 0
        # stopping gracefully: no new request (health says DRAINING, so routers send none), the held
        # ones finish
        self.draining = False

    @property
    def health_status(self) -> str:
        return "DRAINING" if self.draining else "SERVING"

    @contextlib.contextmanager
    def hold(self, imported_bytes: int = 0):
        """Count one request (and the bytes it will import) while the block runs; raises
        ``Overloaded`` past a bound. A request alone is always taken, however large: it could
        never be taken otherwise (what can never fit is the engine's to refuse)."""
        self._check(imported_bytes)
        self.num_requests += 1
        self.imported_bytes += imported_bytes
        held = HeldBytes(self, imported_bytes)
        try:
            yield held
        finally:
            self.num_requests -= 1
            held.give_back()

    def _check(self, imported_bytes: int) -> None:
        if self.draining:  # a call that raced the router's next health check: it goes elsewhere
            raise Overloaded(f"{self.tier} is stopping (draining): it takes no new request", retry_after_s=_RETRY_AFTER_S)
        if self.num_requests >= self.max_requests:
            raise Overloaded(f"{self.tier} holds {self.num_requests} requests (max_requests={self.max_requests})",
                             retry_after_s=_RETRY_AFTER_S)
        if self.num_requests and self.imported_bytes + imported_bytes > self.max_imported_bytes:
            raise Overloaded(f"{self.tier} holds {self.imported_bytes} imported bytes; {imported_bytes} more would "
                             f"pass max_imported_bytes={self.max_imported_bytes}", retry_after_s=_RETRY_AFTER_S)


class HeldBytes:
    """The imported bytes one held request counts. ``give_back`` ends the count before the request
    does: decode's KV is copied into its own cache at the first step, and the import is let go
    then, while the stream goes on for many more tokens."""

    def __init__(self, admission: TierAdmission, nbytes: int) -> None:
        self.admission, self.nbytes = admission, nbytes

    def give_back(self) -> None:
        """Idempotent: the bytes are counted off once."""
        self.admission.imported_bytes -= self.nbytes
        self.nbytes = 0
