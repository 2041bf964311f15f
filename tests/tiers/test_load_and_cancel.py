"""No cliffs under load, and a client that leaves frees its work everywhere at once.

A real 1E1P1D cluster (processes on 127.0.0.1) under the router's real pipeline:
- more concurrent requests than any thread pool a tier still has (3x its io pool, 3x the old
  32-thread handler pool), every one needing encoder pushes: all complete, none waits for a
  timeout, and no worker leaves rotation;
- 32 concurrent clients cancelled at each moment of a request's life (before its encode, mid-encode,
  between prefill and decode, mid-stream): every tier soon holds nothing, computes nothing, and its
  KV usage is back where it was; none of the requests (200 tokens each) ran on to its end at
  decode, and every tensor lease was released, none left to expire by its TTL. (Counts, not
  seconds: on a loaded machine the cancel may take longer to land, but it must land.)
"""
from __future__ import annotations

import asyncio
import contextvars
import time

import pytest

from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import ChatRequest, SamplingParams
from epd.v1 import common_pb2
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
IO_THREADS = 2
NUM_CLIENTS = 32
# Leases: every one is released once the clients leave (a result in flight as the router cancels is
# released by the call's key), never left for this TTL to expire it.
LEASE_TTL_S = 4.0
# how long the polls below wait for the tiers to go idle: far past the time a cancel takes, far
# short of the requests' own end (200 tokens) or of their timeout
IDLE_DEADLINE_S = 10.0
WORKERS_MODEL_LEN = 3000
_CLIENT_TASK: contextvars.ContextVar[asyncio.Task] = contextvars.ContextVar("client_task")


@pytest.fixture(scope="module")
def cluster():
    args = ["--io-threads", str(IO_THREADS), "--lease-ttl-s", str(LEASE_TTL_S)]
    engines = [*args, "--max-model-len", str(WORKERS_MODEL_LEN)]  # the router is given none: it follows these
    with LocalCluster("tiny-qwen2-vl", tier_args={"encoder": args, "prefill": engines, "decode": engines}) as c:
        yield c


@pytest.fixture(scope="module")
def router(cluster):
    from epd.models.locate import resolve_model

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


def _metrics_of(cluster: LocalCluster, tier: str) -> list[str]:
    """The /metrics text of each of ``tier``'s workers."""
    urls = [f.split("=", 1)[1] for p in cluster.processes if p.tier == tier for f in p.ready_fields
            if f.startswith("metrics=")]
    return [scrape(url, timeout_s=5) for url in urls]


def _open_leases(cluster: LocalCluster) -> dict[str, int]:
    """Open tensor leases per producer tier (only those with some)."""
    leases = {tier: sum(int(sample_sum(text, "epd_open_leases")) for text in _metrics_of(cluster, tier))
              for tier in ("encoder", "prefill")}
    return {tier: count for tier, count in leases.items() if count}


def _expired_leases(cluster: LocalCluster) -> int:
    """Leases the producers let expire so far: memory nobody released."""
    return sum(int(sample_sum(text, "epd_lease_ends_total", reason="expired"))
               for tier in ("encoder", "prefill") for text in _metrics_of(cluster, tier))


def _finished_at_decode(cluster: LocalCluster) -> int:
    """Requests decode ran to their end (a length or stop finish) so far."""
    return sum(int(sample_sum(text, "epd_tier_requests_total", outcome=reason))
               for text in _metrics_of(cluster, "decode") for reason in ("length", "stop"))


def _poll(check, deadline_s: float, what: str):
    """Call ``check`` (-> None when done, else what is left) until done or ``deadline_s``; fails
    naming ``what`` it waited for and what was left."""
    start_s = time.monotonic()
    while (left := check()) is not None and time.monotonic() - start_s < deadline_s:
        time.sleep(0.05)
    assert left is None, f"{what}: still not so after {deadline_s:.0f} s: {left}"


def _idle(router: SyncRouter, kv_before: dict[str, float]) -> str | None:
    """None when every tier holds and computes nothing at its earlier KV usage; else what is left."""
    for tier, h in _healths(router):
        if h.num_running or h.num_waiting or h.num_held_requests or abs(h.kv_usage - kv_before[tier]) > 1e-6:
            return (f"{tier}: running={h.num_running} waiting={h.num_waiting} held={h.num_held_requests} "
                    f"kv_usage={h.kv_usage:.4f} (was {kv_before[tier]:.4f})")
    return None


def test_the_router_admits_by_the_model_length_its_workers_report(router):
    lengths = {tier: h.max_model_len for tier, h in _healths(router) if tier != "encoder"}
    assert lengths == {"prefill": WORKERS_MODEL_LEN, "decode": WORKERS_MODEL_LEN}
    assert router.pipeline.max_model_len == WORKERS_MODEL_LEN  # not the router's own default, 4096


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
def test_a_cancel_at_any_moment_frees_every_tier_and_runs_nothing_on(router, cluster, moment):
    kv_before = {tier: h.kv_usage for tier, h in _healths(router)}
    assert _idle(router, kv_before) is None
    finished_before, expired_before = _finished_at_decode(cluster), _expired_leases(cluster)
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
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    _poll(lambda: _idle(router, kv_before), IDLE_DEADLINE_S,
          f"every tier idle after {NUM_CLIENTS} clients left {moment}")
    _poll(lambda: _open_leases(cluster) or None, 3 * LEASE_TTL_S, f"no lease open after the clients left {moment}")
    assert _finished_at_decode(cluster) == finished_before, f"a request cancelled {moment} ran on to its end at decode"
    assert _expired_leases(cluster) == expired_before, f"a lease of a request cancelled {moment} was left to expire"


def test_encode_calls_still_running_when_prefills_result_arrives_are_cancelled(router):
    """An encoder's reply can lag its pushes; once prefill has answered, the call only holds the
    encoder (its in-flight count, the router's note that it is producing those items)."""
    backend = router.pipeline.backend
    outcomes = []

    def make(original):
        async def encode(*args, **kwargs):
            try:  # the cancel may land in the call itself (prefill's result came first) or after it
                await original(*args, **kwargs)
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
    _poll(lambda: None if outcomes else "the encode call still runs", IDLE_DEADLINE_S,  # it sleeps 30 s if let be
          "the encode call cancelled")
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

    monkeypatch.setattr(disaggregated.Encodes, "race", race)
    expired_before = _expired_leases(cluster)
    with pytest.raises(InvalidRequest, match="an encode failed"):
        router.run(_complete(router, _request(901, 3)))
    _poll(lambda: _open_leases(cluster).get("prefill"), 3 * LEASE_TTL_S, "the KV lease freed")
    assert _expired_leases(cluster) == expired_before, f"the KV lease was left to its TTL ({LEASE_TTL_S} s)"
