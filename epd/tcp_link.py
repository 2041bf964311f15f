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
import collections
import os
import socket
import struct
import threading
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)
_HEADER = struct.Struct("<I")  # the message's length in bytes
# a start carries a request's token ids and a KV handle (a few MB at most); a step, a few KB: a
# longer frame is a broken or hostile peer, refused before its bytes are read
MAX_FRAME_BYTES = 64 << 20
HELLO_TIMEOUT_S = 10.0  # connect, TLS and the worker's acknowledgement of the hello
_DRAIN_POLL_S = 0.005


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


class FrameSender:
    """The frames going out on one plain (not TLS) connection, written from the event loop and from
    one other thread (a decode worker's engine thread, which sends a step's tokens the moment the
    step is done instead of waking the loop to do it), in the order their calls took its lock.

    It writes to its own duplicate of the socket, so a frame is never written to a descriptor the
    loop closed and reused: bytes the socket does not take at once wait in order and the loop
    writes them when it can (``add_writer``); until they are out, ``try_send`` declines, so nothing
    overtakes them. ``owe`` / ``paid`` bracket a frame the other thread handed to the loop: while
    one is owed, ``try_send`` declines too. The asyncio transport of the connection still reads it
    and must write nothing once this exists."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fileno: int) -> None:
        self._loop = loop
        self._sock = socket.socket(fileno=os.dup(fileno))
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self._pending: collections.deque[memoryview] = collections.deque()
        self._owed = 0
        self._watching = False  # the loop waits for the socket to take more
        self._closed = False
        self._error: OSError | None = None

    def send(self, message: Message) -> None:
        """``message`` out now or, if the socket is full, as soon as it takes it (never blocks).
        Raises the ``OSError`` that broke the connection, or ``ConnectionResetError`` once closed."""
        data = frame(message)
        with self._lock:
            if self._closed or self._error is not None:
                raise self._error or ConnectionResetError("the link is closed")
            self._write_locked(data)
            if self._error is not None:
                raise self._error

    def try_send(self, data: bytes) -> bool:
        """From the other thread: ``data`` (a whole frame) out now, or False when it must go through
        the loop (a frame is owed or waiting, the link is closed or broken)."""
        with self._lock:
            if self._owed or self._pending or self._closed or self._error is not None:
                return False
            self._write_locked(data)
            return self._error is None

    def owe(self) -> None:
        with self._lock:
            self._owed += 1

    def paid(self) -> None:
        with self._lock:
            self._owed -= 1

    async def drain(self, timeout_s: float) -> bool:
        """(loop) Wait until every frame is written -> whether they were, within ``timeout_s``
        (called once, as the link ends: a short poll rather than a wake-up on every write)."""
        deadline_s = self._loop.time() + timeout_s
        while self._pending and self._error is None and not self._closed and self._loop.time() < deadline_s:
            await asyncio.sleep(_DRAIN_POLL_S)
        return not self._pending and self._error is None and not self._closed

    def close(self) -> None:
        """(loop) Nothing more goes out; what waits is dropped. Call before the transport closes."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            if self._watching:
                self._loop.remove_writer(self._sock.fileno())
                self._watching = False
            self._sock.close()

    def _write_locked(self, data: bytes) -> None:
        if not self._pending:
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as err:
                self._error = err
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        self._pending.append(memoryview(data))
        if not self._watching:
            self._watching = True
            self._loop.call_soon_threadsafe(self._watch)

    def _watch(self) -> None:
        with self._lock:
            if self._watching and not self._closed:
                self._loop.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:
        with self._lock:
            pending = self._pending
            while pending:
                try:
                    sent = self._sock.send(pending[0])
                except BlockingIOError:
                    return
                except OSError as err:
                    self._error = err
                    pending.clear()
                    break
                if sent < len(pending[0]):
                    pending[0] = pending[0][sent:]
                    return
                pending.popleft()
            self._loop.remove_writer(self._sock.fileno())
            self._watching = False


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
