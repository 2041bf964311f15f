"""``shm`` transport: same host, CPU. The consumer maps a POSIX shared-memory segment the producer
owns and gets a zero-copy view. The producer either copies a tensor into a segment at export, or,
zero-copy, made the tensor in a segment to begin with (``shared_empty``: the encoder
writes its output rows there), and then an export is only a lease on the memory it already holds:
no copy, however many requests export the same cached rows.

Segment layout: a 64-byte header (magic + the generation it currently holds), then the tensor bytes.
64 keeps the data aligned for every dtype. A generation is a random token per use of the segment;
handles carry it (``ShmBody.generation``).

Why a pool: creating a segment means the kernel allocates and zeroes every page on first touch,
which costs several times the copy itself. Released segments are therefore kept (up to
``TensorStore.shm_pool_bytes``) and reused, already faulted in. Reuse is safe because only an
explicit release returns a segment (the consumer said it is done) and the header names the lease,
so a stale handle to a reused segment fails with LeaseExpiredError instead of reading new data. An
*expired* segment is unlinked, never reused: its consumer may still be reading it.

A segment made for a tensor (``allocate``) has holders: the tensor itself (until it and its views
are garbage) and each open lease on it. It returns to the pool when the last holder lets go, or is
unlinked if one of its leases expired.
"""
from __future__ import annotations

import math
import secrets
import threading
import weakref

import torch

from epd.shm_owners import OwnerLock, is_segment_name, owner_alive
from epd.transport.base import TRANSPORTS, Exported, ImportContext, wait_for_producer
from epd.transport.handles import LeaseExpiredError, TransportError, lease_gone_message, tensor_bytes_view
from epd.transport.shm_segments import MappingCache, Segment
from epd.v1 import tensor_pb2

HEADER_BYTES = 64
_MAGIC = b"EPDSHM1\0"
_MIN_SEGMENT_BYTES = 64 * 1024
_MAPPINGS = MappingCache()  # consumer side, one per process


def segment_capacity_bytes(nbytes: int) -> int:
    """Size classes a quarter-octave apart (<= 25% slack), so released segments fit later tensors.
    Slack costs address space, not memory: tmpfs allocates only the pages written."""
    nbytes = max(nbytes, _MIN_SEGMENT_BYTES)
    step = (1 << (nbytes - 1).bit_length()) // 8
    return -(-nbytes // step) * step


def _header(generation: str) -> bytes:
    return (_MAGIC + generation.encode("ascii")).ljust(HEADER_BYTES, b"\0")


class ShmArena:
    """One per TensorStore: its owner lock, every segment it created, and the pool of free ones."""

    def __init__(self, store) -> None:
        self.pool_bytes = store.shm_pool_bytes
        self._owner = OwnerLock()
        self._lock = threading.Lock()
        self._free: dict[int, list[Segment]] = {}  # capacity_bytes -> free segments
        self._free_bytes = 0
        self._segments: dict[str, Segment] = {}  # every live segment, free or leased
        self._by_storage: dict[int, Segment] = {}  # storage address -> segment holding a made tensor
        self._holders: dict[str, int] = {}  # made segments: the tensor (until collected) + open leases
        self._tainted: set[str] = set()  # made segments one of whose leases expired: never reused
        self._closed = False

    def acquire(self, nbytes: int) -> Segment:
        capacity = segment_capacity_bytes(HEADER_BYTES + nbytes)
        with self._lock:
            if self._closed:
                raise TransportError("TensorStore is closed; can't create shared-memory segments")
            free = self._free.get(capacity)
            if free:
                self._free_bytes -= capacity
                return free.pop()
        segment = Segment(self._owner.new_segment_name(), capacity)
        with self._lock:
            self._segments[segment.name] = segment
        return segment

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor whose memory is a segment of this arena: exporting it (or a contiguous view of
        it) later copies nothing. The tensor holds the segment through a memoryview its storage
        keeps, so the segment is let go only when the last view of the memory is gone."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        segment = self.acquire(nbytes)
        segment.generation = secrets.token_hex(16)
        segment.mm[:HEADER_BYTES] = _header(segment.generation)
        memory = memoryview(segment.mm)[HEADER_BYTES:HEADER_BYTES + nbytes]
        tensor = torch.frombuffer(memory, dtype=dtype).view(shape)
        segment.storage_ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._by_storage[segment.storage_ptr] = segment
            self._holders[segment.name] = 1
        weakref.finalize(memory, self._let_go, segment, False)
        return tensor

    def segment_of(self, tensor: torch.Tensor) -> Segment | None:
        """The made segment holding ``tensor``, if any, with one more holder (its lease)."""
        if tensor.device.type != "cpu":
            return None
        with self._lock:
            segment = self._by_storage.get(tensor.untyped_storage().data_ptr())
            if segment is not None:
                self._holders[segment.name] += 1
            return segment

    def _let_go(self, segment: Segment, expired: bool) -> None:
        with self._lock:
            if segment.name not in self._holders:
                return  # the arena closed meanwhile
            if expired:
                self._tainted.add(segment.name)
            self._holders[segment.name] -= 1
            if self._holders[segment.name]:
                return
            del self._holders[segment.name]
            self._by_storage.pop(segment.storage_ptr, None)
            reason = "expired" if segment.name in self._tainted else "released"
            self._tainted.discard(segment.name)
        self.give_back(segment, reason)

    def give_back(self, segment: Segment, reason: str) -> None:
        with self._lock:
            keep = (reason in ("released", "unused") and not self._closed
                    and self._free_bytes + segment.capacity_bytes <= self.pool_bytes)
            if keep:
                segment.mm[:HEADER_BYTES] = bytes(HEADER_BYTES)  # stale handles now fail the header check
                self._free.setdefault(segment.capacity_bytes, []).append(segment)
                self._free_bytes += segment.capacity_bytes
                return
            self._segments.pop(segment.name, None)
        segment.unlink()

    @property
    def pooled_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segments, self._segments, self._free, self._free_bytes = list(self._segments.values()), {}, {}, 0
            self._by_storage, self._holders, self._tainted = {}, {}, set()
        for segment in segments:
            segment.unlink()
        self._owner.close()


class _SegmentLease:
    def __init__(self, arena: ShmArena, segment: Segment) -> None:
        self.arena, self.segment = arena, segment

    def reclaim(self, reason: str) -> None:
        self.arena.give_back(self.segment, reason)


class _HolderLease:
    """A lease on a made segment: one holder among others (the tensor, other leases)."""

    def __init__(self, arena: ShmArena, segment: Segment) -> None:
        self.arena, self.segment = arena, segment

    def reclaim(self, reason: str) -> None:
        self.arena._let_go(self.segment, reason == "expired")


def _copy_into(segment: Segment, tensor: torch.Tensor, nbytes: int) -> None:
    """The one copy. A contiguous CPU tensor goes through a plain memcpy (mmap slice assignment), not
    ``copy_``: exports run on gRPC handler threads, and a parallel torch op there would give that
    thread an OpenMP team of its own and slow the engine thread's (see ``epd.engine.engine_loop``)."""
    start, end = HEADER_BYTES, HEADER_BYTES + nbytes
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        segment.mm[start:end] = tensor_bytes_view(tensor)
    else:  # strided or on a device: torch gathers it
        segment.view[start:end].view(tensor.dtype).view(tensor.shape).copy_(tensor)


class ShmTransport:
    name = "shm"
    same_host_only = True

    def export(self, store, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, ready_event=None) -> Exported:
        arena: ShmArena = store.transport_state(self.name, ShmArena)
        wait_for_producer(tensor, ready_event)
        if tensor.is_contiguous() and (made := arena.segment_of(tensor)) is not None:
            offset = HEADER_BYTES + tensor.data_ptr() - made.storage_ptr  # already in shared memory: no copy
            _describe(handle, made, offset, made.generation)
            return Exported(payload=None, resource=_HolderLease(arena, made))
        segment = arena.acquire(handle.nbytes)
        try:
            if handle.nbytes:
                _copy_into(segment, tensor, handle.nbytes)
            segment.mm[:HEADER_BYTES] = _header(handle.lease_id)  # last: the segment is complete
        except BaseException:
            arena.give_back(segment, "failed")
            raise
        _describe(handle, segment, HEADER_BYTES, handle.lease_id)
        return Exported(payload=None, resource=_SegmentLease(arena, segment))

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        body = handle.shm
        name = body.segment_name
        if not is_segment_name(name):  # also keeps "../x" and friends out of shm_open
            raise TransportError(f"lease {handle.lease_id}: {name!r} is not an EPD shm segment name "
                                 "(expected epd_<pid>_<owner hex16>_<token hex32>)")
        end_bytes = body.offset_bytes + handle.nbytes
        if end_bytes > body.segment_bytes:
            raise TransportError(f"lease {handle.lease_id}: tensor of {handle.nbytes} bytes at offset "
                                 f"{body.offset_bytes} does not fit segment_bytes={body.segment_bytes}")
        if body.offset_bytes % dtype.itemsize:
            raise TransportError(f"lease {handle.lease_id}: offset {body.offset_bytes} is not aligned to {dtype}")
        try:
            mm = _MAPPINGS.map(name)
        except FileNotFoundError:
            raise LeaseExpiredError(
                f"{lease_gone_message(handle.lease_id, 'expired', None)} "
                f"(shm segment {name} is gone: expired or released, or the producer reclaimed it)") from None
        except PermissionError:
            raise TransportError(f"lease {handle.lease_id}: shm segment {name} is mode 0600 and belongs to "
                                 "another user; run producer and consumer as the same user") from None
        if len(mm) < end_bytes:
            raise TransportError(f"lease {handle.lease_id}: shm segment {name} holds {len(mm)} bytes, "
                                 f"the handle needs {end_bytes}")
        if not owner_alive(name):
            raise TransportError(
                f"lease {handle.lease_id}: the producer of shm segment {name} is gone (its owner lock is free); "
                "the segment is stale and epd.transport.cleanup_stale_segments() will remove it")
        if mm[:HEADER_BYTES] != _header(body.generation or handle.lease_id):
            raise LeaseExpiredError(f"{lease_gone_message(handle.lease_id, 'released', None)} "
                                    f"(shm segment {name} no longer serves it)")
        numel = math.prod(shape)
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            # zero-copy: the tensor holds the mapping, which outlives a later unlink by the producer
            tensor = torch.frombuffer(mm, dtype=dtype, count=numel, offset=body.offset_bytes).view(shape)
        return tensor if ctx.device.type == "cpu" else tensor.to(ctx.device)


def _describe(handle: tensor_pb2.TensorHandle, segment: Segment, offset_bytes: int, generation: str) -> None:
    handle.shm.segment_name = segment.name
    handle.shm.offset_bytes = offset_bytes
    handle.shm.segment_bytes = segment.capacity_bytes
    handle.shm.generation = generation


TRANSPORTS.register("shm")(ShmTransport())


def clear_mapping_cache(segment_name: str | None = None) -> None:
    """Drop this process's cached mapping of one segment, or of all (tensors using one keep it mapped)."""
    _MAPPINGS.clear(segment_name)


def shared_empty(store, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in ``store``'s (a ``TensorStore``) shared memory: a producer that
    writes its output here (the encoder's rows, prefill's KV) exports it over shm later with no copy
    at all."""
    return store.transport_state("shm", ShmArena).allocate(tuple(shape), dtype)
