"""What receiving one small message costs a router at a low rate: the floor under the router's CPU
per token on a single stream, where every decode step is one message and nothing is amortized.

A sender in another process writes N decode ``StepBatch`` messages of one token, 1 ms apart (a
single stream at ~1,000 tokens/s), over (a) a grpc.aio bidirectional stream (the decode link where
a worker offers no TCP port), (b) a plain asyncio TCP connection with length-prefixed protobuf read
by a task through ``StreamReader``, and (c) the same connection cut into frames in a protocol's
callback (the router's link today), each received on the stock asyncio loop and on uvloop.
Printed: the receiver's CPU (utime + stime) per message, and the ratio to (a) on asyncio.

    python benchmarks/stream_receive.py [--messages 3000] [--interval-ms 1]

Only loopback; both processes stop on their own.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from epd.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402


def _batch(i: int) -> decode_pb2.StepBatch:
    batch = decode_pb2.StepBatch()
    step = batch.requests.add()
    step.request_id, step.token_ids[:] = "chatcmpl-0123456789abcdef#c0a1b2c3d4", [i]
    return batch


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- senders (their own process) ------------------------------------------------------------------
def _send_grpc(port: int, count: int, interval_s: float, ready) -> None:
    class Decode(decode_pb2_grpc.DecodeServicer):
        async def Stream(self, commands, context):
            await commands.__anext__()
            for i in range(count):
                await context.write(_batch(i))
                await asyncio.sleep(interval_s)

    async def main():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        decode_pb2_grpc.add_DecodeServicer_to_server(Decode(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination(timeout=count * interval_s * 4 + 30)

    asyncio.run(main())


def _send_tcp(port: int, count: int, interval_s: float, ready) -> None:
    async def handle(reader, writer):
        await reader.readexactly(1)
        for i in range(count):
            data = _batch(i).SerializeToString()
            writer.write(struct.pack("<I", len(data)) + data)
            await asyncio.sleep(interval_s)
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        await asyncio.sleep(count * interval_s * 4 + 30)
        server.close()

    asyncio.run(main())


# ---- receivers ------------------------------------------------------------------------------------
async def _receive_grpc(port: int) -> tuple[int, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Stream()
        await call.write(decode_pb2.StreamCommand(cancel="start"))
        count, start = 0, _cpu_s()
        async for _ in call:
            count += 1
        return count, _cpu_s() - start


async def _receive_tcp(port: int) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    count, start = 0, _cpu_s()
    while True:
        try:
            size = struct.unpack("<I", await reader.readexactly(4))[0]
        except asyncio.IncompleteReadError:
            break
        decode_pb2.StepBatch.FromString(await reader.readexactly(size))
        count += 1
    writer.close()
    return count, _cpu_s() - start


async def _receive_protocol(port: int) -> tuple[int, float]:
    """As the router reads its link: frames cut in the protocol's callback, no reader task."""
    from epd.tcp_link import FrameReader
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    class Link(asyncio.Protocol):
        def __init__(self) -> None:
            self.frames, self.count = FrameReader(decode_pb2.StepBatch), 0

        def data_received(self, data: bytes) -> None:
            self.count += len(self.frames.feed(data))

        def connection_lost(self, exc) -> None:
            done.set_result(self.count)

    transport, _ = await loop.create_connection(Link, "127.0.0.1", port)
    transport.write(b"x")
    start = _cpu_s()
    count = await done
    return count, _cpu_s() - start


_RECEIVERS = {"grpc": _receive_grpc, "tcp": _receive_tcp, "tcp-proto": _receive_protocol}


def measure(transport: str, loop: str, count: int, interval_s: float) -> float:
    """-> the receiver's CPU ms per message."""
    ctx = multiprocessing.get_context("spawn")
    port, ready = _free_port(), ctx.Event()
    sender = ctx.Process(target=_send_grpc if transport == "grpc" else _send_tcp,
                         args=(port, count, interval_s, ready), daemon=True)
    sender.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the sender did not start")
        receive = _RECEIVERS[transport](port)
        if loop == "uvloop":
            import uvloop
            received, cpu_s = uvloop.run(receive)
        else:
            received, cpu_s = asyncio.run(receive)
        if received != count:
            raise RuntimeError(f"{transport}: received {received} of {count} messages")
        return 1000 * cpu_s / count
    finally:
        sender.terminate()
        sender.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    args = parser.parse_args()
    try:
        import uvloop  # noqa: F401
        loops = ("asyncio", "uvloop")
    except ImportError:
        loops = ("asyncio",)
    baseline = None
    print(f"{'transport':<10}{'loop':<9}{'CPU ms/message':>16}{'vs grpc/asyncio':>17}")
    for transport in _RECEIVERS:
        for loop in loops:
            ms = measure(transport, loop, args.messages, args.interval_ms / 1000)
            baseline = baseline or ms
            print(f"{transport:<10}{loop:<9}{ms:>16.4f}{ms / baseline:>17.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
