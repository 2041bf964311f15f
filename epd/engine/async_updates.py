"""The bridge from an engine loop thread to a coroutine: the loop thread ``put``s each request's
``TokenUpdate``s, one coroutine awaits them. A grpc.aio handler or the router's backend waits on
this instead of a thread blocked on a queue, so a request in flight costs no thread."""
from __future__ import annotations

import asyncio

from epd.engine.engine_loop import TokenUpdate


class AsyncUpdates:
    """Made on the event loop that reads it; ``put`` may be called from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenUpdate] = asyncio.Queue()

    def put(self, update: TokenUpdate) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self, timeout_s: float) -> TokenUpdate:
        """The next update; ``asyncio.TimeoutError`` when none came within ``timeout_s``."""
        return await asyncio.wait_for(self._queue.get(), max(0.0, timeout_s))
