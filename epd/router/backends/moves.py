"""A request's waits and moves in the disaggregated backend: waiting out tiers that said they are
full (``Backoff``), moving off workers it lost (``Moves``), and noticing that a worker a call waits
on has left rotation (``unless_lost``; a decode stream: ``decode_link``)."""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Callable

from epd.errors import IMPORT_FAILED_MARKER, EPDError, Overloaded, UpstreamError
from epd.router.backends.base import BackendOutput, Job
from epd.router.workers import WorkerState


class Backoff:
    """A request's waits on tiers that said they are full (RESOURCE_EXHAUSTED with a retry hint):
    their hint each time, ``budget_s`` in all (the router's own queue timeout) and never past the
    request's deadline; after that the client gets the 429 with Retry-After."""

    def __init__(self, job: Job, budget_s: float) -> None:
        self.job, self.left_s = job, budget_s

    async def wait(self, err: Overloaded) -> None:
        wait_s = err.retry_after_s or 0.0
        if not await self.pause(wait_s):
            raise Overloaded(f"request {self.job.request_id}: the cluster is saturated ({err.message})",
                             retry_after_s=max(wait_s, 1.0))

    async def pause(self, wait_s: float) -> bool:
        """Sleep ``wait_s`` out of the budget; False (and no sleep) when it does not fit."""
        if wait_s > min(self.left_s, self.job.remaining_s()):
            return False
        self.left_s -= wait_s
        await asyncio.sleep(wait_s)
        return True


class ProducerFailed(UpstreamError):
    """A tier failed the request because of what another worker made for it (prefill could not
    import an encoder's rows): ``producer`` is that worker, which the request's next attempts avoid."""

    def __init__(self, message: str, producer: str) -> None:
        super().__init__(message)
        self.producer = producer


def blaming_producer(error: EPDError, encoded_on: dict[int, str]) -> EPDError:
    """Prefill's failure, as ``ProducerFailed`` naming the encoder when prefill could not import
    the rows of an item (``encoded_on``: item index -> the encoder it was sent to)."""
    match = re.search(rf"{IMPORT_FAILED_MARKER} (\d+):", error.message)
    producer = encoded_on.get(int(match[1])) if match and isinstance(error, UpstreamError) else None
    return ProducerFailed(f"{error.message} (rows from encoder {producer})", producer) if producer else error


class Suspects:
    """Producers whose output a consumer could not use (prefill could not import an encoder's rows),
    passed over by every request for a while, not only by the one that failed: such an encoder
    answers health as usual, so rotation keeps it, and hash affinity would send each new request
    there to pay a move. A blame pauses it ``base_s``, doubled for each blame in a row (one within
    ``max_s`` of the last) up to ``max_s``; when the pause ends traffic goes back, and one more
    failure pauses it again. Passing over is a preference: with no other producer it is used."""

    def __init__(self, base_s: float = 30.0, max_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self._until: dict[str, float] = {}
        self._streak: dict[str, tuple[int, float]] = {}  # address -> (blames in a row, last blame)

    def blame(self, address: str) -> float:
        """-> how long ``address`` is now passed over, in seconds."""
        now = self.clock()
        count, last = self._streak.get(address, (0, -float("inf")))
        count = count + 1 if now - last <= self.max_s else 1
        self._streak[address] = (count, now)
        pause_s = min(self.base_s * 2 ** (count - 1), self.max_s)
        self._until[address] = now + pause_s
        return pause_s

    def remaining_s(self, address: str) -> float:
        return max(0.0, self._until.get(address, 0.0) - self.clock())

    def current(self) -> set[str]:
        """The addresses passed over now."""
        now = self.clock()
        return {address for address, until in self._until.items() if until > now}


class Moves:
    """A request's moves off lost workers: what it streamed so far (the next attempt resumes after
    it, under its own request id on the workers), how many moves are left, and the producers its
    attempts avoid (an encoder whose rows could not be imported would be picked again by its
    content hash on every move)."""

    def __init__(self, job: Job, max_moves: int) -> None:
        self.original, self.job, self.left, self.count = job, job, max_moves, 0
        self.tokens: list[int] = []
        self.avoid: set[str] = set()

    def streamed(self, output: BackendOutput) -> None:
        self.tokens.extend(output.token_ids)

    def move(self, err: UpstreamError) -> str:
        """-> the stage the request moves from; raises ``err`` when no move is left (budget, deadline)."""
        if self.left == 0 or self.original.remaining_s() <= 0:
            if self.count:
                raise UpstreamError(f"{err.message} (after {self.count} moves, max_migrations reached)") from None
            raise err
        self.left, self.count = self.left - 1, self.count + 1
        if isinstance(err, ProducerFailed):
            self.avoid.add(err.producer)
        self.job = dataclasses.replace(self.original, request_id=f"{self.original.request_id}.m{self.count}",
                                       output_token_ids=tuple(self.tokens))
        return "migrated" if self.tokens else "redispatched"


class WorkerLost(UpstreamError):
    """The worker holding a call left rotation while the call waited on it."""


async def unless_lost(worker: WorkerState, awaitable):
    """``awaitable``'s result, unless ``worker`` leaves rotation first (then ``WorkerLost``)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, worker.outage()}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise WorkerLost(lost_message(worker))


def lost_message(worker: WorkerState) -> str:
    return f"{worker.tier} {worker.address} left rotation (dead, not answering or not progressing) during the call"
