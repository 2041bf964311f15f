"""The TCP link between a router and a decode worker (epd.tcp_link), in-process on 127.0.0.1: the
worker's listener and the router's call with a stand-in for the decode servicer. What a stream
must keep from the gRPC call: commands in order, the router's end as the normal end, a cut
connection aborting the worker's side and reading as UNAVAILABLE on the router's; and what a
listener must refuse (a stranger's hello, an oversized or broken frame) without going down."""
from __future__ import annotations

import asyncio
import struct

import grpc
import pytest

from epd.decode.stream_listener import StreamListener
from epd.router.backends.tcp_stream import TcpStreamCall
from epd.tcp_link import MAX_FRAME_BYTES, FrameReader, LinkBroken, frame, read_message
from epd.v1 import decode_pb2


class _Servicer:
    """Echoes each cancel command back as a one-step batch, and records how its commands ended."""

    def __init__(self) -> None:
        self.commands: list[decode_pb2.StreamCommand] = []
        self.ended: list[str] = []

    async def serve_stream(self, commands, write, sender=None) -> None:
        try:
            async for command in commands:
                self.commands.append(command)
                batch = decode_pb2.StepBatch(requests=[decode_pb2.RequestStep(request_id=command.cancel, token_ids=[7])])
                if sender is None:  # over TLS
                    await write(batch)
                else:
                    sender.send(batch)
            self.ended.append("end")
            return True
        except ConnectionError as err:
            self.ended.append(f"broken: {err}")
            return False


async def _listening(servicer) -> StreamListener:
    listener = StreamListener(servicer, "127.0.0.1", 0)
    await listener.start()
    return listener


async def _eventually(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not within the time")


def test_a_stream_carries_commands_and_batches_and_ends_when_the_router_says_so():
    async def run():
        servicer = _Servicer()
        listener = await _listening(servicer)
        call = TcpStreamCall("127.0.0.1", listener.port, listener.token)
        for request_id in ("a", "b"):
            await call.write(decode_pb2.StreamCommand(cancel=request_id))
        received = []
        async for batch in call:
            received.append(batch.requests[0].request_id)
            if len(received) == 2:
                await call.done_writing()
        await _eventually(lambda: servicer.ended)
        await listener.stop(1.0)
        return received, servicer

    received, servicer = asyncio.run(run())
    assert received == ["a", "b"]
    assert [c.cancel for c in servicer.commands] == ["a", "b"] and servicer.ended == ["end"]


def test_a_cut_connection_breaks_off_the_workers_side_and_is_unavailable_on_the_routers():
    async def run():
        servicer = _Servicer()
        listener = await _listening(servicer)
        router_cut = TcpStreamCall("127.0.0.1", listener.port, listener.token)
        await router_cut.write(decode_pb2.StreamCommand(cancel="a"))
        router_cut.cancel()  # the router let go without an end: the worker must abort what it had
        with pytest.raises(asyncio.CancelledError):
            async for _ in router_cut:
                pass
        await _eventually(lambda: servicer.ended)
        worker_gone = TcpStreamCall("127.0.0.1", listener.port, listener.token)
        await worker_gone.write(decode_pb2.StreamCommand(cancel="b"))
        batches = aiter(worker_gone)
        first = await anext(batches)
        await listener.stop(0.0)  # the worker goes while the stream is open
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await anext(batches)
        refused = TcpStreamCall("127.0.0.1", listener.port, listener.token)  # nobody listens any more
        with pytest.raises(grpc.aio.AioRpcError) as nobody:
            await refused.write(decode_pb2.StreamCommand(cancel="c"))
        return servicer, first, lost.value, nobody.value

    servicer, first, lost, nobody = asyncio.run(run())
    assert servicer.ended[0].startswith("broken:") and "without ending" in servicer.ended[0]
    assert first.requests[0].request_id == "b"
    assert lost.code() == grpc.StatusCode.UNAVAILABLE and "token stream" in lost.details()
    assert nobody.code() == grpc.StatusCode.UNAVAILABLE


def test_the_listener_refuses_a_strangers_hello_and_broken_frames_and_keeps_serving():
    async def raw(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        try:
            return await asyncio.wait_for(reader.read(), 5)  # what the worker answers before it closes
        finally:
            writer.close()

    async def run():
        servicer = _Servicer()
        listener = await _listening(servicer)
        answers = {
            "wrong token": await raw(listener.port, frame(decode_pb2.StreamCommand(hello="not-the-token"))),
            "no hello first": await raw(listener.port, frame(decode_pb2.StreamCommand(cancel="a"))),
            "oversized frame": await raw(listener.port, struct.pack("<I", MAX_FRAME_BYTES + 1)),
            "not protobuf": await raw(listener.port, struct.pack("<I", 3) + b"\xff\xff\xff"),
        }
        wrong_token = TcpStreamCall("127.0.0.1", listener.port, "another-workers-token")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wrong_token.write(decode_pb2.StreamCommand(cancel="x"))
        good = TcpStreamCall("127.0.0.1", listener.port, listener.token)  # the worker still serves
        await good.write(decode_pb2.StreamCommand(cancel="ok"))
        batch = await anext(aiter(good))
        await good.done_writing()
        await listener.stop(1.0)
        return answers, refused.value, batch, servicer

    answers, refused, batch, servicer = asyncio.run(run())
    assert answers == {what: b"" for what in answers}  # closed, and nothing said to a stranger
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "another worker" in refused.details()
    assert batch.requests[0].request_id == "ok" and [c.cancel for c in servicer.commands] == ["ok"]


def test_a_frame_is_read_whole_or_the_link_is_broken():
    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_message(reader, decode_pb2.StepBatch)

    batch = decode_pb2.StepBatch(requests=[decode_pb2.RequestStep(request_id="r", token_ids=[1, 2])])
    assert asyncio.run(read(frame(batch))) == batch
    assert asyncio.run(read(b"")) is None  # closed between messages: the stream's end
    for broken, why in ((frame(batch)[:-1], "bytes into"), (b"\x01\x00", "header"),
                        (struct.pack("<I", MAX_FRAME_BYTES + 1), "at most")):
        with pytest.raises(LinkBroken, match=why):
            asyncio.run(read(broken))


def test_frames_are_cut_from_bytes_however_they_arrive_or_the_link_is_broken():
    """The router's link reads in its protocol's callback: a frame split over several reads, or
    several in one read, comes out whole and in order; a bad one is refused before it is kept."""
    batches = [decode_pb2.StepBatch(token_request_ids=[f"r{i}"], tokens=[i]) for i in range(3)]
    data = b"".join(frame(b) for b in batches)
    assert FrameReader(decode_pb2.StepBatch).feed(frame(batches[0])) == batches[:1]  # one read, one frame
    for cut in (1, 3, 4, 5, len(frame(batches[0])), len(data) - 1):
        reader = FrameReader(decode_pb2.StepBatch)
        assert reader.feed(data[:cut]) + reader.feed(data[cut:]) == batches, cut
    byte_by_byte = FrameReader(decode_pb2.StepBatch)
    assert [m for i in range(len(data)) for m in byte_by_byte.feed(data[i:i + 1])] == batches
    for broken, why in ((struct.pack("<I", MAX_FRAME_BYTES + 1), "at most"),
                        (struct.pack("<I", 3) + b"\xff\xff\xff", "not a StepBatch")):
        with pytest.raises(LinkBroken, match=why):
            FrameReader(decode_pb2.StepBatch).feed(broken)


def test_what_the_reader_raises_ends_the_stream_with_it_and_cuts_the_socket():
    async def run():
        servicer = _Servicer()
        listener = await _listening(servicer)
        call = TcpStreamCall("127.0.0.1", listener.port, listener.token)
        seen = []

        def on_batch(batch):
            seen.append(batch.requests[0].request_id)
            if len(seen) == 2:
                raise KeyError("a bug of the reader's")

        for request_id in ("a", "b", "c"):
            await call.write(decode_pb2.StreamCommand(cancel=request_id))
        with pytest.raises(KeyError, match="a bug"):
            await asyncio.wait_for(call.read_into(on_batch), 5)
        await _eventually(lambda: servicer.ended)
        await listener.stop(1.0)
        return seen, servicer.ended

    seen, ended = asyncio.run(run())
    assert seen == ["a", "b"]  # nothing after the failure reached it
    assert ended[0].startswith("broken:")  # the worker saw the link cut, not an end


def test_a_taken_stream_port_is_an_error_that_names_it():
    async def run():
        first = await _listening(_Servicer())
        second = StreamListener(_Servicer(), "127.0.0.1", first.port)
        try:
            with pytest.raises(RuntimeError, match=f"127.0.0.1:{first.port}.*taken"):
                await second.start()
        finally:
            await first.stop(0.0)

    asyncio.run(run())


def test_a_cut_is_immediate_even_to_a_wedged_worker_and_a_hello_cut_short_leaves_no_socket():
    """A worker that stopped reading (wedged, partitioned) must not hold the router's reader when
    the router cuts the link (its requests move then), nor keep a socket whose hello never got an
    answer; and a worker that closes without its own end frame, even after the router's end, was
    lost, not done."""
    async def run():
        seen_eof = asyncio.Event()

        async def wedged(reader, writer):  # acknowledges the hello, then never reads again
            await read_message(reader, decode_pb2.StreamCommand)
            writer.write(frame(decode_pb2.StepBatch()))
            await asyncio.sleep(30)

        async def silent(reader, writer):  # never answers the hello; notes when the router lets go
            try:
                await reader.read()
            except ConnectionError:  # the router aborted: a reset, not an end of file
                pass
            seen_eof.set()

        async def closes_at_end(reader, writer):  # acknowledges, reads until the end, closes without its frame
            await read_message(reader, decode_pb2.StreamCommand)
            writer.write(frame(decode_pb2.StepBatch()))
            while not (await read_message(reader, decode_pb2.StreamCommand)).end:
                pass
            writer.close()

        servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (wedged, silent, closes_at_end)]
        port = [srv.sockets[0].getsockname()[1] for srv in servers]
        try:
            call = TcpStreamCall("127.0.0.1", port[0], "t")
            reading = asyncio.ensure_future(anext(aiter(call)))
            big = decode_pb2.StreamCommand(cancel="x" * (8 << 20))  # more than the socket buffers take
            writing = asyncio.ensure_future(call.write(big))
            await asyncio.sleep(0.3)
            started = asyncio.get_running_loop().time()
            call.cancel()
            done, _ = await asyncio.wait({reading}, timeout=5)
            cut_s = asyncio.get_running_loop().time() - started
            writing.cancel()
            reader_cancelled = bool(done) and reading.cancelled()

            hello = TcpStreamCall("127.0.0.1", port[1], "t")
            await asyncio.sleep(0.2)
            hello.cancel()
            await asyncio.wait_for(seen_eof.wait(), 5)

            ended = TcpStreamCall("127.0.0.1", port[2], "t")
            await ended.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                async for _ in ended:
                    pass
            return reader_cancelled, cut_s, lost.value
        finally:
            for srv in servers:
                srv.close()

    reader_cancelled, cut_s, lost = asyncio.run(run())
    assert reader_cancelled and cut_s < 1.0, cut_s
    assert lost.code() == grpc.StatusCode.UNAVAILABLE


def _connected_pair():
    """A TCP connection on 127.0.0.1 whose sending side takes little before it is full."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.setblocking(False)
    return client, accepted


def _read_frames(sock, count: int, timeout_s: float = 10.0) -> list:
    sock.settimeout(timeout_s)
    reader, out = FrameReader(decode_pb2.StepBatch), []
    while len(out) < count:
        data = sock.recv(1 << 16)
        if not data:
            break
        out += reader.feed(data)
    return out


def test_frames_from_the_engine_thread_and_the_loop_leave_in_order_whatever_the_socket_takes():
    """The engine thread sends steps itself (``try_send``) and hands a step to the loop where it
    must (``owe``, then the loop's ``send`` and ``paid``), as a decode worker does with a first
    token: with a socket far smaller than what goes through, every frame arrives whole, once, in
    the order of the steps, and nothing overtook a frame still waiting or a step still owed."""
    import threading

    from epd.tcp_link import FrameSender

    client, peer = _connected_pair()
    num_frames, pad = 300, "p" * 3000  # ~900 KB through a socket that takes a few KB at a time
    declined = []

    async def run():
        loop = asyncio.get_running_loop()
        sender = FrameSender(loop, client.fileno())

        def by_loop(batch):
            try:
                sender.send(batch)
            finally:
                sender.paid()

        def engine_thread():
            for i in range(num_frames):
                batch = decode_pb2.StepBatch(token_request_ids=[pad], tokens=[i])
                if i % 7 == 0 or not sender.try_send(frame(batch)):  # every 7th: a step only the loop may send
                    declined.append(i)
                    sender.owe()
                    loop.call_soon_threadsafe(by_loop, batch)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join)  # the router reads nothing meanwhile: the socket fills
        received = await asyncio.to_thread(_read_frames, peer, num_frames)
        drained = await sender.drain(5.0)
        sender.close()
        return received, drained

    received, drained = asyncio.run(run())
    client.close()
    peer.close()
    assert [b.tokens[0] for b in received] == list(range(num_frames)) and drained
    # the socket filled: the thread was turned away while frames waited, not only on the 7th steps
    assert len(declined) > num_frames // 7 + 1


def test_a_closed_or_broken_sender_sends_nothing_and_keeps_no_socket():
    import os

    from epd.tcp_link import FrameSender

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def run():
        client, peer = _connected_pair()
        before = open_fds()
        sender = FrameSender(asyncio.get_running_loop(), client.fileno())
        assert open_fds() == before + 1  # its own duplicate of the socket
        sender.send(decode_pb2.StepBatch(tokens=[1]))
        sender.close()
        closed = (open_fds() == before, sender.try_send(frame(decode_pb2.StepBatch(tokens=[2]))))
        with pytest.raises(ConnectionResetError):
            sender.send(decode_pb2.StepBatch(tokens=[3]))
        got = _read_frames(peer, 1)
        client.close()
        peer.close()

        client, peer = _connected_pair()
        sender = FrameSender(asyncio.get_running_loop(), client.fileno())
        peer.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # a reset: the router is gone
        await asyncio.sleep(0.05)
        with pytest.raises(OSError):
            for _ in range(100):  # the first write after a reset may still be taken by the kernel
                sender.send(decode_pb2.StepBatch(tokens=[4]))
        broken = sender.try_send(frame(decode_pb2.StepBatch(tokens=[5])))
        sender.close()
        client.close()
        return closed, got, broken

    (fds_back, after_close), got, after_break = asyncio.run(run())
    assert fds_back and after_close is False and [b.tokens[0] for b in got] == [1]
    assert after_break is False
