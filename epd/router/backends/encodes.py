"""A request's encode calls, raced against prefill's answer: the first encode that fails ends the
wait (prefill would otherwise wait for rows that never come), and so does prefill leaving rotation."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from epd.router.backends.moves import WorkerLost, lost_message
from epd.router.workers import WorkerState


class Encodes:
    """A request's encode calls: the first failure wins a race against prefill's result (prefill
    would otherwise wait for rows that will never come)."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []
        self._failed: asyncio.Future = asyncio.get_running_loop().create_future()

    def add(self, call: Awaitable[None], on_done) -> None:
        task = asyncio.ensure_future(call)
        task.add_done_callback(self._on_done)
        task.add_done_callback(on_done)  # runs even when the task is cancelled before it starts
        self._tasks.append(task)

    def _on_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self._failed.done():
            self._failed.set_result(task.exception())

    async def race(self, reader: asyncio.Future, prefill: WorkerState):
        """``reader``'s result, or the first encode failure, or ``WorkerLost`` when prefill leaves
        rotation; a reader still running is left to the caller (its result may carry a lease that
        must not be dropped)."""
        outage = prefill.outage()
        await asyncio.wait({reader, self._failed, outage}, return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            return reader.result()
        if self._failed.done():
            raise self._failed.result()
        raise WorkerLost(lost_message(prefill))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def settle(self, grace_s: float) -> None:
        """Prefill answered: every row it needed was pushed, so a call still running only waits for
        its encoder's reply, which says which items the cluster's store has (the next request may
        have prefill read them there). Those replies get ``grace_s`` to come, then the calls end."""
        running = [task for task in self._tasks if not task.done()]
        if running:
            asyncio.get_running_loop().call_later(grace_s, lambda: [task.cancel() for task in running])
