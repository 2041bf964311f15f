"""The router's side of the per-step stream to one decode worker: every request the router has on
that worker shares one long-lived ``Stream`` call. Starts and cancels go out on it; one
``StepBatch`` per engine step comes back and is split by request id into each request's own
``StepChannel``, where its tokens wait for its reader. A reader that falls behind (a slow client)
gets what piled up in one piece; it holds up nobody else.

The stream runs on the worker's TCP link (``epd.tcp_link``) when its health offers one, else on
the gRPC ``Stream`` call; both carry the same messages and end the same ways.

Losing the stream (the worker died, restarted, or left rotation) ends every request on it with the
error, and each moves on as before; the next request opens a new stream.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import grpc

from epd.errors import EPDError, UpstreamError
from epd.router.backends.base import BackendOutput
from epd.router.backends.moves import WorkerLost, lost_message
from epd.router.backends.tcp_stream import TcpStreamCall
from epd.router.workers import WorkerState
from epd.tcp_link import split_host
from epd.v1 import decode_pb2
from epd.wire.protocol import logprobs_from_proto

log = logging.getLogger("epd.router")


class StepError(Exception):
    """The decode worker failed this request alone (``RequestStep.error_status``)."""

    def __init__(self, step: decode_pb2.RequestStep) -> None:
        super().__init__(step.error_message)
        self.status = grpc.StatusCode[step.error_status] if step.error_status in grpc.StatusCode.__members__ \
            else grpc.StatusCode.INTERNAL
        self.message = step.error_message
        self.retry_after_s = step.retry_after_ms / 1000 if step.retry_after_ms else None


class StepChannel:
    """One request's tokens as they come off the stream: a step's plain token as an int, any other
    step as its ``RequestStep``, or the error that ended the stream.

    ``wake_every`` (``--stream-interval``): a waiting reader is woken once that many tokens came
    since it last read, or at once by a finish, an error or the stream's end; the tokens between
    wait here without waking anyone (the pipeline's ``TokenGroups`` would hold them anyway)."""

    def __init__(self, wake_every: int = 1) -> None:
        self._steps: collections.deque = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits (a bare future:
        # an asyncio.Event asks for the running loop on each wait, a getpid() system call in 3.11)
        self._wake_every = wake_every
        self._num_unread = 0  # tokens pushed since the reader last read (with wake_every > 1)

    def push(self, item: int | decode_pb2.RequestStep | BaseException) -> None:
        self._steps.append(item)
        if self._wake_every > 1 and not self._due(item):
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _due(self, item: int | decode_pb2.RequestStep | BaseException) -> bool:
        """Whether the reader should hear of what came, ``item`` the last of it."""
        if _ends(item):
            return True
        self._num_unread += 1 if type(item) is int else len(item.token_ids)
        return self._num_unread >= self._wake_every

    def _due_now(self) -> bool:
        """What waits here is due (read when the reader comes back before the push that woke it)."""
        return self._num_unread >= self._wake_every or _ends(self._steps[-1])

    async def next(self) -> BackendOutput:
        """Everything that came since the last call, as one output (its finish, if it came);
        raises the request's error (a ``StepError``) or the stream's (an ``EPDError``) once the
        tokens before it are out."""
        while not self._steps or (self._wake_every > 1 and not self._due_now()):
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._num_unread = 0
        if len(self._steps) == 1:  # the reader keeps up: one step, as it came (the common case)
            if type(step := self._steps[0]) is int:
                self._steps.clear()
                return BackendOutput([step], [], None)
            if not isinstance(step, BaseException) and not step.error_status:
                self._steps.clear()
                return BackendOutput(list(step.token_ids), [logprobs_from_proto(lp) for lp in step.logprobs] if
                                     step.logprobs else [], step.finish_reason or None)
        token_ids, logprobs, finish = [], [], None
        while self._steps and not isinstance(self._steps[0], BaseException):
            step = self._steps.popleft()
            if type(step) is int:
                token_ids.append(step)
                continue
            if step.error_status:
                if token_ids:  # its tokens first; the error on the next call
                    self._steps.appendleft(StepError(step))
                    break
                raise StepError(step)
            token_ids.extend(step.token_ids)
            logprobs.extend(logprobs_from_proto(lp) for lp in step.logprobs)
            finish = step.finish_reason or None
        if not token_ids and finish is None:
            raise self._steps.popleft()
        return BackendOutput(token_ids, logprobs, finish)


def _ends(item: int | decode_pb2.RequestStep | BaseException) -> bool:
    """The request's last item: its finish, its error, or the stream's."""
    return type(item) is not int and (isinstance(item, BaseException) or bool(item.finish_reason or item.error_status))


class DecodeLink:
    """The stream to one decode worker. ``map_error`` turns the stream's gRPC failure into the
    error its requests end with (the backend's: it also takes a dead worker out of rotation)."""

    def __init__(self, worker: WorkerState, map_error: Callable[[grpc.aio.AioRpcError], EPDError], *,
                 over_tcp: bool = True, wake_every: int = 1) -> None:
        """``over_tcp``: on the worker's TCP link when its health offers one (else the gRPC call);
        ``wake_every``: each request's reader woken every that many tokens (``StepChannel``)."""
        self.worker, self._map_error, self.over_tcp = worker, map_error, over_tcp
        self._wake_every = wake_every
        self.channels: dict[str, StepChannel] = {}
        self.num_batches = 0  # messages received: one per engine step of the worker, whatever the requests
        self.num_column_tokens = 0  # tokens that came in the messages' columns (the plain ones)
        self._call = None
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._lost = False
        self._forget_outage: Callable[[], object] = lambda: None

    def start(self, request: decode_pb2.GenerateRequest, timeout_s: float) -> StepChannel:
        """Start ``request`` on the stream (opened if it is not); -> where its tokens come."""
        if self._call is None:
            self._open()
        channel = self.channels[request.request.request_id] = StepChannel(self._wake_every)
        self._outbox.put_nowait(decode_pb2.StreamCommand(start=request, timeout_ms=max(1, round(timeout_s * 1000)),
                                                         token_columns=True, stream_interval=self._wake_every))
        return channel

    def cancel(self, request_id: str) -> None:
        """Forget the request and tell the worker to abort it (no wait: callable while cancelled)."""
        if self.channels.pop(request_id, None) is not None and self._call is not None:
            self._outbox.put_nowait(decode_pb2.StreamCommand(cancel=request_id))

    async def close(self, timeout_s: float = 2.0) -> None:
        """End the stream: half-closed, so the worker ends it once its requests have (it aborts
        them if the router still had any), then cancelled if that takes longer than ``timeout_s``."""
        if self._call is not None:
            self._outbox.put_nowait(None)
            await asyncio.wait(self._tasks, timeout=timeout_s)
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open(self) -> None:
        health = self.worker.last_health
        if self.over_tcp and health.stream_port:  # the TCP link the worker offers: far cheaper per message
            self._call = TcpStreamCall(split_host(self.worker.address), health.stream_port, health.stream_token,
                                       self.worker.tls)
        else:
            self._call = self.worker.stub.Stream()
        self._outbox, self._lost = asyncio.Queue(), False
        outage = self.worker.outage()  # a wedged worker keeps the stream open: leaving rotation ends it
        on_outage = lambda _, call=self._call: self._on_outage(call)  # noqa: E731
        outage.add_done_callback(on_outage)
        self._forget_outage = lambda: outage.remove_done_callback(on_outage)
        self._tasks = [asyncio.create_task(self._write(self._call, self._outbox)),
                       asyncio.create_task(self._read(self._call))]

    def _on_outage(self, call) -> None:
        if call is self._call:
            self._lost = True
            call.cancel()

    @staticmethod
    async def _write(call, outbox: asyncio.Queue) -> None:
        """Commands in order (one write at a time, as gRPC wants); None: no more, half-close."""
        try:
            while (command := await outbox.get()) is not None:
                await call.write(command)
            await call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, OSError):
            pass  # the stream is gone: its reader ends every request with the reason

    async def _read(self, call) -> None:
        """Split each batch by request; however the stream ends, every request still on it ends
        with the reason (the next request opens a new stream)."""
        error: BaseException = UpstreamError(f"decode {self.worker.address} ended the stream")
        try:
            if isinstance(call, TcpStreamCall):  # split where the bytes arrive: no task of ours wakes for them
                await call.read_into(self._split)
            else:
                async for batch in call:
                    self._split(batch)
        except grpc.aio.AioRpcError as err:
            error = self._map_error(err)
        except asyncio.CancelledError:
            error = WorkerLost(lost_message(self.worker)) if self._lost else \
                UpstreamError(f"decode {self.worker.address}: the router closed the stream")
            if not self._lost:
                raise
        except Exception as err:  # noqa: BLE001 - a broken message or a bug: the stream is of no more use
            log.exception("decode %s: reading the stream failed", self.worker.address)
            error = UpstreamError(f"decode {self.worker.address}: the stream failed: {type(err).__name__}: {err}")
            call.cancel()
        finally:
            self._end(call, error)

    def _split(self, batch: decode_pb2.StepBatch) -> None:
        """One step's batch into its requests' channels."""
        self.num_batches += 1
        channels = self.channels
        if batch.token_request_ids:  # the step's plain tokens: one each, nothing else
            self.num_column_tokens += len(batch.token_request_ids)
            for request_id, token in zip(batch.token_request_ids, batch.tokens):
                if (channel := channels.get(request_id)) is not None:
                    channel.push(token)
        for step in batch.requests:
            if (channel := channels.get(step.request_id)) is not None:
                channel.push(step)
                if step.finish_reason or step.error_status:
                    del channels[step.request_id]

    def _end(self, call, error: BaseException) -> None:
        if call is not self._call:
            return
        self._call = None
        self._forget_outage()  # a worker that stays in rotation keeps no callback per ended stream
        self._tasks[0].cancel()  # the writer: nothing more goes out on this stream
        channels, self.channels = self.channels, {}
        for channel in channels.values():
            channel.push(error)
        if channels:
            log.warning("decode %s: the stream ended with %d request(s) on it: %s", self.worker.address,
                        len(channels), error)
