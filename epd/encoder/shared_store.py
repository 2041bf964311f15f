"""One encoder cache for the whole cluster: encoder outputs shared through a store (Mooncake Store in
a deployment, ``epd.encoder.mooncake_store``), under each item's content-hash key.

An encoder looks up its own LRU first (``TensorLRUCache``), then this store, and only then encodes;
what it encodes it puts here. So an image encoded once anywhere in the cluster costs every other
encoder a fetch, and an encoder that restarts finds its work again.

An entry is a header and the rows' bytes: a magic, the dtype, the shape and a CRC-32 of the
bytes. An entry that does not match what this encoder would produce (another dtype or shape: a
key collision or a bad writer) or whose bytes do not match their checksum (truncated, corrupted)
is counted, removed from the store and encoded again: it never reaches prefill.

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
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from epd.encoder.cache import EncoderCacheKey

log = logging.getLogger("epd.encoder")

_MAGIC = b"EPDE"
_VERSION = 1
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = struct.Struct("<4sBBBxII")  # magic, version, dtype code, ndim, pad, crc32, payload bytes
_DIM = struct.Struct("<Q")
_PUT_QUEUE = 64  # outputs waiting to be put; past it a put is dropped (counted): the store is a cache


class StoreBackend(Protocol):
    """The few operations the shared cache needs of a key-value store (``put`` inserts or replaces;
    ``put_first`` writes only a key nobody wrote, and returns what the key holds after it: the
    value given when this call wrote it). Each may raise on an outage."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def put_first(self, key: str, value: bytes) -> bytes | None: ...

    def remove(self, key: str) -> None: ...

    def close(self) -> None: ...


class CorruptEntry(ValueError):
    """A stored entry that is not what this encoder would produce, or whose bytes are damaged."""


def store_key(key: EncoderCacheKey, dtype: torch.dtype) -> str:
    """The store's name for an item's output: the item's content and processor-kwargs hashes, the
    model, the rows and the dtype (every input that changes the bytes), in one flat string."""
    model = hashlib.sha256(key.model_id.encode()).hexdigest()[:16]
    return (f"epd/enc/v{_VERSION}/{model}/{key.content_hash}/{key.processor_kwargs_hash}/{key.expected_rows}/"
            f"{str(dtype).removeprefix('torch.')}")


def encode_entry(tensor: torch.Tensor) -> bytes:
    """A tensor's header and bytes, as stored."""
    rows = tensor.detach().to("cpu").contiguous()
    payload = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
    header = _HEADER.pack(_MAGIC, _VERSION, _DTYPES.index(rows.dtype), rows.dim(), zlib.crc32(payload), len(payload))
    return header + b"".join(_DIM.pack(d) for d in rows.shape) + payload


def decode_entry(blob: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of a stored entry, checked against what this encoder would produce
    (``CorruptEntry`` otherwise). The result owns its memory."""
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"{len(blob)} bytes, shorter than an entry's header")
    magic, version, code, ndim, crc, nbytes = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION or code >= len(_DTYPES):
        raise CorruptEntry(f"not an entry of this version (magic {magic!r}, version {version}, dtype code {code})")
    dims_end = _HEADER.size + ndim * _DIM.size  # the header's own bytes are not in the checksum: check its sizes
    if ndim != len(shape) or len(blob) < dims_end:
        raise CorruptEntry(f"{ndim} dimensions in {len(blob)} bytes, expected {len(shape)}")
    found_shape = tuple(_DIM.unpack_from(blob, _HEADER.size + i * _DIM.size)[0] for i in range(ndim))
    if _DTYPES[code] != dtype or found_shape != tuple(shape):
        raise CorruptEntry(f"{_DTYPES[code]} {found_shape}, expected {dtype} {tuple(shape)}")
    payload = memoryview(blob)[dims_end:]
    if len(payload) != nbytes or nbytes != dtype.itemsize * _numel(shape):
        raise CorruptEntry(f"{len(payload)} payload bytes, the header says {nbytes}, the shape needs "
                           f"{dtype.itemsize * _numel(shape)}")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("payload checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
            self._call("remove", lambda: self.backend.remove(name))
            return None
        with self._lock:
            self.stats.hits += 1
        return tensor

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
        try:
            self._puts.put_nowait((store_key(key, tensor.dtype), tensor, claim))
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
                if self._call("put", lambda: self.backend.put(name, encode_entry(tensor))) is not _FAILED:
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


class MemoryBackend:
    """A store in this process's memory: the shared cache's logic without a store service (unit
    tests, and ``epd.LLM`` which has one encoder anyway). ``fail``: make every call raise."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}
        self.calls: Counter[str] = Counter()
        self.fail = False

    def _check(self, what: str) -> None:
        self.calls[what] += 1
        if self.fail:
            raise ConnectionError("store down")

    def get(self, key: str) -> bytes | None:
        self._check("get")
        return self.entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._check("put")
        self.entries[key] = value  # insert or replace, as the Mooncake backend does

    def put_first(self, key: str, value: bytes) -> bytes | None:
        self._check("put_first")
        return self.entries.setdefault(key, value)

    def remove(self, key: str) -> None:
        self._check("remove")
        self.entries.pop(key, None)

    def close(self) -> None:
        pass
