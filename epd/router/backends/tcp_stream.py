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

from epd.tcp_link import HELLO_TIMEOUT_S, LinkBroken, frame, read_message
from epd.v1 import decode_pb2


class TcpStreamCall:
    def __init__(self, host: str, port: int, token: str, tls=None) -> None:
        """Connects at once, in the background (the first write or read waits for it); ``tls``:
        an ``epd.tls.MutualTls`` (the cluster's certificates) or None."""
        self._where = f"decode {host}:{port} token stream"
        self._connected = asyncio.ensure_future(self._connect(host, port, token, tls))
        self._connected.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by the reader
        self._ended = False  # the router said ``end``: the worker closing is the stream's normal end
        self._cancelled = False

    async def _connect(self, host: str, port: int, token: str, tls):
        try:
            context = tls.ssl_client_context() if tls is not None else None
            name = tls.ssl_server_hostname(host) if tls is not None else None
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=context, server_hostname=name), HELLO_TIMEOUT_S)
            writer.write(frame(decode_pb2.StreamCommand(hello=token)))
            if await asyncio.wait_for(read_message(reader, decode_pb2.StepBatch), HELLO_TIMEOUT_S) is None:
                writer.close()
                raise LinkBroken("the worker closed the connection at the hello (another worker at that address?)")
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as err:
            raise self._unavailable(err) from None
        return reader, writer

    async def write(self, command: decode_pb2.StreamCommand) -> None:
        _, writer = await self._connected
        try:
            writer.write(frame(command))
            await writer.drain()
        except OSError as err:
            raise self._unavailable(err) from None

    async def done_writing(self) -> None:
        self._ended = True
        await self.write(decode_pb2.StreamCommand(end=True))

    def cancel(self) -> None:
        """Cut the link (the reader ends with ``CancelledError``, as a cancelled gRPC call's does)."""
        self._cancelled = True
        if not self._connected.done():
            self._connected.cancel()
        elif not self._connected.cancelled() and self._connected.exception() is None:
            self._connected.result()[1].close()

    def __aiter__(self):
        return self._batches()

    async def _batches(self):
        reader, _ = await self._connected
        while True:
            try:
                batch = await read_message(reader, decode_pb2.StepBatch)
            except OSError as err:
                if self._cancelled:
                    raise asyncio.CancelledError from None
                raise self._unavailable(err) from None
            if batch is None:
                if self._cancelled:
                    raise asyncio.CancelledError
                if self._ended:
                    return
                raise self._unavailable(ConnectionResetError("the worker closed the connection"))
            yield batch

    def _unavailable(self, err: BaseException) -> grpc.aio.AioRpcError:
        what = str(err) or type(err).__name__
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details=f"{self._where}: {what}")
