"""No cliffs under load, and a client that leaves frees its work everywhere at once.

A real 1E1P1D cluster (processes on 127.0.0.1) under the router's real pipeline:
- more concurrent requests than any thread pool a tier still has (3x its io pool, 3x the old
  32-thread handler pool), every one needing encoder pushes: all complete, none waits for a
  timeout, and no worker leaves rotation;
- 32 concurrent clients cancelled at each moment of a request's life (before its encode, mid-encode,
  between prefill and decode, mid-stream): within 1 s every tier holds nothing, computes nothing,
  and its KV usage is back where it was; no tensor lease outlives its TTL.
"""
from __future__ import annotations

import asyncio
import contextvars
import re
import time
import urllib.request

import pytest

from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import ChatRequest, SamplingParams
from epd.v1 import common_pb2
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message

pytestmark = pytest.mark.slow
IO_THREADS = 2
NUM_CLIENTS = 32
# Leases: every one is released within a second or two of the clients leaving (a result in flight
# as the router cancels is released by the call's key), well before this TTL would expire it.
LEASE_TTL_S = 4.0
LEASES_FREED_WITHIN_S = 2.0
_CLIENT_TASK: contextvars.ContextVar[asyncio.Task] = contextvars.ContextVar("client_task")


@pytest.fixture(scope="module")
def cluster():
    args = ["--io-threads", str(IO_THREADS), "--lease-ttl-s", str(LEASE_TTL_S)]
    with LocalCluster("tiny-qwen2-vl", tier_args={tier: args for tier in ("encoder", "prefill", "decode")}) as c:
        yield c


@pytest.fixture(scope="module")
def router(cluster):
    from epd.models.presets import resolve_model

    with SyncRouter.over_workers(resolve_model("tiny-qwen2-vl"), encoders=cluster.encoders,
                                 prefills=cluster.prefills, decodes=cluster.decodes,
                                 max_concurrent_requests=512, request_timeout_s=90.0) as r:
        yield r


def _request(i: int, max_tokens: int) -> ChatRequest:
    image = make_image_bytes(64 + 8 * (i % 4), 56 + 8 * (i // 4 % 4), seed=10_000 + i)  # distinct: no cache hits
    return ChatRequest(messages=user_message(f"Request {i}: describe.", [image]),
                       sampling=SamplingParams(max_tokens=max_tokens), request_id=f"load-{i}-{time.monotonic_ns()}")


async def _complete(router: SyncRouter, request: ChatRequest) -> str | None:
    finish = None
    async for event in router.pipeline.generate(request):
        finish = event.finish_reason or finish
    return finish


def _healths(router: SyncRouter) -> list[tuple[str, common_pb2.HealthResponse]]:
    async def ask():
        workers = [w for states in router.pipeline.backend.workers.workers.values() for w in states]
        replies = await asyncio.gather(*(w.stub.Health(common_pb2.HealthRequest(), timeout=5) for w in workers))
        return [(w.tier, reply) for w, reply in zip(workers, replies)]
    return router.run(ask())


def _open_leases(cluster: LocalCluster) -> dict[str, int]:
    """Open tensor leases per producer tier (only those with some)."""
    leases = {}
    for process in cluster.processes:
        metrics_url = next((f.split("=", 1)[1] for f in process.ready_fields if f.startswith("metrics=")), None)
        if metrics_url is None:
            continue
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        if count := sum(int(float(v)) for v in re.findall(r"^epd_open_leases(?:\{[^}]*\})? (\S+)$", text, re.M)):
            leases[process.tier] = count
    return leases


def _idle(router: SyncRouter, kv_before: dict[str, float]) -> str | None:
    """None when every tier holds and computes nothing at its earlier KV usage; else what is left."""
    for tier, h in _healths(router):
        if h.num_running or h.num_waiting or h.num_held_requests or abs(h.kv_usage - kv_before[tier]) > 1e-6:
            return (f"{tier}: running={h.num_running} waiting={h.num_waiting} held={h.num_held_requests} "
                    f"kv_usage={h.kv_usage:.4f} (was {kv_before[tier]:.4f})")
    return None


def test_more_requests_than_any_pool_all_complete_without_timeouts(router):
    num_requests = 3 * 32  # 3x the old handler pool, 48x the io pool
    out_of_rotation = []

    async def burst():
        async def watch():
            while True:
                health = router.pipeline.backend.health()
                out_of_rotation.extend(w["address"] for ws in health["workers"].values() for w in ws
                                       if not w["healthy"])
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(*(_complete(router, _request(i, 4)) for i in range(num_requests)),
                                        return_exceptions=True)
        finally:
            watcher.cancel()

    start_s = time.monotonic()
    results = router.run(burst())
    wall_s = time.monotonic() - start_s
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {num_requests} failed; first: {errors[0]!r}"
    assert all(r == "length" for r in results)
    # the slowest request's deadline is 90 s and a tier's own 120 s: far below, none waited for one
    assert wall_s < 60, f"{num_requests} requests took {wall_s:.1f} s"
    assert not out_of_rotation, f"workers left rotation under load: {sorted(set(out_of_rotation))}"


def _cancel_client() -> None:
    """Cancel the client's task (the one iterating the pipeline) now: what a client that disconnects does."""
    _CLIENT_TASK.get().cancel()


def _patch(backend, name: str, make):
    original = getattr(backend, name)
    setattr(backend, name, make(original))
    return lambda: setattr(backend, name, original)


def _cancel_before_encode(backend):
    def make(original):
        def groups(*args):  # the prefill accepted the request; its encodes are about to start
            _cancel_client()
            return original(*args)
        return groups
    return _patch(backend, "_encoder_groups", make)


def _cancel_mid_encode(backend):
    def make(original):
        async def encode(*args, **kwargs):
            asyncio.get_running_loop().call_later(0.05, _cancel_client)  # the call is at the (busy) encoder then
            return await original(*args, **kwargs)
        return encode
    return _patch(backend, "_encode_on", make)


def _cancel_between_prefill_and_decode(backend):
    def make(original):
        def decode(*args, **kwargs):  # the first token is out; decode is about to be called
            _cancel_client()
            return original(*args, **kwargs)
        return decode
    return _patch(backend, "_decode", make)


MOMENTS = {"before_encode": _cancel_before_encode, "mid_encode": _cancel_mid_encode,
           "between_prefill_and_decode": _cancel_between_prefill_and_decode, "mid_stream": None}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_cancel_at_any_moment_frees_every_tier_within_a_second(router, cluster, moment):
    kv_before = {tier: h.kv_usage for tier, h in _healths(router)}
    assert _idle(router, kv_before) is None
    unpatch = MOMENTS[moment](router.pipeline.backend) if MOMENTS[moment] else (lambda: None)

    async def client(i: int) -> int:
        _CLIENT_TASK.set(asyncio.current_task())
        num_events = 0
        async for _ in router.pipeline.generate(_request(i, 200)):
            num_events += 1
            if moment == "mid_stream" and num_events == 3:
                _cancel_client()
        return num_events

    async def clients():
        tasks = [asyncio.create_task(client(i), context=contextvars.copy_context()) for i in range(NUM_CLIENTS)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = router.run(clients())
    finally:
        unpatch()
    cancelled_at_s = time.monotonic()
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    left = _idle(router, kv_before)
    while left is not None and time.monotonic() - cancelled_at_s < 1.0:
        time.sleep(0.05)
        left = _idle(router, kv_before)
    assert left is None, f"1 s after {NUM_CLIENTS} clients left {moment}: {left}"
    while _open_leases(cluster) and time.monotonic() - cancelled_at_s < LEASES_FREED_WITHIN_S:
        time.sleep(0.1)
    assert _open_leases(cluster) == {}, f"{LEASES_FREED_WITHIN_S} s after {NUM_CLIENTS} clients left {moment}"


def test_encode_calls_still_running_when_prefills_result_arrives_are_cancelled(router):
    """An encoder's reply can lag its pushes; once prefill has answered, the call only holds the
    encoder (its in-flight count, the router's note that it is producing those items)."""
    backend = router.pipeline.backend
    outcomes = []

    def make(original):
        async def encode(*args, **kwargs):
            await original(*args, **kwargs)
            try:
                await asyncio.sleep(30)  # a reply that never comes in time
                outcomes.append("ran on")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
                raise
        return encode

    unpatch = _patch(backend, "_encode_on", make)
    try:
        finish = router.run(_complete(router, _request(900, 3)))
    finally:
        unpatch()
    deadline_s = time.monotonic() + 1.0
    while not outcomes and time.monotonic() < deadline_s:
        time.sleep(0.02)
    assert finish == "length" and outcomes == ["cancelled"]
    assert router.run(_encoding_of(backend)) == {}


async def _encoding_of(backend) -> dict:
    return dict(backend._encoding)


def test_a_result_in_flight_when_the_router_gives_the_call_up_is_freed_at_once(router, cluster, monkeypatch):
    """Prefill exported the KV and wrote its result; the router gives the call up before reading it
    (here: an encode failure raced the result). The KV is freed by the call's release key, not
    left for its lease's TTL."""
    from epd.errors import InvalidRequest
    from epd.router.backends import disaggregated

    async def race(self, reader, prefill):
        # called right after the reader task was made, before it ran: cancelled now, it never reads
        # (a read already under way would cancel the call itself, and prefill would export nothing)
        reader.cancel()
        deadline_s = time.monotonic() + 30
        while "prefill" not in await asyncio.to_thread(_open_leases, cluster):
            assert time.monotonic() < deadline_s, "prefill never exported the KV"
            await asyncio.sleep(0.02)
        monkeypatch.undo()
        raise InvalidRequest("an encode failed as the result came")

    monkeypatch.setattr(disaggregated._Encodes, "race", race)
    with pytest.raises(InvalidRequest, match="an encode failed"):
        router.run(_complete(router, _request(901, 3)))
    given_up_s = time.monotonic()
    while "prefill" in _open_leases(cluster) and time.monotonic() - given_up_s < 1.0:
        time.sleep(0.05)
    assert "prefill" not in _open_leases(cluster), f"the KV lease outlived the call by 1 s (TTL {LEASE_TTL_S} s)"
