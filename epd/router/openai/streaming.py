"""What a response needs while its request runs: the core's stream read by a task of its own
(``CorePump``), so that stopping early - the client went away, a stop string matched - cancels the
core exactly once, at the await it is blocked in, and its cleanup (cancelling the request on every
tier) can still await; and the server-sent events of a streamed response (``EventStream``).

A streamed response's frames are written by the pump's own task as each event comes: the event
crosses no queue and wakes no second task on its way from the decode stream to the socket (a
token's path is the router's hot path: one task switch less per token is a measurable share of
its cost). A client that reads slowly holds up only its own pump, at the socket's flow control;
meanwhile its tokens pile up at the decode link and reach it as one event, hence one frame.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from epd.errors import EPDError, InternalError
from epd.router.api import RouterCore
from epd.router.openai.responses import ErrorResponse
from epd.types import ChatRequest, StreamEvent

log = logging.getLogger("epd.router.http")

_LINGER_S = 5.0  # a core stream still running this long after its finish event is cancelled
_OVERDUE_GRACE_S = 5.0  # a stream still writing this long past its request's deadline is cut
STATUS_CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it
DONE = b"data: [DONE]\n\n"
_pumps: set[asyncio.Task] = set()  # strong references: pumps may outlive their HTTP response briefly


class ClientGone(Exception):
    """The client of a request that is not streamed went away while it waited."""


def sse(model) -> bytes:
    """One server-sent event carrying a pydantic model as JSON."""
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class Frames(Protocol):
    """How one API spells a stream: the bytes each event becomes (several events' frames may go out
    in one write)."""

    @property
    def is_finished(self) -> bool:
        """Every choice has its finish: the events after it are not sent."""

    def opening(self, first: StreamEvent) -> bytes:
        """What goes before the first event's own frames."""

    def event(self, event: StreamEvent) -> bytes: ...

    def end(self) -> bytes:
        """After the last event (or the core's stream ended without a finish): the closing frames."""

    def fail(self, exc: BaseException) -> bytes:
        """The stream failed after its first event: an error event (``stream_error``) and the end."""


class CorePump:
    """Reads ``core.generate(request)`` in a task of its own and queues the events (then None at
    the end, or the exception that ended it) for ``next``. With ``stream``, only the first event
    is queued (it decides the response's status); the pump then waits for its ``EventStream`` to
    ``attach`` and writes every frame itself, the first included, so frames go out from one task
    only and in order."""

    def __init__(self, core: RouterCore, request: ChatRequest, *, stream: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._request_id = request.request_id
        self._frames: Frames | None = None
        self._send: Callable[[bytes], Awaitable[None]] | None = None
        self._attached: asyncio.Event | None = asyncio.Event() if stream else None
        self._gone: asyncio.Future | None = None  # the client's disconnect, once watched
        self.ended: asyncio.Future = loop.create_future()  # the stream is written (or given up)
        self.failed = self.overdue = False  # a frame could not be spelled / the client read nothing in time
        # the core's own deadline ends the request; this one ends a stream stuck writing to a client
        # that reads nothing (its request would hold its admission slot for as long)
        timeout_s = request.timeout_s or getattr(core, "request_timeout_s", None)
        self._give_up_at = loop.time() + timeout_s + _OVERDUE_GRACE_S if timeout_s else None
        self._task = asyncio.create_task(self._run(core, request), name=f"core-stream-{request.request_id}")
        _pumps.add(self._task)
        self._task.add_done_callback(_pumps.discard)

    async def _run(self, core: RouterCore, request: ChatRequest) -> None:
        events = None
        try:
            events = core.generate(request)
            if self._attached is None:
                async for event in events:
                    self._queue.put_nowait(event)
                self._queue.put_nowait(None)
                return
            first = await anext(events, None)
            self._queue.put_nowait(first)  # its status is decided by it: a 200 and a stream, or an error
            if first is None:
                return
            await self._attached.wait()
            await self._emit(first, first=True)
            async for event in events:  # read to the end (the core's own bookkeeping); nothing past the finish is sent
                await self._emit(event)
            await self._emit(None)
        except Exception as exc:  # an EPDError or a bug: the reader raises it, or the stream says it
            if self._send is None:
                self._queue.put_nowait(exc)
            else:
                try:
                    await self._emit(exc)
                except Exception:  # noqa: BLE001 - the client is gone: nobody to tell
                    log.debug("request %s: could not send the error", request.request_id, exc_info=True)
        finally:
            if not self.ended.done():  # however it ends, a response waiting on it ends too
                self.ended.set_result(None)
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # the contract's "close the iterator"; a no-op once it has ended
                await aclose()

    async def _emit(self, item: StreamEvent | BaseException | None, *, first: bool = False) -> None:
        """One item's frames (with the stream's end once it is finished) sent."""
        if self.ended.done():
            return
        frames = self._frames
        try:
            if item is None or isinstance(item, BaseException):
                data, is_last = frames.end() if item is None else frames.fail(item), True
            else:
                data = (frames.opening(item) if first else b"") + frames.event(item)
                is_last = frames.is_finished
                if is_last:
                    data += frames.end()
        except Exception as exc:  # noqa: BLE001 - a bug spelling a frame: the stream says so and ends
            data, is_last, self.failed = frames.fail(exc), True, True
        if data:
            await self._send(data)
        if is_last and not self.ended.done():  # after its last frame is out: the response ends next
            self.ended.set_result(None)

    def attach(self, frames: Frames, send: Callable[[bytes], Awaitable[None]]) -> None:
        """The response's head is out: from now on the pump writes the stream with ``send``."""
        self._frames, self._send = frames, send
        self._attached.set()
        if self._give_up_at is not None:
            watchdog = asyncio.get_running_loop().call_at(self._give_up_at, self._give_up)
            self.ended.add_done_callback(lambda _: watchdog.cancel())

    def _give_up(self) -> None:
        """Past the request's deadline the stream is still being written: its client reads nothing."""
        if self.ended.done():
            return
        log.warning("request %s: its client has not read the stream since before its deadline; cutting it",
                    self._request_id)
        self.overdue = True
        self._task.cancel()
        self.ended.set_result(None)

    async def next(self, request: Request | None) -> StreamEvent | None:
        """The next event, None at the end; raises what the core raised, or ``ClientGone``.
        ``request``: watch that client while waiting (one listener for the pump's life, woken by
        the server when the client leaves: nothing is polled)."""
        if not self._queue.empty():  # tokens arrive faster than they are sent: no waiting needed
            return self._unwrap(self._queue.get_nowait())
        if request is None:
            return self._unwrap(await self._queue.get())
        gone = self.client_gone(request.receive)
        if gone.done():
            raise ClientGone()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            getter.cancel()
        if not getter.done() or getter.cancelled():
            raise ClientGone()
        return self._unwrap(getter.result())

    def client_gone(self, receive: Receive) -> asyncio.Future:
        """Done once the client has gone (its connection closed): the one reader of ``receive``
        while the request runs (the body is read by then), started on first use."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(_until_disconnect(receive))
        return self._gone

    @staticmethod
    def _unwrap(item: StreamEvent | BaseException | None) -> StreamEvent | None:
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, *, cancel: bool = True) -> None:
        """Stop reading. ``cancel``: the request is abandoned, so the core's stream is cancelled
        now; otherwise it finished and gets ``_LINGER_S`` to wind down on its own. Idempotent."""
        if self._gone is not None:  # the response is over: nobody waits for its client any more
            self._gone.cancel()
        if self._closed or self._task.done():
            return
        self._closed = True
        if cancel:
            self._task.cancel()
        else:
            asyncio.get_running_loop().call_later(_LINGER_S, self._task.cancel)


async def stop_pumps(timeout_s: float = 2.0) -> int:
    """At shutdown, before the backend closes: abandon every request still being read (its cleanup
    cancels it on every tier, which needs the backend) and wait up to ``timeout_s`` for those
    cleanups. -> how many were still running."""
    tasks = [task for task in _pumps if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
    return len(tasks)


def failure_frames(exc: BaseException, request_id: str) -> bytes:
    """A stream that failed after its first event ends with an OpenAI error event and [DONE]."""
    return sse(ErrorResponse.of_error(stream_error(exc, request_id))) + DONE


def stream_error(exc: BaseException, request_id: str) -> EPDError:
    """What a stream that failed after its first event tells its client: our errors as they are,
    anything else (a bug) as an internal error naming the request, its trace in the log."""
    if isinstance(exc, EPDError):
        return exc
    log.error("request %s failed mid-stream", request_id, exc_info=exc)
    return InternalError(f"internal server error (request {request_id})")


class EventStream(Response):
    """A streamed response (server-sent events) written by its ``CorePump``: this response only
    sends the head and hands the pump ``send``, then waits for the pump to finish the stream or for
    the client to leave (which cancels the request on every tier)."""

    media_type = "text/event-stream"

    def __init__(self, pump: CorePump, frames: Frames, headers: dict[str, str]) -> None:
        self.pump, self.frames = pump, frames
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        cancel = True  # unless the stream is written to its end
        listener = self.pump.client_gone(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            self.pump.attach(self.frames, send_body)
            await asyncio.wait({self.pump.ended, listener}, return_when=asyncio.FIRST_COMPLETED)
            pump = self.pump
            if pump.ended.done() and not pump.overdue:
                cancel = pump.failed  # after a frame it could not spell, nothing more is wanted from the core
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # the client left, the stream was cut, or the server is stopping: the request is abandoned
            self.pump.close(cancel=cancel)  # its listener too


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
