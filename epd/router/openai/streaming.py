"""What a response needs while its request runs: the core's stream read by a task of its own
(``CorePump``), so that stopping early - the client went away, a stop string matched - cancels the
core exactly once, at the await it is blocked in, and its cleanup (cancelling the request on every
tier) can still await; and the server-sent events that carry a stream's chunks.
"""
from __future__ import annotations

import asyncio

from fastapi import Request

from epd.router.api import RouterCore
from epd.types import ChatRequest, StreamEvent

_DISCONNECT_POLL_S = 0.1  # how often a request waiting for tokens checks that its client is still there
_LINGER_S = 5.0  # a core stream still running this long after its finish event is cancelled
STATUS_CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it
DONE = b"data: [DONE]\n\n"
_pumps: set[asyncio.Task] = set()  # strong references: pumps may outlive their HTTP response briefly


class ClientGone(Exception):
    """The client of a request that is not streamed went away while it waited."""


def sse(model) -> bytes:
    """One server-sent event carrying a pydantic model as JSON."""
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class CorePump:
    """Reads ``core.generate(request)`` in a task of its own and queues the events (then None at
    the end, or the exception that ended it)."""

    def __init__(self, core: RouterCore, request: ChatRequest) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._task = asyncio.create_task(self._run(core, request), name=f"core-stream-{request.request_id}")
        _pumps.add(self._task)
        self._task.add_done_callback(_pumps.discard)

    async def _run(self, core: RouterCore, request: ChatRequest) -> None:
        events = None
        try:
            events = core.generate(request)
            async for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(None)
        except Exception as exc:  # an EPDError or a bug: the reader raises it
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # the contract's "close the iterator"; a no-op once it has ended
                await aclose()

    async def next(self, request: Request | None) -> StreamEvent | None:
        """The next event, None at the end; raises what the core raised, or ``ClientGone``.
        ``request``: watch that client while waiting (a streaming response needs not: Starlette
        cancels it when its client leaves). Asking is not free (~50 us), so never per token."""
        if not self._queue.empty():  # tokens arrive faster than they are sent: no waiting needed
            return self._unwrap(self._queue.get_nowait())
        if request is None:
            return self._unwrap(await self._queue.get())
        if await request.is_disconnected():
            raise ClientGone()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            while not getter.done():
                await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if not getter.done() and await request.is_disconnected():
                    raise ClientGone()
        finally:
            getter.cancel()
        return self._unwrap(getter.result())

    @staticmethod
    def _unwrap(item: StreamEvent | BaseException | None) -> StreamEvent | None:
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, *, cancel: bool = True) -> None:
        """Stop reading. ``cancel``: the request is abandoned, so the core's stream is cancelled
        now; otherwise it finished and gets ``_LINGER_S`` to wind down on its own. Idempotent."""
        if self._closed or self._task.done():
            return
        self._closed = True
        if cancel:
            self._task.cancel()
        else:
            asyncio.get_running_loop().call_later(_LINGER_S, self._task.cancel)
