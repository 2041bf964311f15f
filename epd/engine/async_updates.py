"""The bridge from an engine loop thread to a coroutine: the loop thread ``put``s each request's
``TokenUpdate``s, one coroutine awaits them. A grpc.aio handler or the router's backend waits on
this instead of a thread blocked on a queue, so a request in flight costs no thread.

With an ``UpdateBatch``, a step's updates for every request cross to the event loop in one call
(the engine loop flushes it once per step) instead of one thread-safe call, with its wake-up
write, per request per step."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from epd.engine.engine_loop import TokenUpdate


class UpdateBatch:
    """What the engine loop's thread adds during one step, handed to ``deliver`` on ``loop`` in one
    call by ``flush`` (once per step and per round of calls; an empty flush sends nothing). The
    decode tier's stream sink is one, the in-process backend's queues another. ``add`` and ``flush``
    are the engine loop thread's alone (it is the one that publishes tokens), so nothing is locked:
    a step adds one item per request, hundreds of times a step at a large batch."""

    columns = False  # whether it takes a step's plain tokens as ``add_token`` (``StepSink`` may)

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list], None]) -> None:
        self._loop, self._deliver = loop, deliver
        self._pending: list = []

    def add(self, item) -> None:
        self._pending.append(item)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._hand_over(pending)

    def _hand_over(self, *args) -> None:
        """``deliver(*args)`` on the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def queue_batch(loop: asyncio.AbstractEventLoop) -> UpdateBatch:
    """A batch of (queue, update) pairs, each update put in its queue on ``loop``."""
    return UpdateBatch(loop, _deliver)


def _deliver(pending: list[tuple[asyncio.Queue, TokenUpdate]]) -> None:
    for queue, update in pending:
        queue.put_nowait(update)


class AsyncUpdates:
    """Made on the event loop that reads it; ``put`` may be called from any thread. With ``batch``
    (a ``queue_batch``), only the engine loop may put (it flushes the batch after each step and each
    round of calls)."""

    def __init__(self, batch: UpdateBatch | None = None, interval: int = 1) -> None:
        """``interval``: the request's tokens after the first are put in groups of that many (the
        router's --stream-interval; the engine loop holds them in the sequence until then)."""
        self.loop = asyncio.get_running_loop()
        self.batch = batch
        self.interval = interval
        self._queue: asyncio.Queue[TokenUpdate] = asyncio.Queue()
        self.batch_key = self._queue  # what the batch's items carry with each update

    def put(self, update: TokenUpdate) -> None:
        if self.batch is not None:
            self.batch.add((self.batch_key, update))
            return
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self, timeout_s: float | None = None) -> TokenUpdate:
        """The next update; ``asyncio.TimeoutError`` when none came within ``timeout_s`` (None:
        the caller keeps its own deadline)."""
        if timeout_s is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), max(0.0, timeout_s))
