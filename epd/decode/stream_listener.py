"""Where routers open their token streams to this decode worker over the TCP link
(``epd.tcp_link``): the same stream as the gRPC ``Stream`` call (``DecodeServicer.serve_stream``),
each message a length-prefixed protobuf, at a fraction of gRPC's cost per message.

A connection's first frame must be a ``hello`` with the token this worker's health answer carries
(a router that resolved the worker's address to another process learns it here, not from garbled
tokens); the worker acknowledges with an empty ``StepBatch``. An ``end`` command is the router's
half-close; a connection that drops without one aborts every request it had here, as a cancelled
gRPC stream does. With the cluster's TLS, a client needs a certificate from its CA.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import AsyncIterator

from epd.tcp_link import HELLO_TIMEOUT_S, FrameSender, LinkBroken, read_message, send
from epd.v1 import decode_pb2

log = logging.getLogger("epd.decode")
_END_DRAIN_S = 10.0  # the last frames of a stream the router ended, out before the connection closes


class StreamListener:
    def __init__(self, servicer, host: str, port: int, tls=None) -> None:
        """``servicer``: the worker's ``DecodeServicer``; ``tls``: an ``epd.wire.tls.MutualTls`` or None."""
        self.servicer, self.host, self.port, self._tls = servicer, host, port, tls
        self.token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Bind and listen (a taken port is a ``RuntimeError`` that names it) -> the port."""
        ssl = self._tls.ssl_server_context() if self._tls is not None else None
        try:
            self._server = await asyncio.start_server(
                self._handle, self.host, self.port, ssl=ssl, reuse_port=False,
                **({"ssl_handshake_timeout": HELLO_TIMEOUT_S} if ssl is not None else {}))
        except OSError as err:
            raise RuntimeError(f"decode: cannot listen for token streams on {self.host}:{self.port} "
                               f"({err.strerror or err}; taken? --stream-port picks another, 0 a free one)") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Take no new connection; the open ones get ``grace_s`` to end (a drained worker has no
        request left on them), then they are cut, which aborts what they still run."""
        if self._server is None:
            return
        self._server.close()
        if self._connections:
            await asyncio.wait(self._connections, timeout=grace_s)
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        sender = None
        try:
            if not await self._greeted(reader, writer, peer):
                return

            async def write(batch: decode_pb2.StepBatch) -> None:
                await send(writer, batch)

            if self._tls is None:  # the engine thread writes steps itself (a TLS record is the loop's to make)
                sender = FrameSender(asyncio.get_running_loop(), writer.get_extra_info("socket").fileno())
            if await self.servicer.serve_stream(_commands(reader), write, sender):
                end = decode_pb2.StepBatch(end=True)  # the router ended it: say nothing was lost
                if sender is None:
                    await send(writer, end)
                else:
                    sender.send(end)
                    await sender.drain(_END_DRAIN_S)
        except (OSError, asyncio.TimeoutError) as err:  # ConnectionError, ssl.SSLError, a timed-out socket
            log.info("token stream from %s ended: %s", peer, err or type(err).__name__)
        except asyncio.CancelledError:
            # the worker is stopping (``close``): the connection's task ends here, not cancelled, since
            # Python 3.11's stream server asks a cancelled connection task for its exception and logs
            # the CancelledError with a traceback
            log.info("token stream from %s closed: the worker is stopping", peer)
        finally:
            self._connections.discard(task)
            if sender is not None:
                sender.close()  # before the transport: its socket must not outlive the connection
            writer.transport.abort()  # what is unsent is of no use to anyone now

    async def _greeted(self, reader, writer, peer) -> bool:
        hello = await asyncio.wait_for(read_message(reader, decode_pb2.StreamCommand), HELLO_TIMEOUT_S)
        if hello is None or hello.WhichOneof("command") != "hello" \
                or not hmac.compare_digest(hello.hello.encode(), self.token.encode()):
            log.warning("token stream from %s: the first frame is not this worker's hello; closed", peer)
            return False
        await send(writer, decode_pb2.StepBatch())
        return True


async def _commands(reader: asyncio.StreamReader) -> AsyncIterator[decode_pb2.StreamCommand]:
    """The router's commands until its ``end``; a connection closed before it broke off
    (``LinkBroken``, or the socket's own ``OSError``)."""
    while (command := await read_message(reader, decode_pb2.StreamCommand)) is not None:
        if command.WhichOneof("command") == "end":
            return
        if command.WhichOneof("command") == "hello":
            raise LinkBroken("a second hello on the stream")
        yield command
    raise LinkBroken("the router closed the connection without ending the stream")
