"""NCCL communicators kept per peer pair: one 2-rank communicator between a producer (rank 0) and
one consumer device (rank 1), made at their first transfer and reused for every later one, so a
transfer costs a send and a receive, not NCCL's bootstrap (tens of ms to a second per transfer).

Order is the protocol: NCCL matches a pair's sends and receives by their order. The consumer asks
for one transfer at a time per pair (its lock is held from the request until the receive is done)
and the producer sends in the order it was asked (one thread per pair, a FIFO), so the two orders
are the same. Either side that fails or times out drops its end; the consumer then names no
communicator in its next request and both sides make a new one (``communicator_id`` tells a stale
end from the current one, so a lost reply cannot leave them on different communicators).

The NCCL calls go through ``ops`` (cupy's bindings in production, a fake in the tests).
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epd.transport.handles import TransportError

log = logging.getLogger(__name__)
PRODUCER_RANK, CONSUMER_RANK = 0, 1


def run_with_timeout(fn: Callable[[], object], timeout_s: float, what: str):
    """NCCL blocks until the peer takes part; a dead peer must become an error, not a hang. (A
    stuck daemon thread can't be cancelled; it dies with the process.)"""
    result: list = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(err)

    thread = threading.Thread(target=run, name=f"epd-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TransportError(f"{what} did not finish within {timeout_s} s; the peer may have died")
    if failure:
        raise TransportError(f"{what} failed: {failure[0]}") from failure[0]
    return result[0] if result else None


@dataclass
class PendingSend:
    tensor: torch.Tensor
    ready: object  # the event after which ``tensor`` is written (CUDA), or None
    nbytes: int


class SendPair:
    """The producer's end of one consumer device's communicator: a thread joins it, then sends
    what is submitted, in order."""

    def __init__(self, ops, device: torch.device, timeout_s: float) -> None:
        self.ops, self.device, self.timeout_s = ops, device, timeout_s
        self.communicator_id = secrets.token_hex(8)
        self.unique_id = ops.new_unique_id()
        self.broken = False
        self._queue: queue.Queue[PendingSend | None] = queue.Queue()
        threading.Thread(target=self._run, name="epd-nccl-send", daemon=True).start()

    def submit(self, send: PendingSend) -> None:
        self._queue.put(send)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        comm = None
        try:
            comm = run_with_timeout(lambda: self.ops.join(self.unique_id, PRODUCER_RANK, self.device), self.timeout_s,
                                    "NCCL init (producer)")
            while (send := self._queue.get()) is not None:
                run_with_timeout(lambda s=send: self.ops.send(comm, s.tensor, s.ready, CONSUMER_RANK), self.timeout_s,
                                 f"NCCL send of {send.nbytes} bytes")
        except Exception:  # a background thread: the consumer sees its own timeout or error
            log.exception("NCCL pair %s broke; the consumer's next transfer makes a new one", self.communicator_id)
            self.broken = True
            if comm is not None:
                self.ops.abort(comm)
            return
        self.broken = True
        if comm is not None:
            self.ops.destroy(comm)


class SendPairs:
    """Producer side: one ``SendPair`` per (consumer id, producer device)."""

    def __init__(self, ops, timeout_s: float = 120.0) -> None:
        self.ops, self.timeout_s = ops, timeout_s
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, int | None], SendPair] = {}
        self.num_made = 0

    def submit(self, consumer_id: str, communicator_id: str, send: PendingSend) -> tuple[str, bytes | None]:
        """Queue ``send`` on the pair's communicator -> (its id, the unique id when it is new)."""
        key = (consumer_id, send.tensor.device.index)
        with self._lock:
            pair = self._pairs.get(key)
            fresh = pair is None or pair.broken or pair.communicator_id != communicator_id
            if fresh:
                if pair is not None:
                    pair.close()  # the consumer no longer holds that one's other end
                pair = self._pairs[key] = SendPair(self.ops, send.tensor.device, self.timeout_s)
                self.num_made += 1
            pair.submit(send)
        return pair.communicator_id, (pair.unique_id if fresh else None)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()


class RecvPair:
    """The consumer's end of one producer's communicator, for one of its devices."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.comm = None
        self.communicator_id = ""

    def drop(self, ops, *, failed: bool = False) -> None:
        """``failed``: a call on it may still be pending (a timed-out receive): abort, which NCCL
        allows while operations are in flight, instead of destroying it under them."""
        comm, self.comm, self.communicator_id = self.comm, None, ""
        if comm is not None:
            (ops.abort if failed else ops.destroy)(comm)


class RecvPairs:
    """Consumer side: one ``RecvPair`` per (producer address, this process's device)."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.consumer_id = secrets.token_hex(8)  # this process; with the device, its end of each pair
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, int | None], RecvPair] = {}

    def receive(self, out: torch.Tensor, producer: str, ask: Callable[[str, str], tuple[str, bytes | None]],
                timeout_s: float, after=None) -> None:
        """Fill ``out`` from ``producer``; ``ask(consumer_id, communicator_id)`` requests the transfer
        from it and returns (the communicator to use, its unique id when new); ``after``: the
        event after which ``out`` may be written (its allocation on the caller's stream)."""
        with self._lock:
            pair = self._pairs.setdefault((producer, out.device.index), RecvPair())
        with pair.lock:  # one transfer at a time per pair: the producer sends in the order asked
            try:
                communicator_id, unique_id = ask(f"{self.consumer_id}:{out.device.index}", pair.communicator_id)
                if unique_id is not None:
                    pair.drop(self.ops)
                    pair.comm = run_with_timeout(lambda: self.ops.join(unique_id, CONSUMER_RANK, out.device),
                                                 timeout_s, "NCCL init (consumer)")
                    pair.communicator_id = communicator_id
                run_with_timeout(lambda: self.ops.recv(pair.comm, out, PRODUCER_RANK, after), timeout_s,
                                 f"NCCL receive of {out.numel() * out.element_size()} bytes")
            except BaseException:
                pair.drop(self.ops, failed=True)  # its state is unknown: the next transfer makes a new pair
                raise

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.drop(self.ops)
