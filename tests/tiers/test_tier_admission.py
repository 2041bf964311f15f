"""A tier's own admission against the router: workers that take one request at a time refuse the
rest with RESOURCE_EXHAUSTED and a retry hint; the router waits the hint and asks again within the
request's deadline, so every request completes; with no time left to wait, the client gets a 429
with Retry-After, never a 5xx."""
from __future__ import annotations

import asyncio
import time

import pytest

from epd.errors import EPDError, Overloaded
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import ChatRequest, SamplingParams
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def cluster():
    one_at_a_time = ["--max-requests", "1"]
    with LocalCluster("tiny-qwen2-vl", tier_args={t: one_at_a_time for t in ("encoder", "prefill", "decode")}) as c:
        yield c


def _router(cluster, **config) -> SyncRouter:
    from epd.models.locate import resolve_model

    return SyncRouter.over_workers(resolve_model("tiny-qwen2-vl"), encoders=cluster.encoders,
                                   prefills=cluster.prefills, decodes=cluster.decodes, **config)


def _burst(router: SyncRouter) -> list:
    async def one(i: int):
        request = ChatRequest(messages=user_message(f"Request {i}.", [make_image_bytes(48, 48, seed=900 + i)]),
                              sampling=SamplingParams(max_tokens=4), request_id=f"adm-{i}-{time.monotonic_ns()}")
        return [event async for event in router.pipeline.generate(request)][-1].finish_reason

    async def burst():
        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)), return_exceptions=True)
    return router.run(burst())


def _overloaded_answers(cluster) -> int:
    total = 0
    for process in cluster.processes:
        url = next(f.split("=", 1)[1] for f in process.ready_fields if f.startswith("metrics="))
        total += int(sample_sum(scrape(url, timeout_s=5), "epd_tier_requests_total", outcome="overloaded"))
    return total


def test_full_tiers_make_the_router_wait_and_every_request_completes(cluster):
    before = _overloaded_answers(cluster)
    with _router(cluster) as router:
        results = _burst(router)
    assert results == ["length"] * NUM_REQUESTS, results
    assert _overloaded_answers(cluster) > before  # the tiers did refuse: the router waited and asked again


def test_with_no_time_to_wait_the_client_gets_a_429_with_retry_after(cluster):
    with _router(cluster, queue_timeout_s=0.1) as router:  # less than the tiers' 0.5 s hint
        results = _burst(router)
    refused = [r for r in results if isinstance(r, Overloaded)]
    assert refused, results
    assert all(r.retry_after_s >= 1.0 and r.code.http_status == 429 for r in refused)
    others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, Overloaded)]
    assert not others, others
    assert all(r == "length" for r in results if not isinstance(r, EPDError))
