"""Prefill reads a repeated image's rows from the cluster's encoder cache store itself (``store``
handles): ``epd serve --encoder-cache-store mooncake --prefill-store-reads always`` on a real
Mooncake master. A chat with images interleaved, one image twice and one in an earlier turn is
encoded once; asked again, its answer is the same token for token while no encoder is asked for
anything (the router arranges no push); an entry damaged in the store is never fed to prefill:
prefill says it could not read it, the router has that item encoded and pushed within the same
request, and the answer is still the same. At the end nothing of the run is left running or in
/dev/shm."""
from __future__ import annotations

import base64
import re

import httpx
import pytest

from epd.bench.chaos import segments_of
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.procs import descendants, gone
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen2-vl"
RED, BLUE = make_image_bytes(96, 80, seed=81), make_image_bytes(64, 88, seed=82)


@pytest.fixture(scope="module")
def serve():
    server = ServeProcess(MODEL, "--encoder-cache-store", "mooncake", "--encoder-cache-store-bytes", str(64 * 2**20),
                          "--prefill-store-reads", "always")
    started = descendants(server.proc.pid)
    try:
        # workers join the store on a thread of their own; the router sends prefill store handles
        # once its health says it reads the store, and encoders put what they encode once joined
        assert wait_until(lambda: _joined(httpx.get(f"{server.base_url}/health", timeout=10).json()["workers"]),
                          60), "a worker never joined the store"
        yield server
    finally:
        started |= descendants(server.proc.pid)
        assert server.stop() == 0, "\n".join(server.lines[-30:])
        assert wait_until(lambda: all(gone(p) for p in started), 20), [p for p in started if not gone(p)]
        assert not [name for p in started for name in segments_of(p)]


def _joined(workers: dict) -> bool:
    return (all(w.get("reads_encoder_store") for w in workers["prefill"])
            and all(w.get("uses_encoder_store") for w in workers["encoder"]))


def _image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _ask(server) -> list[int]:
    """Images interleaved with text, one image twice, one in an earlier turn."""
    messages = [{"role": "user", "content": [_image(BLUE), {"type": "text", "text": "Remember this one."}]},
                {"role": "assistant", "content": "I will."},
                {"role": "user", "content": [{"type": "text", "text": "Compare"}, _image(RED),
                                             {"type": "text", "text": "with"}, _image(RED),
                                             {"type": "text", "text": "and the first."}]}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _counts(server) -> dict[str, float]:
    text = scrape(f"{server.base_url}/metrics")
    return {"pushed": sample_sum(text, "epd_tensor_handoffs_total", stage="embeddings", placement="same_host"),
            "read": sample_sum(text, "epd_tensor_handoffs_total", stage="embeddings", placement="store"),
            "missed": sample_sum(text, "epd_router_store_read_misses_total")}


def _grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


@pytest.fixture(scope="module")
def first(serve) -> list[int]:
    before = _counts(serve)
    tokens = _ask(serve)
    assert _grew(before, _counts(serve)) == {"pushed": 3, "read": 0, "missed": 0}  # nothing known yet
    assert len(set(tokens)) > 2
    return tokens


def test_a_repeated_chat_is_read_from_the_store_by_prefill_and_answers_the_same(serve, first):
    before = _counts(serve)
    assert _ask(serve) == first
    assert _grew(before, _counts(serve)) == {"pushed": 0, "read": 3, "missed": 0}  # no encoder asked


def test_a_damaged_entry_is_encoded_and_pushed_instead_within_the_request(serve, first):
    from epd.transport.mooncake import MooncakeBackend

    (line,) = [line for line in serve.lines if "encoder cache store: Mooncake master" in line]
    master = re.search(r"master (\S+) \(pid", line).group(1)
    client = MooncakeBackend(master)
    try:
        assert client.wait_joined(30)
        keys = {}
        for _ in range(2):  # the router knows two entries: RED's (read twice) and BLUE's
            before = _counts(serve)
            assert _ask(serve) == first
            assert _grew(before, _counts(serve))["read"] == 3
        # damage every entry of this run: the encoders' own caches still hold the rows
        text = scrape(f"{serve.base_url}/metrics")
        assert sample_sum(text, "epd_router_store_read_misses_total") == 0
        for key in _run_keys(serve):
            good = client.get(key)
            assert good is not None, key
            keys[key] = good
            client.put(key, good[:-8])
        before = _counts(serve)
        assert _ask(serve) == first  # never fed the damaged rows
        grew = _grew(before, _counts(serve))
        assert grew["read"] == 3 and grew["missed"] == 3 and grew["pushed"] == 3, grew
        before = _counts(serve)  # the encoders answered that the store has the rows again (put anew)
        assert wait_until(lambda: all(client.get(k) == v for k, v in keys.items()), 10)
        assert _ask(serve) == first
        assert _grew(before, _counts(serve)) == {"pushed": 0, "read": 3, "missed": 0}
    finally:
        client.close()


def _run_keys(server) -> list[str]:
    """The store keys of this run's two images, as the encoders name them."""
    import torch

    from epd.encoder.cache import EncoderCacheKey
    from epd.encoder.engine import media_item_from_bytes
    from epd.encoder.shared_store import store_key
    from epd.models.locate import resolve_model
    from epd.models.registry import family_for

    model_dir = resolve_model(MODEL)
    settings = family_for(model_dir).media_settings(model_dir)
    keys = []
    for data in (RED, BLUE):
        item = media_item_from_bytes(data, settings, model_id=str(model_dir))
        keys.append(store_key(EncoderCacheKey(item.content_hash, item.processor_kwargs_hash, str(model_dir),
                                              item.expected_rows), torch.float32))
    return keys
