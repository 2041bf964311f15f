"""Consumer side: turn a handle back into a tensor, keep its lease alive while the import is held
(``LeaseRenewer``), and release the lease when done."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import torch

from epd.transport.base import TRANSPORTS, ImportContext
from epd.transport.channels import get_channel
from epd.transport.handles import TransportError, check_header, check_not_expired
from epd.transport.leases import MAX_RENEW_TTL_S
from epd.v1 import tensor_pb2, tensor_pb2_grpc

log = logging.getLogger(__name__)
ChannelFactory = Callable[[str], grpc.Channel]

# How often the process-wide renewer looks for leases to renew. Producers grant 60 s by default
# (WorkerConfig.lease_ttl_s), so once a second is far below any TTL in use and a pass with nothing
# due costs no call.
DEFAULT_RENEW_PERIOD_S = 1.0
# Renew once less than this fraction of a lease's TTL is left: at half, a 60 s lease gets ~30 tries
# (one per period) before it would expire, which rides out a producer that answers slowly for a while.
DEFAULT_RENEW_MARGIN_FRACTION = 0.5
# Bounds one Renew call, so a producer that does not answer delays the next pass by this much at most.
DEFAULT_RENEW_RPC_TIMEOUT_S = 2.0
# A lease asks for at least this many periods, so a renewal due at half of it still leaves a whole
# period for a retry when a handle arrives with only moments left.
_MIN_TTL_PERIODS = 4


class ImportedTensor:
    """A tensor that may still live in the producer's memory (shm, CUDA IPC).

    Use ``.tensor`` until ``release()``; after it the producer may reuse the memory, so the tensor
    (and any view of it you kept) must not be read any more. Copy out what you need to keep.
    """

    def __init__(self, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, channel_factory: ChannelFactory,
                 timeout_s: float, renewer: LeaseRenewer | None = None) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.handle = handle
        self.channel_factory = channel_factory
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._released = False
        # held means renewed: the producer keeps the memory as long as we may read it
        self._renewer = renewer or lease_renewer()
        self._renewal_token = self._renewer.hold(self)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise TransportError(f"lease {self.handle.lease_id} was released; its tensor is no longer valid")
        return self._tensor

    @property
    def lease_id(self) -> str:
        return self.handle.lease_id

    def release(self) -> bool:
        """Tell the producer we are done. Idempotent. Returns False (and logs) when the producer could
        not be told: its TTL sweep reclaims the lease anyway, so this is never fatal."""
        if not self._let_go():
            return True
        return release_leases(self.handle.producer_address, [self.handle.lease_id],
                              channel_factory=self.channel_factory, timeout_s=self._timeout_s) >= 0

    def release_soon(self) -> None:
        """``release`` without waiting for the producer: the call goes from a background thread,
        batched with others to the same producer. For an engine thread or an event loop, where a
        producer slow to answer must not stall the work of every other request."""
        if self._let_go():
            _background_releaser().put(self.handle.producer_address, self.handle.lease_id, self.channel_factory,
                                       self._timeout_s)

    def _let_go(self) -> bool:
        """Stop using and renewing the tensor; -> whether a lease is left to release (once)."""
        with self._lock:
            if self._released:
                return False
            self._released = True
            self._tensor = None
        self._renewer.drop(self._renewal_token)
        return bool(self.handle.lease_id)  # empty: the bytes came inside the handle

    def __enter__(self) -> ImportedTensor:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def import_tensor(handle: tensor_pb2.TensorHandle, *, device: str | torch.device = "cpu",
                  channel_factory: ChannelFactory | None = None, timeout_s: float = 30.0,
                  clock: Callable[[], float] = time.time, renewer: LeaseRenewer | None = None) -> ImportedTensor:
    """Import ``handle`` onto ``device``. ``timeout_s`` bounds every network wait, so a dead producer
    is an error within that time, never a hang. Raises LeaseExpiredError when the lease is gone and
    TransportError for anything else that can't work. Until ``release()`` the lease is renewed by
    ``renewer`` (default: the process-wide ``lease_renewer()``)."""
    check_not_expired(handle, clock)
    dtype, shape = check_header(handle)
    channel_factory = channel_factory or get_channel
    ctx = ImportContext(device=torch.device(device), channel_factory=channel_factory, timeout_s=timeout_s)
    tensor = TRANSPORTS.get(handle.WhichOneof("body")).import_(handle, dtype, shape, ctx)
    return ImportedTensor(tensor, handle, channel_factory, timeout_s, renewer)


def release_leases(address: str, lease_ids: Iterable[str], *, channel_factory: ChannelFactory | None = None,
                   timeout_s: float = 5.0) -> int:
    """Release several leases of one producer in one call; returns how many it still held, or -1
    (logged) when it could not be reached."""
    lease_ids = [lease_id for lease_id in lease_ids if lease_id]
    if not lease_ids:
        return 0
    if not address:
        log.warning("can't release leases %s: the handle has no producer_address", lease_ids)
        return -1
    stub = tensor_pb2_grpc.TensorStoreStub((channel_factory or get_channel)(address))
    try:
        reply = stub.Release(tensor_pb2.ReleaseRequest(lease_ids=lease_ids), timeout=timeout_s)
    except grpc.RpcError as err:
        log.warning("release of leases %s at %s failed (%s: %s); the producer's TTL will reclaim them",
                    lease_ids, address, err.code().name, err.details())
        return -1
    return reply.num_released


@dataclass
class _Held:
    """One held import, as the renewer sees it."""

    imported: weakref.ref  # weak: an import dropped without release() is a consumer gone, left to expire
    address: str
    lease_id: str
    channel_factory: ChannelFactory
    ttl_s: float  # what each Renew asks for
    expires_s: float  # monotonic; a lower bound on when the producer may reclaim the lease


class LeaseRenewer:
    """Keeps the leases of held ``ImportedTensor``s alive, so a lease expires only when its consumer
    is gone (stopped renewing), never while it waits in a queue.

    One daemon thread ("epd-lease-renewer", started by the first ``hold``) wakes every ``period_s``
    and renews the leases with less than ``margin_fraction`` of their TTL left, in one Renew call
    per producer. A failed call is logged and retried next pass; nothing is raised into consumers.
    Each lease asks for the lifetime its handle had left at import (the producer's own TTL, less
    transit), at least ``_MIN_TTL_PERIODS`` periods and at most ``MAX_RENEW_TTL_S``.
    """

    def __init__(self, *, period_s: float = DEFAULT_RENEW_PERIOD_S,
                 margin_fraction: float = DEFAULT_RENEW_MARGIN_FRACTION,
                 rpc_timeout_s: float = DEFAULT_RENEW_RPC_TIMEOUT_S,
                 monotonic: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        if not (period_s > 0 and 0 < margin_fraction < 1 and rpc_timeout_s > 0):
            raise ValueError(f"LeaseRenewer needs period_s > 0, 0 < margin_fraction < 1, rpc_timeout_s > 0; got "
                             f"{period_s}, {margin_fraction}, {rpc_timeout_s}")
        self.period_s, self.margin_fraction, self.rpc_timeout_s = period_s, margin_fraction, rpc_timeout_s
        self._monotonic, self._wall_clock = monotonic, wall_clock
        self._lock = threading.Lock()
        self._pass_lock = threading.Lock()  # one pass at a time (the thread, or a test calling renew_due)
        self._held: dict[int, _Held] = {}
        self._tokens = itertools.count(1)
        self._failing: set[str] = set()  # producers whose last Renew failed: warn once per outage
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # the current thread's; each thread gets its own
        self._wake = threading.Event()

    # -- what ImportedTensor calls ------------------------------------------------------------------
    def hold(self, imported: ImportedTensor) -> int | None:
        """Start renewing ``imported``'s lease; returns the token for ``drop``, or None when there is
        nothing to renew (bytes inside the handle, or no producer address to renew at)."""
        handle = imported.handle
        if not (handle.lease_id and handle.producer_address and handle.expires_unix_ms):
            return None
        left_s = handle.expires_unix_ms / 1000 - self._wall_clock()
        ttl_s = min(max(left_s, _MIN_TTL_PERIODS * self.period_s), MAX_RENEW_TTL_S)
        held = _Held(weakref.ref(imported), handle.producer_address, handle.lease_id, imported.channel_factory,
                     ttl_s, self._monotonic() + min(left_s, ttl_s))
        with self._lock:
            token = next(self._tokens)
            self._held[token] = held
            self._start_thread()
        if self._is_due(held, self._monotonic()):
            self._wake.set()  # it arrived with little time left: don't wait for the next pass
        return token

    def drop(self, token: int | None) -> None:
        """Stop renewing (the consumer released the import). Unknown or None tokens are ignored."""
        if token is not None:
            with self._lock:
                self._held.pop(token, None)

    # -- the renewal pass ----------------------------------------------------------------------------
    def renew_due(self) -> int:
        """One pass: renew every held lease that is due, one Renew per producer; returns how many the
        producers extended. Never raises for a producer's failure."""
        with self._pass_lock:
            now_s, wall_s = self._monotonic(), self._wall_clock()
            batches = _by_producer(self._collect_due(now_s))
            # every producer's call in flight at once: one that does not answer delays no other
            calls = [(address, batch, self._send(address, channel_factory, batch))
                     for (address, channel_factory), batch in batches.items()]
            return sum(self._apply(address, batch, call, now_s, wall_s) for address, batch, call in calls)

    def _collect_due(self, now_s: float) -> list[tuple[int, _Held]]:
        with self._lock:
            for token, held in list(self._held.items()):
                if held.imported() is None:
                    del self._held[token]
                    log.debug("an import of lease %s was dropped without release(); no longer renewing it, "
                              "the producer's TTL reclaims it", held.lease_id)
            return [(token, held) for token, held in self._held.items() if self._is_due(held, now_s)]

    def _is_due(self, held: _Held, now_s: float) -> bool:
        return held.expires_s - now_s < self.margin_fraction * held.ttl_s

    def _send(self, address: str, channel_factory: ChannelFactory,
              batch: list[tuple[int, _Held]]) -> grpc.Future | None:
        # one ttl per call: the longest asked for, so no lease in the batch gets less than it asked
        ttl_ms = max(1, int(max(held.ttl_s for _, held in batch) * 1000))
        request = tensor_pb2.RenewRequest(lease_ids=[held.lease_id for _, held in batch], ttl_ms=ttl_ms)
        try:
            stub = tensor_pb2_grpc.TensorStoreStub(channel_factory(address))
            return stub.Renew.future(request, timeout=self.rpc_timeout_s)
        except Exception as err:  # noqa: BLE001 - a failing channel factory is one producer's problem, not the pass's
            self._log_failure(address, len(batch), repr(err))
            return None

    def _apply(self, address: str, batch: list[tuple[int, _Held]], call: grpc.Future | None,
               sent_s: float, sent_wall_s: float) -> int:
        if call is None:
            return 0
        try:
            reply = call.result()
        except grpc.RpcError as err:
            self._log_failure(address, len(batch), f"{err.code().name}: {err.details()}")
            return 0
        if len(reply.expires_unix_ms) != len(batch):
            self._log_failure(address, len(batch), f"answered {len(reply.expires_unix_ms)} expiries")
            return 0
        self._log_recovery(address)
        ttl_s = max(held.ttl_s for _, held in batch)
        renewed = 0
        for (token, held), expires_ms in zip(batch, reply.expires_unix_ms):
            if expires_ms <= 0:
                self._forget_gone(token, held)
                continue
            # the smaller of two lower bounds: what we asked for (safe under clock skew) and what the
            # producer says (shorter if it capped the ttl)
            held.expires_s = min(sent_s + ttl_s, sent_s + expires_ms / 1000 - sent_wall_s)
            renewed += 1
        return renewed

    def _forget_gone(self, token: int, held: _Held) -> None:
        with self._lock:
            still_held = self._held.pop(token, None) is not None
        if still_held:  # not a release that raced this pass; the id is dead, so naming it leaks nothing
            log.warning("lease %s at %s is not open any more although its import is still held (released "
                        "elsewhere, or it expired before a renewal got through); no longer renewing it",
                        held.lease_id, held.address)

    def _log_failure(self, address: str, num_leases: int, why: str) -> None:
        # counts, not lease ids: an open lease id is what lets its holder release it
        level = logging.DEBUG if address in self._failing else logging.WARNING
        self._failing.add(address)
        log.log(level, "renewing %d lease(s) at %s failed (%s); retrying every %.3g s until they expire",
                num_leases, address, why, self.period_s)

    def _log_recovery(self, address: str) -> None:
        if address in self._failing:
            self._failing.discard(address)
            log.info("renewing leases at %s works again", address)

    # -- the thread ----------------------------------------------------------------------------------
    def _start_thread(self) -> None:  # under self._lock
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="epd-lease-renewer", daemon=True)
        self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            if stop.is_set():
                return
            try:
                self.renew_due()
            except Exception:  # the thread must outlive any bug in one pass, or every lease would expire
                log.exception("lease renewal pass failed; retrying in %.3g s", self.period_s)

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (tests; leases still held then expire). A later ``hold`` starts a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)


def _by_producer(due: list[tuple[int, _Held]]) -> dict[tuple[str, ChannelFactory], list[tuple[int, _Held]]]:
    batches: dict[tuple[str, ChannelFactory], list[tuple[int, _Held]]] = {}
    for token, held in due:
        batches.setdefault((held.address, held.channel_factory), []).append((token, held))
    return batches


_PROCESS_RENEWER = LeaseRenewer()  # starts no thread until the first import that holds a lease


def lease_renewer() -> LeaseRenewer:
    """The process-wide renewer every ``import_tensor`` uses unless given another."""
    return _PROCESS_RENEWER


# a producer that does not answer soon is slow or gone; its TTL reclaims what it did not hear about
_BACKGROUND_RELEASE_TIMEOUT_S = 2.0


class _BackgroundReleaser:
    """One daemon thread that sends the releases ``release_soon`` queued: all that are queued when
    it wakes, one Release call per producer."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="epd-lease-releaser", daemon=True).start()

    def put(self, address: str, lease_id: str, channel_factory: ChannelFactory, timeout_s: float) -> None:
        self._queue.put((address, lease_id, channel_factory, timeout_s))

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            by_producer: dict[tuple[str, ChannelFactory], list[str]] = {}
            for address, lease_id, factory, _ in batch:
                by_producer.setdefault((address, factory), []).append(lease_id)
            timeout_s = min(min(item[3] for item in batch), _BACKGROUND_RELEASE_TIMEOUT_S)
            for (address, factory), lease_ids in by_producer.items():
                try:
                    release_leases(address, lease_ids, channel_factory=factory, timeout_s=timeout_s)
                except Exception:  # noqa: BLE001 - never let one bad producer stop every later release
                    log.exception("releasing leases at %s failed; their TTL reclaims them", address)


_RELEASER: _BackgroundReleaser | None = None
_RELEASER_LOCK = threading.Lock()


def _background_releaser() -> _BackgroundReleaser:
    global _RELEASER
    with _RELEASER_LOCK:
        if _RELEASER is None:
            _RELEASER = _BackgroundReleaser()
        return _RELEASER
