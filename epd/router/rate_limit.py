"""Requests per second per API key (optional): a token bucket for each key that admits
``requests_per_s`` on average and ``burst`` at once; beyond, a 429 (RESOURCE_EXHAUSTED on gRPC)
with the seconds until the next token. Keys are known by their fingerprint, never by themselves.

This is the per-client layer; the router's admission queue (``max_queued_requests``) bounds what
all clients together may hold, with or without keys."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from epd.errors import Overloaded


class KeyRateLimiter:
    def __init__(self, requests_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if requests_per_s <= 0 or burst < 1:
            raise ValueError(f"expected requests_per_s > 0 and burst >= 1, got {requests_per_s} and {burst}")
        self.requests_per_s, self.burst, self._clock = requests_per_s, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key fingerprint -> (tokens, at_s)
        self._lock = threading.Lock()  # the HTTP and gRPC front ends run on different loops

    def admit(self, key_id: str) -> None:
        """Take a token for ``key_id`` or raise ``Overloaded`` naming when one is back."""
        now_s = self._clock()
        with self._lock:
            tokens, at_s = self._buckets.get(key_id, (float(self.burst), now_s))
            tokens = min(float(self.burst), tokens + (now_s - at_s) * self.requests_per_s)
            if tokens < 1.0:
                self._buckets[key_id] = (tokens, now_s)
                wait_s = (1.0 - tokens) / self.requests_per_s
                raise Overloaded(f"API key {key_id} is over its rate limit of {self.requests_per_s:g} requests/s "
                                 f"(burst {self.burst}); retry in {wait_s:.2f} s", retry_after_s=wait_s)
            self._buckets[key_id] = (tokens - 1.0, now_s)
