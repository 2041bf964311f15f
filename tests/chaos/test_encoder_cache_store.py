"""One encoder cache for the cluster on a real Mooncake Store: ``epd serve --encoder-cache-store
mooncake`` with two routers on one HTTP port and two encoders starts a master and a segment server
on 127.0.0.1. Sixteen concurrent requests for one new image, spread over both routers, cost one
vision forward in the cluster and get one answer; an image encoded once is fetched, not encoded, by
encoders restarted since (their own caches empty); a corrupted entry is encoded again and replaced;
the master killed mid-run costs no request (the encoders go on with their own caches). Every answer
equals the first, token for token; at the end nothing of the run is left in the process table or
/dev/shm."""
from __future__ import annotations

import base64
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from epd.bench.chaos import (
    LoopingClients,
    chats,
    in_rotation,
    mismatches,
    references,
    restarted_pid,
    segments_of,
    worker_pids,
)
from epd.models.locate import resolve_model
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.procs import descendants, gone
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen2-vl"
IMAGE = make_image_bytes(96, 80, seed=77)
MAX_NEW = 12


@pytest.fixture(scope="module")
def serve():
    server = ServeProcess(MODEL, "--routers", "2", "--encoders", "2", "--encoder-cache-store", "mooncake",
                          "--encoder-cache-store-bytes", str(64 * 2**20), "--health-timeout-s", "2")
    server.started = descendants(server.proc.pid)
    try:
        yield server
    finally:
        started = server.started | descendants(server.proc.pid)
        assert server.stop() == 0, "\n".join(server.lines[-30:])
        assert wait_until(lambda: all(gone(p) for p in started), 20), [p for p in started if not gone(p)]
        # this run's own segments only: other test modules run beside it
        assert not [name for p in started for name in segments_of(p)]


def _store_pids(server) -> tuple[str, int, int]:
    (line,) = [line for line in server.lines if "encoder cache store: Mooncake master" in line]
    m = re.search(r"master (\S+) \(pid (\d+)\), segment server pid (\d+)", line)
    return m.group(1), int(m.group(2)), int(m.group(3))


def _ask(server, image: bytes = IMAGE) -> list[int]:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
               {"type": "text", "text": "What is in it?"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _encoded_items(server) -> float:
    """Items the encoders now running have encoded (each worker's own count, from its health answer):
    the larger of the two routers' views (a scrape reaches either; one may not have seen a restarted
    worker's first answer yet)."""
    seen: dict[str, float] = {}
    for _ in range(200):
        text = scrape(f"{server.base_url}/metrics")  # a new connection: either router takes it
        (router,) = re.findall(r'^epd_router_info\{[^}]*router="(\d+)"', text, re.M)
        seen[router] = sample_sum(text, "epd_encoder_encoded_items_total")
        if len(seen) == 2:
            return max(seen.values())
    raise AssertionError(f"only router(s) {sorted(seen)} answered 200 scrapes")


def _restart_encoders(server) -> None:
    """SIGKILL every encoder; back once the supervisor restarted each and the router has it again."""
    seen = len(server.lines)
    for address, first_pid in worker_pids(server.lines)["encoder"]:
        os.kill(restarted_pid(server.lines, "encoder", address) or first_pid, signal.SIGKILL)
    for address, _ in worker_pids(server.lines)["encoder"]:
        assert wait_until(lambda: restarted_pid(server.lines, "encoder", address, seen) is not None
                          and in_rotation(server.base_url, "encoder", address), 90), "\n".join(server.lines[-20:])
    assert wait_until(lambda: _encoded_items(server) == 0, 30)  # both routers see the new processes' counts
    server.started |= descendants(server.proc.pid)


def test_both_routers_answer_on_the_one_port_and_say_which_answered(serve):
    seen = set()
    for _ in range(100):
        health = httpx.get(f"{serve.base_url}/health", timeout=10).json()  # a new connection each time
        seen.add(health["router"]["index"])
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    assert len([line for line in serve.lines if line.strip().startswith("router ")]) == 2  # both in the banner


def test_sixteen_requests_for_a_new_image_over_two_routers_cost_one_forward(serve):
    image = make_image_bytes(88, 72, seed=79)
    before = _encoded_items(serve)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: _ask(serve, image), range(16)))
    assert all(a == answers[0] for a in answers) and len(set(answers[0])) > 2
    assert wait_until(lambda: _encoded_items(serve) == before + 1, 10), _encoded_items(serve) - before
    assert not wait_until(lambda: _encoded_items(serve) > before + 1, 2)


@pytest.fixture(scope="module")
def first_tokens(serve) -> list[int]:
    """The image chat's answer, the first time any encoder sees the image (one forward)."""
    before = _encoded_items(serve)
    tokens = _ask(serve)
    assert wait_until(lambda: _encoded_items(serve) == before + 1, 10)  # the router's view refreshes every second
    return tokens


def test_an_image_encoded_once_is_fetched_by_encoders_restarted_since(serve, first_tokens):
    first = first_tokens
    assert len(set(first)) > 2
    _restart_encoders(serve)  # both caches empty now; the store keeps the rows
    assert _ask(serve) == first
    assert not wait_until(lambda: _encoded_items(serve) > 0, 3), "an encoder encoded what the store had"


def test_a_corrupt_entry_is_encoded_again_and_replaced(serve, first_tokens):
    from epd.encoder.engine import media_item_from_bytes
    from epd.encoder.shared_store import store_key
    from epd.models.registry import family_for
    from epd.transport.mooncake import MooncakeBackend

    model_dir = resolve_model(MODEL)
    item = media_item_from_bytes(IMAGE, family_for(model_dir).media_settings(model_dir), model_id=str(model_dir))
    key = store_key(_cache_key(item, str(model_dir)), torch.float32)
    master, _, _ = _store_pids(serve)
    client = MooncakeBackend(master)
    try:
        assert client.wait_joined(30)
        good = client.get(key)
        assert good is not None, "the image's rows are not in the store under the key the encoders use"
        client.put(key, good[:-8])  # truncated
        _restart_encoders(serve)
        assert _ask(serve) == first_tokens  # never fed the damaged rows
        assert wait_until(lambda: _encoded_items(serve) == 1, 10)
        assert wait_until(lambda: client.get(key) == good, 10)  # the damaged entry removed, the new encoding put
    finally:
        client.close()


def _cache_key(item, model_id: str):
    from epd.encoder.cache import EncoderCacheKey

    return EncoderCacheKey(item.content_hash, item.processor_kwargs_hash, model_id, item.expected_rows)


def test_the_master_killed_mid_run_fails_no_request(serve, first_tokens):
    chat_list = chats(max_tokens=16, seed=5)
    refs = references(serve.base_url, MODEL, chat_list)
    _, master_pid, segment_pid = _store_pids(serve)
    with LoopingClients(serve.base_url, MODEL, chat_list, num_clients=3) as clients:
        assert wait_until(lambda: clients.num_ok >= 3, 90)
        os.kill(master_pid, signal.SIGKILL)
        os.kill(segment_pid, signal.SIGKILL)
        done = clients.num_ok
        assert wait_until(lambda: clients.num_ok >= done + 6, 120)
    assert not clients.failures(), [f"{o.chat}: {o.status} {o.error}" for o in clients.failures()][:5]
    assert not mismatches(clients.snapshot(), refs)
    # an image no encoder has seen: looked up in the store (down), encoded here, answered right
    from epd.llm import LLM
    from epd.types import SamplingParams
    from tests.fidelity.reference import user_message

    new_image = make_image_bytes(72, 64, seed=78)
    with LLM(MODEL) as llm:
        expected = llm.chat(user_message("What is in it?", [new_image]),
                            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0].token_ids
    assert _ask(serve, new_image) == expected
    assert _ask(serve) == first_tokens
