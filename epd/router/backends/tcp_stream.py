"""The router's end of the TCP link to a decode worker (``epd.tcp_link``), with the face
``DecodeLink`` uses of a gRPC stream call: ``write``, ``done_writing``, ``cancel`` and async
iteration over ``StepBatch`` messages, plus ``read_into``: every batch handed to a function in the
event loop's own callback for the socket's data. Whatever goes wrong on the link (refused, reset,
cut, a worker that closes without being told to end, a bad frame) is the gRPC call's UNAVAILABLE,
so a lost worker is handled exactly as a lost gRPC stream: out of rotation, its requests move.

Why a protocol and not a stream reader: a reader task woken for each decode step, then reading
its header and its body through ``StreamReader``, was a fifth of the router's CPU per token on a
single stream; here a step's frame is parsed and split where the bytes arrive, and the only task
that wakes is the request's own.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import grpc

from epd.tcp_link import HELLO_TIMEOUT_S, FrameReader, LinkBroken, frame
from epd.v1 import decode_pb2

OnBatch = Callable[[decode_pb2.StepBatch], None]


class _LinkProtocol(asyncio.Protocol):
    """The socket's side: frames cut from the bytes as they come, the first one the worker's
    acknowledgement of the hello, then each batch to ``on_batch`` (kept until one is attached);
    ``ended`` is the stream's end (None: the worker's own end frame) or what broke it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.Transport | None = None
        self.hello, self.ended = loop.create_future(), loop.create_future()
        self._loop = loop
        self._frames = FrameReader(decode_pb2.StepBatch)
        self._on_batch: OnBatch | None = None
        self._early: list[decode_pb2.StepBatch] = []  # came before the reader attached
        self._paused = False
        self._drain_waiters: list[asyncio.Future] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return
        try:
            frames = self._frames.feed(data)
        except LinkBroken as err:
            self._end(err)
            return
        for batch in frames:
            try:
                self._deliver(batch)
            except Exception as err:  # noqa: BLE001 - the reader's own failure ends the stream with it
                self._end(err)
                return
            if self.ended.done():
                return

    def _deliver(self, batch: decode_pb2.StepBatch) -> None:
        if not self.hello.done():
            self.hello.set_result(None)  # the worker took our token
        elif batch.end:  # the worker's own end of the stream (after the router's): nothing was lost
            self._end(None)
        elif self._on_batch is None:
            self._early.append(batch)
        else:
            self._on_batch(batch)

    def attach(self, on_batch: OnBatch) -> None:
        early, self._early = self._early, []
        for batch in early:
            on_batch(batch)
        self._on_batch = on_batch

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.hello.done():
            self.hello.set_exception(exc or LinkBroken("the worker closed the connection at the hello "
                                                       "(another worker at that address?)"))
        self._end(exc or ConnectionResetError("the worker closed the connection"))
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the link is closed"))

    def _end(self, outcome: BaseException | None) -> None:
        if not self.ended.done():
            if outcome is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(outcome)
                self.ended.exception()  # retrieved: a link cut before any reader came logs nothing
        if outcome is not None and self.transport is not None:
            self.transport.abort()  # nothing more comes or goes on a broken link

    # flow control: a write waits while the worker's side holds more than the socket's buffers
    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def drained(self) -> None:
        if self._paused:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter


class TcpStreamCall:
    def __init__(self, host: str, port: int, token: str, tls=None) -> None:
        """Connects at once, in the background (the first write or read waits for it); ``tls``:
        an ``epd.wire.tls.MutualTls`` (the cluster's certificates) or None."""
        self._where = f"decode {host}:{port} token stream"
        self._connected = asyncio.ensure_future(self._connect(host, port, token, tls))
        self._connected.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by the reader
        self._cancelled = False

    async def _connect(self, host: str, port: int, token: str, tls) -> _LinkProtocol:
        loop = asyncio.get_running_loop()
        try:
            context = tls.ssl_client_context() if tls is not None else None
            name = tls.ssl_server_hostname(host) if tls is not None else None
            transport, link = await asyncio.wait_for(
                loop.create_connection(lambda: _LinkProtocol(loop), host, port, ssl=context, server_hostname=name),
                HELLO_TIMEOUT_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as err:
            raise self._unavailable(err) from None
        try:
            transport.write(frame(decode_pb2.StreamCommand(hello=token)))
            await asyncio.wait_for(link.hello, HELLO_TIMEOUT_S)
        except BaseException as err:  # cancelled or timed out meanwhile too: the socket goes now
            transport.abort()
            if isinstance(err, (OSError, ssl.SSLError, asyncio.TimeoutError)):
                raise self._unavailable(err) from None
            raise
        return link

    async def write(self, command: decode_pb2.StreamCommand) -> None:
        """One command out, waiting while the worker's buffers are full (a slow worker holds only
        its own link)."""
        link = await self._connected
        if self._cancelled or link.transport.is_closing():
            raise self._unavailable(ConnectionResetError("the link is closed"))
        try:
            link.transport.write(frame(command))
            await link.drained()
        except (OSError, RuntimeError) as err:
            raise self._unavailable(err) from None

    async def done_writing(self) -> None:
        await self.write(decode_pb2.StreamCommand(end=True))

    def cancel(self) -> None:
        """Cut the link now (the reader ends with ``CancelledError``, as a cancelled gRPC call's
        does): an abort, not a close, which would wait for a wedged worker to take what is unsent
        or to answer TLS's goodbye."""
        self._cancelled = True
        if not self._connected.done():
            self._connected.cancel()
        elif not self._connected.cancelled() and self._connected.exception() is None:
            self._connected.result().transport.abort()

    async def read_into(self, on_batch: OnBatch) -> None:
        """Hand every batch to ``on_batch`` as it arrives, until the worker's end (returns), a cut
        (``CancelledError``) or a loss (UNAVAILABLE); what ``on_batch`` raises ends the stream and
        is raised here."""
        link = await self._connected
        try:
            link.attach(on_batch)
            await link.ended
        except (OSError, ssl.SSLError) as err:
            if self._cancelled:
                raise asyncio.CancelledError from None
            raise self._unavailable(err) from None
        finally:
            link.transport.abort()  # however it ended, nothing more comes or goes on this socket
        if self._cancelled:
            raise asyncio.CancelledError

    def __aiter__(self):
        return self._batches()

    async def _batches(self):
        """The gRPC call's face (``async for``): the batches through a queue."""
        queue: asyncio.Queue = asyncio.Queue()
        reading = asyncio.ensure_future(self.read_into(queue.put_nowait))
        reading.add_done_callback(lambda task: queue.put_nowait(None) or task.cancelled() or task.exception())
        try:
            while (batch := await queue.get()) is not None:
                yield batch
            await reading  # the end, or what ended it
        finally:
            reading.cancel()

    def _unavailable(self, err: BaseException) -> grpc.aio.AioRpcError:
        what = str(err) or type(err).__name__
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details=f"{self._where}: {what}")
