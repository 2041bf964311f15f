"""A router lost mid-stream (one of several routers over the same workers, its process killed):
the decode worker it streamed from finds its link gone while its engine thread is sending steps on
it, aborts that router's requests at once, frees their KV, and goes on serving the next router."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import replace

import pytest

from epd.models.null.checkpoint import NULL_PRESETS, write_null_checkpoint
from epd.server.local import LocalCluster
from epd.shm_owners import own_names
from epd.transport import get_channel
from epd.v1 import common_pb2, decode_pb2_grpc
from tests.procs import gone

pytestmark = pytest.mark.slow
STEP_MS = 10.0  # the zero-cost model paced like a device: the streams last 30 s unless cut
NUM_STREAMS = 6
STREAM_TOKENS = 3000
DEADLINE_S = 10.0  # a third of the streams' own length: what ends them here is the cut


def _stream(url: str, model: str, max_tokens: int, seen: list[int], index: int) -> bytes:
    """One streamed chat over a raw socket, counting SSE events into ``seen[index]`` as they come
    -> everything received (until ``[DONE]``, or the connection's end)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    received = b""
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            while data := sock.recv(1 << 16):
                received += data
                seen[index] += data.count(b"data: {")
                if b"data: [DONE]" in received[-64:]:
                    break
        except OSError:  # the router was killed: the connection is reset
            pass
    return received


def _completion_tokens(received: bytes) -> int:
    usage = [json.loads(line[6:])["usage"] for line in received.split(b"\n")
             if line.startswith(b"data: {") and b'"usage":{' in line]
    return usage[-1]["completion_tokens"]


def _decode_health(address: str) -> common_pb2.HealthResponse:
    return decode_pb2_grpc.DecodeStub(get_channel(address)).Health(common_pb2.HealthRequest(), timeout=10)


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S:.0f} s: {what}")
        time.sleep(0.05)


def test_a_router_killed_mid_stream_frees_its_requests_on_decode_which_serves_the_next_router(tmp_path):
    model = str(write_null_checkpoint(tmp_path / "paced", replace(NULL_PRESETS["null-qwen2-vl"], step_ms=STEP_MS)))
    shm_before = own_names()
    with LocalCluster(model) as cluster:
        decode = cluster.decodes[0]
        idle = _decode_health(decode)
        first = cluster.start_router()
        seen = [0] * NUM_STREAMS
        clients = [threading.Thread(target=_stream, args=(first.address, model, STREAM_TOKENS, seen, i), daemon=True)
                   for i in range(NUM_STREAMS)]
        for client in clients:
            client.start()
        _wait(lambda: _decode_health(decode).num_running == NUM_STREAMS and min(seen) >= 20,
              "every stream running on decode with tokens flowing")
        os.kill(first.proc.pid, signal.SIGKILL)
        _wait(lambda: gone(first.proc.pid), "the killed router gone")
        _wait(lambda: (h := _decode_health(decode)).num_running == 0 and h.num_waiting == 0
              and abs(h.kv_usage - idle.kv_usage) < 1e-9, "decode back to idle: no request, its KV free")
        tokens_at_kill = list(seen)
        for client in clients:
            client.join(DEADLINE_S)
        assert all(0 < n < STREAM_TOKENS for n in tokens_at_kill)  # cut mid-stream, not ended

        second = cluster.start_router()
        assert _completion_tokens(_stream(second.address, model, 64, [0], 0)) == 64
        health = _decode_health(decode)
        assert health.num_running == 0 and health.num_steps > idle.num_steps
    assert own_names() - shm_before == set()  # no segment left by the requests cut off
