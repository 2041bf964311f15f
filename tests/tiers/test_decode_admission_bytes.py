"""Decode's admission counts a request's imported KV bytes only while it holds the import: the KV
is copied into decode's own cache at the request's first step and the import let go then, so a
long stream does not keep later requests out under ``--max-imported-bytes``."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from epd.models.locate import resolve_model
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import ChatRequest, SamplingParams
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
TEXT = " ".join(["word"] * 200)  # a prompt of ~200 tokens plus the chat template's (at most 40)
TEMPLATE_TOKENS_MAX = 40


def _kv_bytes_per_token(model_dir) -> int:
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    return text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * 4  # K and V, float32


@pytest.fixture(scope="module")
def setup():
    from epd.models.tokenizer_loading import load_tokenizer

    model_dir = resolve_model("tiny-qwen2-vl")
    text_tokens = len(load_tokenizer(model_dir).encode(TEXT, add_special_tokens=False))
    # room for one request's KV, not for two: a second is refused while the first counts its bytes
    max_bytes = int(1.1 * (text_tokens + TEMPLATE_TOKENS_MAX) * _kv_bytes_per_token(model_dir))
    with LocalCluster("tiny-qwen2-vl", tier_args={"decode": ["--max-imported-bytes", str(max_bytes)]}) as cluster:
        yield model_dir, cluster, max_bytes


def _decode_overloaded(cluster) -> int:
    process = next(p for p in cluster.processes if p.tier == "decode")
    url = next(f.split("=", 1)[1] for f in process.ready_fields if f.startswith("metrics="))
    return int(sample_sum(scrape(url, timeout_s=5), "epd_tier_requests_total", outcome="overloaded"))


def test_a_long_stream_gives_its_kv_bytes_back_after_the_first_step(setup):
    model_dir, cluster, max_bytes = setup
    kv_sizes, finished = [], []
    with SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                 decodes=cluster.decodes) as router:
        backend = router.pipeline.backend
        original = backend._decode

        def decode(job, prefill, result, backoff):
            kv_sizes.append(result.kv.nbytes)
            return original(job, prefill, result, backoff)
        backend._decode = decode

        def request(name: str, max_tokens: int) -> ChatRequest:
            return ChatRequest(messages=[{"role": "user", "content": TEXT}], request_id=f"{name}-{time.monotonic_ns()}",
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))

        async def run(name: str, max_tokens: int, started: asyncio.Event | None = None) -> str:
            num_events = 0
            async for event in router.pipeline.generate(request(name, max_tokens)):
                num_events += 1
                if started is not None and num_events == 3:  # decode is streaming: its KV is in the cache
                    started.set()
            finished.append(name)
            return event.finish_reason

        async def both():
            started = asyncio.Event()
            long = asyncio.create_task(run("long", 1500, started))
            await asyncio.wait_for(started.wait(), 60)
            short = await run("short", 4)
            return short, await long

        before = _decode_overloaded(cluster)
        assert router.run(both()) == ("length", "length")
    assert all(n <= max_bytes < 2 * n for n in kv_sizes), (kv_sizes, max_bytes)  # the premise: one fits, two do not
    assert _decode_overloaded(cluster) == before, "decode refused the second request while the first streamed"
    assert finished == ["short", "long"]


def test_bytes_given_back_are_counted_off_once_and_the_request_still_counts():
    from epd.errors import Overloaded
    from epd.server.admission import TierAdmission

    admission = TierAdmission("decode", max_requests=4, max_imported_bytes=100)
    with admission.hold(80) as held:
        with pytest.raises(Overloaded, match="80 imported bytes"):
            with admission.hold(80):
                pass
        held.give_back()
        held.give_back()  # called after every streamed chunk: idempotent
        assert (admission.num_requests, admission.imported_bytes) == (1, 0)
        with admission.hold(80):
            assert admission.imported_bytes == 80
    assert (admission.num_requests, admission.imported_bytes) == (0, 0)
