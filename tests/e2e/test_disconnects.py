"""Streaming HTTP clients that hang up right after their first chunk (a user pressing stop, an agent
framework's timeout) against the default ``epd serve``: soon no tier holds or computes any of their
requests, the decode tier's KV usage is back where it was, and none of them (200 tokens each) ran
on to its end at decode. (Counts, not seconds: a loaded machine may take longer to land the
cancel, but it must land.)"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.request

import grpc
import httpx
import pytest

from epd.v1 import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
NUM_CLIENTS = 32
# how long the tiers may take to go idle: far past the time a cancel takes, far short of the
# requests' own end (200 tokens each) or of their timeout
IDLE_DEADLINE_S = 10.0
_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "prefill": prefill_pb2_grpc.PrefillStub,
          "decode": decode_pb2_grpc.DecodeStub}


@pytest.fixture(scope="module")
def server():
    serve = ServeProcess("--model", "tiny-qwen2-vl")
    yield serve
    serve.stop()


def _workers(server) -> list[tuple[str, str]]:
    health = json.loads(urllib.request.urlopen(f"{server.base_url}/health", timeout=10).read())
    return [(tier, w["address"]) for tier, states in health["workers"].items() for w in states]


def _tier_health(workers) -> list[tuple[str, common_pb2.HealthResponse]]:
    replies = []
    for tier, address in workers:
        with grpc.insecure_channel(address) as channel:
            replies.append((tier, _STUBS[tier](channel).Health(common_pb2.HealthRequest(), timeout=5)))
    return replies


def _busy(workers, kv_before: dict[str, float]) -> str | None:
    for tier, h in _tier_health(workers):
        if h.num_running or h.num_waiting or h.num_held_requests or abs(h.kv_usage - kv_before[tier]) > 1e-6:
            return f"{tier}: running={h.num_running} waiting={h.num_waiting} held={h.num_held_requests} " \
                   f"kv_usage={h.kv_usage:.4f} (was {kv_before[tier]:.4f})"
    return None


def _body(i: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 64, seed=500 + i)).decode()
    return {"model": "tiny-qwen2-vl", "stream": True, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": f"Picture {i}?"}]}]}


async def _hang_up_after_first_chunk(client: httpx.AsyncClient, base_url: str, i: int) -> bool:
    async with client.stream("POST", f"{base_url}/v1/chat/completions", json=_body(i)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return True  # leaving the block closes the connection
    return False


def _finished_at_decode(server) -> int:
    """Requests the decode worker ran to their end (a length or stop finish) so far, from its
    /metrics (``epd serve`` names each worker's metrics URL in its banner)."""
    url = next(line.split(" metrics ")[1].strip() for line in server.lines
               if line.strip().startswith("decode ") and " metrics " in line)
    text = scrape(url)
    return sum(int(sample_sum(text, "epd_tier_requests_total", outcome=reason)) for reason in ("length", "stop"))


def test_clients_that_hang_up_free_every_tier_and_run_nothing_on(server):
    workers = _workers(server)
    assert wait_until(lambda: _busy(workers, {t: h.kv_usage for t, h in _tier_health(workers)}) is None, 30)
    kv_before = {tier: h.kv_usage for tier, h in _tier_health(workers)}
    finished_before = _finished_at_decode(server)

    async def clients():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_hang_up_after_first_chunk(client, server.base_url, i)
                                          for i in range(NUM_CLIENTS)))

    assert all(asyncio.run(clients()))
    gone_at_s = time.monotonic()
    left = _busy(workers, kv_before)
    while left is not None and time.monotonic() - gone_at_s < IDLE_DEADLINE_S:
        time.sleep(0.05)
        left = _busy(workers, kv_before)
    assert left is None, f"{IDLE_DEADLINE_S:.0f} s after {NUM_CLIENTS} clients hung up, still busy: {left}"
    assert _finished_at_decode(server) == finished_before, "a request whose client hung up ran on to its end"
