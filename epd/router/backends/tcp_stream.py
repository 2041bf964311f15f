"""The router's end of the TCP link to a decode worker (``epd.tcp_link``), with the face
``DecodeLink`` uses of a gRPC stream call: ``write``, ``done_writing``, ``cancel`` and async
iteration over ``StepBatch`` messages. Whatever goes wrong on the link (refused, reset, cut, a
worker that closes without being told to end, a bad frame) is the gRPC call's UNAVAILABLE, so a
lost worker is handled exactly as a lost gRPC stream: out of rotation, its requests move.
"""
from __future__ import annotations

import asyncio
import ssl

import grpc

from epd.tcp_link import HELLO_TIMEOUT_S, LinkBroken, frame, read_message, send
from epd.v1 import decode_pb2


class TcpStreamCall:
    def __init__(self, host: str, port: int, token: str, tls=None) -> None:
        """Connects at once, in the background (the first write or read waits for it); ``tls``:
        an ``epd.wire.tls.MutualTls`` (the cluster's certificates) or None."""
        self._where = f"decode {host}:{port} token stream"
        self._connected = asyncio.ensure_future(self._connect(host, port, token, tls))
        self._connected.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by the reader
        self._cancelled = False

    async def _connect(self, host: str, port: int, token: str, tls):
        try:
            context = tls.ssl_client_context() if tls is not None else None
            name = tls.ssl_server_hostname(host) if tls is not None else None
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=context, server_hostname=name), HELLO_TIMEOUT_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as err:
            raise self._unavailable(err) from None
        try:
            writer.write(frame(decode_pb2.StreamCommand(hello=token)))
            if await asyncio.wait_for(read_message(reader, decode_pb2.StepBatch), HELLO_TIMEOUT_S) is None:
                raise LinkBroken("the worker closed the connection at the hello (another worker at that address?)")
        except BaseException as err:  # cancelled or timed out meanwhile too: the socket goes now
            writer.transport.abort()
            if isinstance(err, (OSError, ssl.SSLError, asyncio.TimeoutError)):
                raise self._unavailable(err) from None
            raise
        return reader, writer

    async def write(self, command: decode_pb2.StreamCommand) -> None:
        _, writer = await self._connected
        if self._cancelled:
            raise self._unavailable(ConnectionResetError("the link is closed"))
        try:
            await send(writer, command)
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
            self._connected.result()[1].transport.abort()

    def __aiter__(self):
        return self._batches()

    async def _batches(self):
        reader, writer = await self._connected
        try:
            while True:
                try:
                    batch = await read_message(reader, decode_pb2.StepBatch)
                except (OSError, ssl.SSLError) as err:
                    if self._cancelled:
                        raise asyncio.CancelledError from None
                    raise self._unavailable(err) from None
                if self._cancelled:
                    raise asyncio.CancelledError
                if batch is None:
                    raise self._unavailable(ConnectionResetError("the worker closed the connection"))
                if batch.end:  # the worker's own end of the stream (after the router's): nothing was lost
                    return
                yield batch
        finally:
            writer.transport.abort()  # however it ended, nothing more comes or goes on this socket

    def _unavailable(self, err: BaseException) -> grpc.aio.AioRpcError:
        what = str(err) or type(err).__name__
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details=f"{self._where}: {what}")
