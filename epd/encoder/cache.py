"""``TensorLRUCache``: the encoder's read-through, byte-budget LRU of per-item outputs.

One entry per item key. The first request that looks a key up becomes its *producer*; later
concurrent requests are *consumers* that wait on the same entry, so an image shared by ten
requests is encoded once. Entry life cycle::

    PENDING (producer assigned, or none after a batch failure) ── commit ──▶ READY ── evict
        └──────────────────────── fail(producer_only=False) ──▶ FAILED

Every request using an entry holds a pin on it; pinned entries are never evicted. Bytes are
charged when an entry's production starts (``begin_produce``), so READY plus in-flight bytes
never exceed ``capacity_bytes``. Tensors are opaque here: only their ``nbytes`` is read.
"""
from __future__ import annotations

import enum
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from epd.encoder.errors import EncoderCacheFullError


class EncoderCacheKey(NamedTuple):
    """What the encoder sees (content, preprocessing, weights) and what it must produce (rows)."""

    content_hash: str
    processor_kwargs_hash: str
    model_id: str
    expected_rows: int


class CacheEntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class CacheEntry:
    """One item's output. Fields change only under the owning cache's lock."""

    def __init__(self, key: EncoderCacheKey, nbytes: int, producer_request_id: str) -> None:
        self.key = key
        self.nbytes = nbytes
        self.state = CacheEntryState.PENDING
        self.tensor: Any = None
        self.ready_event: Any = None  # CUDA: recorded after the batch that wrote ``tensor``
        self.error: BaseException | None = None
        self.producer_request_id: str | None = producer_request_id
        self.produced_by: str | None = None  # the producer whose output was committed
        self.is_in_flight = False  # scheduled into an encoder batch; bytes charged
        self._pins: Counter[str] = Counter()
        self._done = threading.Event()

    @property
    def is_pinned(self) -> bool:
        return bool(self._pins)

    @property
    def pinned_by(self) -> frozenset[str]:
        return frozenset(self._pins)

    def wait(self, timeout_s: float | None = None) -> Any:
        """The committed tensor; raises the entry's error if it failed, TimeoutError if not done.

        A batch-level failure does not end the wait: the entry returns to "no producer" and
        the next scheduling pass picks a new producer among the waiting consumers.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"encoder output for {self.key} not ready after {timeout_s} s")
        if self.state is CacheEntryState.FAILED:
            raise self.error
        return self.tensor

    def __repr__(self) -> str:
        return (f"CacheEntry({self.key.content_hash[:12]}…, rows={self.key.expected_rows}, "
                f"{self.state.value}, producer={self.producer_request_id!r}, pins={dict(self._pins)})")


@dataclass(frozen=True)
class CacheMetrics:
    hits: int  # lookups that found an entry (READY or being produced): no encode for this request
    misses: int  # lookups that created an entry
    evictions: int
    bytes: int  # READY + in-flight bytes
    capacity_bytes: int
    num_entries: int


class TensorLRUCache:
    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"TensorLRUCache capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[EncoderCacheKey, CacheEntry] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    # -- lookups ---------------------------------------------------------------------------
    def lookup_or_reserve(self, key: EncoderCacheKey, request_id: str, nbytes: int) -> tuple[CacheEntry, bool]:
        """Pin ``key``'s entry for ``request_id``, creating it (producer) if absent.

        -> (entry, is_producer). A READY entry is a hit; a PENDING one makes the request a
        consumer that waits on it.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = CacheEntry(key, nbytes, producer_request_id=request_id)
                self._entries[key] = entry
                self._misses += 1
            else:
                if entry.nbytes != nbytes:
                    raise ValueError(f"cache key {key} reserved with {entry.nbytes} bytes, looked up with {nbytes}")
                self._entries.move_to_end(key)
                self._hits += 1
            entry._pins[request_id] += 1
            return entry, entry.producer_request_id == request_id and entry.state is CacheEntryState.PENDING

    def get(self, key: EncoderCacheKey) -> CacheEntry | None:
        """Peek without pinning or touching LRU order."""
        with self._lock:
            return self._entries.get(key)

    def requests_using(self, keys: Iterable[EncoderCacheKey]) -> frozenset[str]:
        with self._lock:
            return frozenset(rid for key in keys if (e := self._entries.get(key)) for rid in e._pins)

    # -- production ------------------------------------------------------------------------
    def begin_produce(self, key: EncoderCacheKey, request_id: str) -> bool:
        """Make ``request_id`` the producer of a PENDING entry and charge its bytes.

        Evicts unpinned READY entries, least recently used first, to make room; returns False
        (and evicts nothing) when even that would not be enough.
        """
        with self._lock:
            entry = self._pending_entry(key)
            if entry.is_in_flight:
                raise ValueError(f"cache key {key} is already being produced by {entry.producer_request_id!r}")
            if entry.producer_request_id not in (None, request_id):
                raise ValueError(f"cache key {key} has producer {entry.producer_request_id!r}, not {request_id!r}")
            if not self._make_room(entry.nbytes):
                return False
            entry.producer_request_id = request_id
            entry.is_in_flight = True
            self._bytes += entry.nbytes
            return True

    def requeue(self, key: EncoderCacheKey) -> None:
        """An in-flight entry whose batch was abandoned goes back to waiting, producer kept."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.is_in_flight:
                self._uncharge(entry)
                self._drop_if_unwanted(entry)

    def commit(self, key: EncoderCacheKey, tensor: Any, ready_event: Any = None) -> CacheEntry:
        """Publish ``tensor`` (and the CUDA event after which it is written): the entry becomes
        READY and every waiter wakes."""
        nbytes = int(tensor.nbytes)
        with self._lock:
            entry = self._pending_entry(key)
            if nbytes != entry.nbytes:
                raise ValueError(f"cache key {key}: committed {nbytes} bytes, reserved {entry.nbytes}")
            if not entry.is_in_flight:  # committed without begin_produce
                if not self._make_room(nbytes):
                    raise EncoderCacheFullError(
                        f"no room for {nbytes} bytes: {self._bytes} of {self.capacity_bytes} used, all pinned")
                self._bytes += nbytes
            entry.is_in_flight = False
            entry.state, entry.tensor, entry.ready_event = CacheEntryState.READY, tensor, ready_event
            entry.produced_by = entry.producer_request_id
            self._entries.move_to_end(key)
            entry._done.set()
            return entry

    def fail(self, key: EncoderCacheKey, error: BaseException, *, producer_only: bool) -> frozenset[str]:
        """Fail the producer, or every user, of ``key``; -> the request ids that failed.

        ``producer_only``: a batch-level error cannot be traced to one output, so only the
        producer fails; its pins go, the entry returns to "no producer" and stays PENDING for
        its consumers. Otherwise (the output itself was wrong) every request using the key
        fails, the entry becomes FAILED and leaves the cache so a later request retries.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not CacheEntryState.PENDING:
                return frozenset()
            self._uncharge(entry)
            if producer_only:
                producer, entry.producer_request_id = entry.producer_request_id, None
                if producer is None:
                    return frozenset()
                del entry._pins[producer]
                self._drop_if_unwanted(entry)
                return frozenset({producer})
            failed = frozenset(entry._pins)
            entry.state, entry.error = CacheEntryState.FAILED, error
            entry._pins.clear()
            del self._entries[key]
            entry._done.set()
            return failed

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: EncoderCacheKey, request_id: str) -> CacheEntry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(f"cache key {key} is not resident")
            entry._pins[request_id] += 1
            return entry

    def unpin(self, key: EncoderCacheKey, request_id: str) -> None:
        """Drop one pin of ``request_id``; unknown keys and requests are ignored."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or request_id not in entry._pins:
                return
            entry._pins[request_id] -= 1
            if entry._pins[request_id] > 0:
                return
            del entry._pins[request_id]
            if entry.state is CacheEntryState.PENDING and not entry.is_in_flight \
                    and entry.producer_request_id == request_id:
                entry.producer_request_id = None  # a consumer takes over on the next pass
            self._drop_if_unwanted(entry)

    # -- accounting ------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def metrics(self) -> CacheMetrics:
        with self._lock:
            return CacheMetrics(self._hits, self._misses, self._evictions, self._bytes,
                                self.capacity_bytes, len(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _pending_entry(self, key: EncoderCacheKey) -> CacheEntry:
        entry = self._entries.get(key)
        if entry is None or entry.state is not CacheEntryState.PENDING:
            raise KeyError(f"cache key {key} has no pending entry (got {entry!r})")
        return entry

    def _make_room(self, nbytes: int) -> bool:
        evictable = [e for e in self._entries.values() if e.state is CacheEntryState.READY and not e._pins]
        if self._bytes - sum(e.nbytes for e in evictable) + nbytes > self.capacity_bytes:
            return False
        for entry in evictable:  # oldest use first
            if self._bytes + nbytes <= self.capacity_bytes:
                break
            del self._entries[entry.key]
            self._bytes -= entry.nbytes
            entry.tensor = None  # holders keep their own reference; the cache lets go
            self._evictions += 1
        return True

    def _uncharge(self, entry: CacheEntry) -> None:
        if entry.is_in_flight:
            entry.is_in_flight = False
            self._bytes -= entry.nbytes

    def _drop_if_unwanted(self, entry: CacheEntry) -> None:
        # A PENDING entry nobody waits for and nobody is producing is dropped; READY ones stay
        # (unpinned, evictable) for later hits.
        if entry.state is CacheEntryState.PENDING and not entry._pins and not entry.is_in_flight:
            self._entries.pop(entry.key, None)
