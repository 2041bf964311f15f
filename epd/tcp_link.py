"""Length-prefixed protobuf messages over one TCP connection (TLS with the cluster's certificates
when it has them): the transport of the token stream between a router and a decode worker.

Why not the gRPC stream (still there, and used when a worker offers no stream port): on one
stream every decode step is one small message, and a grpc.aio stream pays for gRPC's own I/O
threads and a hand-over to the event loop on each: ~0.13 ms of the receiver's CPU per message, most
of what a router spent per token. Read off a socket by the event loop itself it is ~0.02 ms
(``benchmarks/stream_receive.py``). The messages are the same protobufs (never pickle), a frame's
length is checked before anything is read into memory, and a connection's first frame carries the
token from the worker's health answer, so a router knows it reached that very worker.
"""
from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)
_HEADER = struct.Struct("<I")  # the message's length in bytes
# a start carries a request's token ids and a KV handle (a few MB at most); a step, a few KB: a
# longer frame is a broken or hostile peer, refused before its bytes are read
MAX_FRAME_BYTES = 64 << 20
HELLO_TIMEOUT_S = 10.0  # connect, TLS and the worker's acknowledgement of the hello


class LinkBroken(ConnectionError):
    """The connection ended inside a frame, or a frame is not the message it should be."""


def frame(message: Message) -> bytes:
    data = message.SerializeToString()
    return _HEADER.pack(len(data)) + data


async def send(writer: asyncio.StreamWriter, message: Message) -> None:
    """One message out, waiting while the peer's buffer is full (a slow reader holds only its own
    link). A closed link is a ``ConnectionResetError`` (uvloop would raise RuntimeError there)."""
    if writer.is_closing():
        raise ConnectionResetError("the link is closed")
    writer.write(frame(message))
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, message_type: type[M]) -> M | None:
    """The next message; None when the peer closed the connection between two. Raises
    ``LinkBroken`` (or the socket's ``ConnectionError``)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            return None
        raise LinkBroken("the connection closed inside a frame header") from None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise LinkBroken(f"a frame of {size} bytes; expected at most {MAX_FRAME_BYTES}")
    try:
        data = await reader.readexactly(size)
    except asyncio.IncompleteReadError as err:
        raise LinkBroken(f"the connection closed {len(err.partial)} bytes into a {size}-byte frame") from None
    return _parse(message_type, data, size)


class FrameReader:
    """Whole messages out of bytes as they come off a socket (a protocol's ``data_received``,
    where no task wakes to read them): a partial frame waits for the rest, and a frame's length is
    checked before its bytes are kept."""

    def __init__(self, message_type: type[M]) -> None:
        self._type = message_type
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[M]:
        """-> every message completed by ``data``; raises ``LinkBroken``."""
        if not self._buffer and len(data) >= _HEADER.size:  # the common case: exactly one frame
            (size,) = _HEADER.unpack_from(data)
            if len(data) == _HEADER.size + size and size <= MAX_FRAME_BYTES:
                return [_parse(self._type, memoryview(data)[_HEADER.size:], size)]
        buffer = self._buffer
        buffer += data
        messages, at = [], 0
        while len(buffer) - at >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, at)
            if size > MAX_FRAME_BYTES:
                raise LinkBroken(f"a frame of {size} bytes; expected at most {MAX_FRAME_BYTES}")
            start = at + _HEADER.size
            if len(buffer) - start < size:
                break
            messages.append(_parse(self._type, bytes(buffer[start:start + size]), size))
            at = start + size
        del buffer[:at]
        return messages


def _parse(message_type: type[M], data, size: int) -> M:
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise LinkBroken(f"a {size}-byte frame that is not a {message_type.__name__}") from None


def split_host(address: str) -> str:
    """The host of ``host:port`` (an IPv6 address keeps no brackets: what sockets take)."""
    return address.rpartition(":")[0].strip("[]")
