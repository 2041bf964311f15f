"""Producer side: ``TensorStore`` keeps exported tensors alive under leases.

A lease ends when the consumer releases it, when its TTL passes (``sweep``, run by a background
thread from ``start_sweeper``), or when the store closes. A consumer that still holds an import
renews its lease (``renew``, the ``Renew`` RPC, sent by ``epd.transport.consumer.LeaseRenewer``), so
a lease expires only when its consumer stopped renewing: it is gone. That is what makes "nothing
leaks when either side dies" true: a consumer that dies neither releases nor renews, so its leases
expire; a producer that dies leaves shm segments behind, which ``cleanup_stale_segments`` removes at
the next start.
"""
from __future__ import annotations

import secrets
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from epd.transport.base import TRANSPORTS, Exported, exporting_transports
from epd.transport.handles import LeaseExpiredError, TransportError, dtype_to_str, lease_gone_message
from epd.v1 import tensor_pb2

MiB = 1024 * 1024
# remember this many ended leases, so a late Fetch/Release hears "released 3 s ago", not "unknown"
_NUM_REMEMBERED_ENDED_LEASES = 65536
# The longest one Renew may extend a lease. Renewal is a heartbeat: a consumer that dies right after
# renewing pins the producer's memory this long at most, so one call (a bug, a huge ttl) can't pin
# it for ever. Consumers renew well before expiry, so the cap costs them only more frequent calls.
MAX_RENEW_TTL_S = 600.0
# A Release by consumer key (``release_consumer`` over the wire) needs a key this long: keys are
# random (128 bits in hex from the router), so nobody else's leases can be released by guessing one
MIN_CONSUMER_KEY_CHARS = 32
MAX_CONSUMER_KEYS = 16  # per Release call: each key scans the open leases

_LOCAL_STORES: weakref.WeakSet[TensorStore] = weakref.WeakSet()


@dataclass
class _Lease:
    lease_id: str
    transport: str
    nbytes: int
    expires_s: float
    consumer_hint: str | None
    exported: Exported


class TensorStore:
    """Thread-safe. ``address`` is where this store's gRPC TensorStore service answers (host:port);
    set it after binding when the port is chosen by the OS."""

    def __init__(self, *, address: str = "", clock: Callable[[], float] = time.time,
                 inline_max_bytes: int = 1 * MiB, fetch_chunk_bytes: int = 1 * MiB,
                 shm_pool_bytes: int = 256 * MiB) -> None:
        if inline_max_bytes < 0 or fetch_chunk_bytes < 1 or shm_pool_bytes < 0:
            raise ValueError(
                f"TensorStore needs inline_max_bytes >= 0, fetch_chunk_bytes >= 1, shm_pool_bytes >= 0; got "
                f"{inline_max_bytes}, {fetch_chunk_bytes}, {shm_pool_bytes}")
        self.address = address
        self.clock = clock  # unix seconds: expiry crosses processes as expires_unix_ms
        self.inline_max_bytes = inline_max_bytes
        self.fetch_chunk_bytes = fetch_chunk_bytes
        self.shm_pool_bytes = shm_pool_bytes
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()  # lease_id -> (reason, when_s)
        # leases ended so far, by how (released / expired / closed): many "expired" are consumers
        # that died or forgot to release, and memory held for a TTL longer than it had to be
        self.num_ended_by_reason: Counter[str] = Counter()
        self._open_bytes = 0
        self._states: dict[str, Any] = {}  # per-transport producer state (shm arena, NCCL senders)
        self._closed = False
        self._sweeper: threading.Thread | None = None
        self._stop_sweeper = threading.Event()
        _LOCAL_STORES.add(self)

    # -- export / release ---------------------------------------------------------------------
    def export(self, tensor: torch.Tensor, *, transport: str, ttl_s: float,
               consumer_hint: str | None = None,
               ready_event: torch.cuda.Event | None = None) -> tensor_pb2.TensorHandle:
        """Describe ``tensor`` in a handle and keep it alive for ``ttl_s`` seconds or until released.

        shm copies the tensor into a segment now, unless it lives in one already
        (``epd.transport.shm.shared_empty``); the other transports keep a reference, so don't modify an exported
        tensor in place. ``consumer_hint`` names the consumer (for
        ``release_consumer``). ``ready_event``: a CUDA event the producer recorded where it wrote
        ``tensor`` (readers wait for it). Small inline tensors carry their bytes and get no lease
        (empty lease_id).
        """
        if transport not in exporting_transports():
            raise ValueError(f"unknown transport {transport!r}; expected one of {exporting_transports()}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        if self._closed:
            raise TransportError("TensorStore is closed; can't export")
        tensor = tensor.detach()
        lease_id = secrets.token_hex(16)  # 128 random bits: a lease can't be guessed and released by others
        expires_s = self.clock() + ttl_s
        handle = tensor_pb2.TensorHandle(
            dtype=dtype_to_str(tensor.dtype), shape=list(tensor.shape), nbytes=tensor.numel() * tensor.element_size(),
            lease_id=lease_id, producer_address=self.address, expires_unix_ms=int(expires_s * 1000))
        exported = TRANSPORTS.get(transport).export(self, tensor, handle, ready_event)
        if exported.payload is None and exported.resource is None:
            # the bytes travel inside the handle: nothing to keep, release or expire
            handle.lease_id, handle.expires_unix_ms = "", 0
            return handle
        lease = _Lease(lease_id, transport, handle.nbytes, expires_s, consumer_hint, exported)
        with self._lock:
            closed = self._closed
            if not closed:
                self._leases[lease_id] = lease
                self._open_bytes += lease.nbytes
        if closed:
            self._reclaim([lease], "closed")
            raise TransportError("TensorStore closed during export")
        return handle

    def release(self, lease_ids: Iterable[str], *, unused: bool = False) -> int:
        """Release leases the consumer is done with; unknown or already-ended ids are ignored.
        ``unused``: nobody imported them (a refused push): a transport that counts its consumers
        (cuda_ipc) counts down for the one that never came."""
        with self._lock:
            leases = [self._pop(lease_id, "released") for lease_id in lease_ids]
        leases = [lease for lease in leases if lease is not None]
        self._reclaim(leases, "unused" if unused else "released")
        return len(leases)

    def renew(self, lease_ids: Iterable[str], ttl_s: float) -> list[float | None]:
        """Keep open leases alive at least ``ttl_s`` more seconds (capped at ``MAX_RENEW_TTL_S``).

        Each expiry becomes max(its expiry, now + ttl_s): a renewal never shortens a lease. Returns
        the new expiry (unix seconds) per id, None for an id that is not open any more. A lease past
        its expiry that the sweeper has not reclaimed yet is still open (its memory is untouched),
        so renewing it keeps it.
        """
        if not ttl_s > 0:  # also refuses NaN
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        until_s = self.clock() + min(ttl_s, MAX_RENEW_TTL_S)
        with self._lock:
            return [self._extend(lease_id, until_s) for lease_id in lease_ids]

    def release_consumer(self, consumer_hint: str) -> int:
        """Release every lease exported for one consumer, e.g. when it is known to have died."""
        with self._lock:
            ids = [lease.lease_id for lease in self._leases.values() if lease.consumer_hint == consumer_hint]
        return self.release(ids)

    def sweep(self, now: float | None = None) -> int:
        """Reclaim every lease whose TTL has passed; returns how many."""
        now = self.clock() if now is None else now
        with self._lock:
            expired = [(lease.lease_id, lease.expires_s) for lease in self._leases.values() if lease.expires_s <= now]
            # remembered as ending at its expiry time, so a late consumer hears how long ago that was
            leases = [self._pop(lease_id, "expired", expires_s) for lease_id, expires_s in expired]
        self._reclaim(leases, "expired")
        return len(leases)

    def start_sweeper(self, period_s: float = 1.0) -> None:
        if self._sweeper is not None:
            return
        self._sweeper = threading.Thread(target=self._sweep_forever, args=(period_s,), name="epd-lease-sweeper",
                                         daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Reclaim every lease and every transport resource (unlinks all shm segments of this store)."""
        self._stop_sweeper.set()
        if self._sweeper is not None:
            self._sweeper.join()
            self._sweeper = None
        with self._lock:
            self._closed = True
            leases = [self._pop(lease_id, "closed") for lease_id in list(self._leases)]
            states, self._states = list(self._states.values()), {}
        self._reclaim(leases, "closed")
        for state in states:
            state.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what servicers and transports read ------------------------------------------------------
    def payload(self, lease_id: str) -> torch.Tensor:
        """The tensor under an open lease, or LeaseExpiredError saying how the lease ended."""
        exported = self.exported(lease_id)
        if exported.payload is None:
            raise TransportError(f"lease {lease_id} has no tensor to serve (its transport does not stream)")
        return exported.payload

    def exported(self, lease_id: str) -> Exported:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                return lease.exported
            ended = self._ended.get(lease_id)
        if ended is not None:
            reason, when_s = ended
            raise LeaseExpiredError(lease_gone_message(lease_id, reason, self.clock() - when_s))
        raise LeaseExpiredError(
            f"lease {lease_id} is unknown to this producer: it expired or was released long ago, "
            "or the producer restarted; ask the producer again")

    def transport_state(self, name: str, factory: Callable[[TensorStore], Any]) -> Any:
        """Per-transport producer state, made on first use and closed with the store."""
        with self._lock:
            if self._closed:
                raise TransportError("TensorStore is closed")
            if name not in self._states:
                self._states[name] = factory(self)
            return self._states[name]

    @property
    def num_open_leases(self) -> int:
        return len(self._leases)

    @property
    def open_bytes(self) -> int:
        return self._open_bytes

    # -- internals -------------------------------------------------------------------------------
    def _extend(self, lease_id: str, until_s: float) -> float | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        lease.expires_s = max(lease.expires_s, until_s)
        return lease.expires_s

    def _pop(self, lease_id: str, reason: str, ended_s: float | None = None) -> _Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        self._open_bytes -= lease.nbytes
        self._ended[lease_id] = (reason, self.clock() if ended_s is None else ended_s)
        self.num_ended_by_reason[reason] += 1
        while len(self._ended) > _NUM_REMEMBERED_ENDED_LEASES:
            self._ended.popitem(last=False)
        return lease

    @staticmethod
    def _reclaim(leases: list[_Lease], reason: str) -> None:
        # outside the lock: unlinking segments is a syscall, and reclaim may take another lock
        for lease in leases:
            if lease.exported.resource is not None:
                lease.exported.resource.reclaim(reason)

    def _sweep_forever(self, period_s: float) -> None:
        while not self._stop_sweeper.wait(period_s):
            self.sweep()


def find_local_export(lease_id: str) -> Exported | None:
    """What a store in *this* process keeps under ``lease_id``, if any.

    CUDA IPC can't open a memory handle in the process that made it, and a 2-rank NCCL group can't
    be formed with itself, so those transports hand over the producer's tensor directly instead.
    """
    for store in list(_LOCAL_STORES):
        try:
            return store.exported(lease_id)
        except TransportError:
            continue
    return None
