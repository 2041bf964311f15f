"""One encoder cache for the whole cluster: encoder outputs shared through a store (Mooncake Store in
a deployment, ``epd.transport.mooncake``), under each item's content-hash key.

An encoder looks up its own LRU first (``TensorLRUCache``), then this store, and only then encodes;
what it encodes it puts here. So an image encoded once anywhere in the cluster costs every other
encoder a fetch, and an encoder that restarts finds its work again.

Entries (``epd.transport.store_entries``) carry their dtype, shape and a checksum: one that does
not match what this encoder would produce, or whose bytes are damaged, is counted, removed from the
store and encoded again: it never reaches prefill.

A store that fails (a master gone, a full store, a timeout) degrades to the local cache: each
failure is counted and logged once per outage, the store is left alone for ``retry_after_s``, and
no request fails for it.

Single flight across the cluster: before it encodes an item the store does not have, an encoder
claims it (``claim``: the first to write the item's claim key owns it; the store keeps the first
write of a key). Another encoder that needs the item meanwhile finds the claim and waits for the
result instead of encoding it too (``poll``). A claim is a lease: it names its deadline
(``claim_ttl_s`` from now, wall clock), and a claimant that dies leaves a claim that expires; the
first waiter to claim the item's next generation (``<key>/claim/<n+1>``, again first write wins)
takes over and encodes it. The owner removes its claims once the result is in the store.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epd.encoder.cache import EncoderCacheKey
from epd.transport.store_entries import (  # noqa: F401 - MemoryBackend: the in-process store
    ENTRY_VERSION,
    CorruptEntry,
    MemoryBackend,
    StoreBackend,
    decode_entry,
    encode_entry,
)

log = logging.getLogger("epd.encoder")

_PUT_QUEUE = 64  # outputs waiting to be put; past it a put is dropped (counted): the store is a cache
_KNOWN_KEYS = 65_536  # entries this encoder found or put lately, for ``holds``


def store_key(key: EncoderCacheKey, dtype: torch.dtype) -> str:
    """The store's name for an item's output: the item's content and processor-kwargs hashes, the
    model, the rows and the dtype (every input that changes the bytes), in one flat string."""
    model = hashlib.sha256(key.model_id.encode()).hexdigest()[:16]
    return (f"epd/enc/v{ENTRY_VERSION}/{model}/{key.content_hash}/{key.processor_kwargs_hash}/{key.expected_rows}/"
            f"{str(dtype).removeprefix('torch.')}")


_MAX_GENERATIONS = 8  # claims of one item past this many expired ones: encode without a claim


@dataclass
class Claim:
    """An item being encoded somewhere in the cluster: ``mine`` (this encoder encodes it) or
    another's, which holds it until ``deadline_s`` (wall clock, seconds)."""

    key: EncoderCacheKey
    name: str  # the claim key
    generation: int
    mine: bool
    deadline_s: float


@dataclass
class SharedStoreStats:
    hits: int = 0  # items fetched from the store instead of encoded
    misses: int = 0  # looked up and not there
    puts: int = 0  # outputs put
    dropped_puts: int = 0  # outputs not put: the put queue was full
    rejected: int = 0  # entries that were corrupt or not this encoder's: removed, encoded again
    errors: int = 0  # store operations that failed (each outage's first is logged)
    up: bool = True  # the last operation reached the store
    claims: int = 0  # items this encoder claimed (and so encoded for the cluster)
    waits: int = 0  # items another encoder was encoding: waited for, not encoded here
    takeovers: int = 0  # claims taken over from a claimant whose lease ran out


class SharedEncoderStore:
    """The encoder's view of the shared store: ``fetch`` (synchronous, in the encoder's loop, before
    a batch runs) and ``put`` (queued, a thread of its own puts it: a request never waits for the
    store). ``clock`` is for tests."""

    def __init__(self, backend: StoreBackend, *, retry_after_s: float = 5.0, claim_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.retry_after_s = retry_after_s
        self.claim_ttl_s = claim_ttl_s
        self.owner = secrets.token_hex(8)  # this encoder, in the claims it writes
        self._wall = wall
        self.stats = SharedStoreStats()
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()  # stats, _down_until: the loop and the put thread both write
        self._puts: queue.Queue = queue.Queue(maxsize=_PUT_QUEUE)
        self._known: OrderedDict[str, None] = OrderedDict()  # store names found or put, newest last
        self._put_thread = threading.Thread(target=self._put_loop, name="epd-encoder-store-put", daemon=True)
        self._put_thread.start()

    # -- reads -----------------------------------------------------------------------------
    def fetch(self, key: EncoderCacheKey, shape: tuple[int, ...], dtype: torch.dtype, *,
              count_miss: bool = True) -> torch.Tensor | None:
        """The item's output from the store, or None (not there, damaged, or the store is down)."""
        name = store_key(key, dtype)
        blob = self._call("get", lambda: self.backend.get(name))
        if blob is _FAILED:
            return None
        if not blob:
            self._forget(name)
            if count_miss:
                with self._lock:
                    self.stats.misses += 1
            return None
        try:
            tensor = decode_entry(blob, shape, dtype)
        except CorruptEntry as err:
            log.warning("encoder cache store: entry %s rejected (%s); encoding it again", name, err)
            with self._lock:
                self.stats.rejected += 1
            self._forget(name)
            self._call("remove", lambda: self.backend.remove(name))
            return None
        with self._lock:
            self.stats.hits += 1
        self._remember(name)
        return tensor

    def holds(self, key: EncoderCacheKey, dtype: torch.dtype) -> str | None:
        """The store's name of ``key``'s output when this encoder found it there or put it (queued
        puts too: they land within milliseconds) and the store is up; else None. A hint for the
        router, which may then have prefill read the rows from the store itself: a wrong one costs
        that read and the usual push, nothing else."""
        name = store_key(key, dtype)
        with self._lock:
            return name if self.stats.up and name in self._known else None

    def ready(self) -> bool:
        """Whether the store may be asked now: joined (a backend that joins on a thread of its own
        says so) and not left alone after a failure (``retry_after_s``)."""
        joined = getattr(self.backend, "joined", None)
        with self._lock:
            resting = self._clock() < self._down_until
        return not resting and (joined is None or joined())

    def _remember(self, name: str) -> None:
        with self._lock:
            self._known[name] = None
            self._known.move_to_end(name)
            if len(self._known) > _KNOWN_KEYS:
                self._known.popitem(last=False)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._known.pop(name, None)

    # -- single flight ---------------------------------------------------------------------
    def claim(self, key: EncoderCacheKey, dtype: torch.dtype, after: Claim | None = None) -> Claim | None:
        """Claim ``key`` for this encoder, or find who holds it: -> the claim (``mine``, or
        another's live one), or None when the store cannot say (down: encode without a claim).
        ``after``: an expired claim seen before; its next generation is tried first."""
        name = store_key(key, dtype)
        generation = after.generation + 1 if after is not None else 0
        while generation < _MAX_GENERATIONS:
            claim_name = f"{name}/claim/{generation}"
            deadline_s = self._wall() + self.claim_ttl_s
            token = f"{self.owner} {deadline_s:.3f}".encode()
            held = self._call("claim", lambda: self.backend.put_first(claim_name, token))
            if held is _FAILED:
                return None
            if held == token or _owner_of(held) == self.owner:  # ours (an earlier one of a failed batch too)
                with self._lock:
                    self.stats.claims += 1
                    self.stats.takeovers += generation > 0
                return Claim(key, claim_name, generation, True, deadline_s)
            # never longer than a lease of ours from now: a holder's clock may run ahead, a token be bad
            holder_deadline = min(_deadline_of(held, default=self._wall() + self.claim_ttl_s),
                                  self._wall() + self.claim_ttl_s)
            if holder_deadline > self._wall():
                return Claim(key, claim_name, generation, False, holder_deadline)
            generation += 1  # that claimant's lease ran out: the next generation is free to claim
        return None

    def poll(self, claim: Claim, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | Claim | None:
        """Another encoder's claim: -> its result once in the store, a new claim once the lease ran
        out (``mine``: encode it now), else None (wait on)."""
        tensor = self.fetch(claim.key, shape, dtype, count_miss=False)
        if tensor is not None:
            return tensor
        if self._wall() < claim.deadline_s:
            return None
        return self.claim(claim.key, dtype, after=claim) or Claim(claim.key, claim.name, claim.generation, True, 0.0)

    def counted_wait(self) -> None:
        with self._lock:
            self.stats.waits += 1

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: EncoderCacheKey, tensor: torch.Tensor, claim: Claim | None = None) -> None:
        """Queue an encoded output for the store (its bytes are read on the put thread: the tensor
        must not be written again, as cache entries never are); ``claim`` (this encoder's) is
        removed once the output is in."""
        too_large = getattr(self.backend, "max_entry_bytes", None)
        if too_large is not None and tensor.nbytes + 1024 > too_large:  # not an outage: this one is not kept
            with self._lock:
                self.stats.dropped_puts += 1
            return
        name = store_key(key, tensor.dtype)
        try:
            self._puts.put_nowait((name, tensor, claim))
            self._remember(name)
        except queue.Full:
            with self._lock:
                self.stats.dropped_puts += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued put is done (tests, shutdown): -> whether they all were."""
        deadline = self._clock() + timeout_s
        while self._puts.unfinished_tasks and self._clock() < deadline:
            time.sleep(0.01)
        return not self._puts.unfinished_tasks

    def _put_loop(self) -> None:
        while True:
            job = self._puts.get()
            try:
                if job is None:
                    return
                name, tensor, claim = job
                if self._call("put", lambda: self.backend.put(name, encode_entry(tensor))) is _FAILED:
                    self._forget(name)
                else:
                    with self._lock:
                        self.stats.puts += 1
                    if claim is not None and claim.mine:  # its waiters find the result first from now on
                        self._call("remove", lambda: self.backend.remove(claim.name))
            finally:
                self._puts.task_done()

    # -- outages ---------------------------------------------------------------------------
    def _call(self, what: str, op: Callable[[], object]) -> object:
        """``op()``, unless the store failed within ``retry_after_s`` (-> None); a failure is counted,
        logged once per outage, and leaves the store alone for ``retry_after_s``."""
        if self._clock() < self._down_until:
            return _FAILED
        try:
            result = op()
        except Exception as err:  # noqa: BLE001 - any store failure degrades to the local cache
            with self._lock:
                self.stats.errors += 1
                first = self.stats.up
                self.stats.up = False
                self._down_until = self._clock() + self.retry_after_s
            if first:
                log.warning("encoder cache store failed (%s: %s); using the local cache only, retrying every "
                            "%.0f s", what, err, self.retry_after_s)
            return _FAILED
        with self._lock:
            if not self.stats.up:
                log.info("encoder cache store reachable again")
            self.stats.up = True
        return result

    def close(self) -> None:
        self.flush(timeout_s=10.0)
        try:
            self._puts.put(None, timeout=5.0)
        except queue.Full:  # the put thread is stuck in the store: it is a daemon, it goes with the process
            pass
        self._put_thread.join(10.0)
        if not self._put_thread.is_alive():
            self.backend.close()


def _owner_of(token: bytes | None) -> str | None:
    try:
        return token.split()[0].decode()
    except (AttributeError, IndexError, UnicodeDecodeError):
        return None


def _deadline_of(token: bytes | None, default: float) -> float:
    """The deadline a claim token names (``<owner> <deadline>``); ``default`` for one not readable
    (being written this moment: taken as live)."""
    try:
        return float(token.split()[1])
    except (AttributeError, IndexError, ValueError):
        return default


class _Failed:
    def __bool__(self) -> bool:
        return False


_FAILED = _Failed()
