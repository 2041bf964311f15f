"""The HTTP front end, driven by the official ``openai`` client against uvicorn on 127.0.0.1."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import time

import httpx
import openai
import pytest

from epd.errors import Overloaded
from epd.router.openai.app import build_app
from epd.types import StreamEvent
from tests.conftest import make_image_bytes
from tests.router.fake_core import (
    FIRST_TOKEN_ID,
    PROMPT_TOKEN_IDS,
    FakeRouterCore,
    FakeTokenizer,
    make_events,
    serve_app,
)

PNG = make_image_bytes(8, 6)
USER = [{"role": "user", "content": "Say hello."}]


@contextlib.contextmanager
def served(core: FakeRouterCore | None = None, **options):
    core = core or FakeRouterCore()
    with serve_app(build_app(core, **options)) as base:
        yield core, base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)


def create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model="fake-qwen2-vl", messages=kwargs.pop("messages", USER), **kwargs)


def test_non_stream_and_stream_give_the_same_text():
    core = FakeRouterCore(make_events(["Hello", ",", " world", "!"], num_cached_tokens=2))
    with served(core) as (_, _, client):
        response = create(client)
        chunks = list(create(client, stream=True))
    assert response.id.startswith("chatcmpl-") and response.model == "fake-qwen2-vl"
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.content == "Hello, world!" and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and choice.logprobs is None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (4, 4, 8)
    assert response.usage.prompt_tokens_details.cached_tokens == 2
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world!"
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and core.completed == [r.request_id for r in core.requests]


def test_request_reaches_the_core_with_openai_defaults_and_extensions():
    with served(default_max_tokens=32) as (core, _, client):
        create(client, seed=3, stop=["\n\n"], extra_body={"top_k": 5, "min_tokens": 2})
        create(client, max_completion_tokens=7, temperature=0)
    first, second = core.requests
    assert (first.sampling.temperature, first.sampling.top_p, first.sampling.max_tokens) == (1.0, 1.0, 32)
    assert (first.sampling.top_k, first.sampling.min_tokens, first.sampling.seed) == (5, 2, 3)
    assert first.stop_strings == ["\n\n"] and first.messages == USER
    assert (second.sampling.max_tokens, second.sampling.temperature) == (7, 0.0)


def test_stream_include_usage_adds_a_final_usage_chunk():
    with served() as (_, _, client):
        chunks = list(create(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == len(PROMPT_TOKEN_IDS)
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_return_token_ids_extension():
    token_ids = [FIRST_TOKEN_ID + i for i in range(4)]
    with served() as (_, _, client):
        response = create(client, extra_body={"return_token_ids": True})
        chunks = list(create(client, stream=True, extra_body={"return_token_ids": True}))
        plain = create(client)
    assert response.prompt_token_ids == PROMPT_TOKEN_IDS and response.choices[0].token_ids == token_ids
    assert chunks[0].prompt_token_ids == PROMPT_TOKEN_IDS
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == token_ids
    assert not hasattr(plain, "prompt_token_ids") or plain.prompt_token_ids is None


def test_logprobs_shape_with_a_tokenizer():
    core = FakeRouterCore(make_events(["a", "b"], with_logprobs=True))
    with served(core, tokenizer=FakeTokenizer()) as (_, _, client):
        response = create(client, logprobs=True, top_logprobs=2)
        chunks = list(create(client, stream=True, logprobs=True, top_logprobs=2))
    entries = response.choices[0].logprobs.content
    assert [e.token for e in entries] == ["<t100é>", "<t101é>"]
    assert entries[0].logprob == -0.5 and entries[0].bytes == list("<t100é>".encode())
    assert [(t.token, t.logprob) for t in entries[0].top_logprobs] == [("<t100é>", -0.5), ("<t7é>", -1.5)]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_logprob_tokens_are_ids_without_a_tokenizer():
    core = FakeRouterCore(make_events(["a"], with_logprobs=True))
    with served(core) as (_, _, client):
        entry = create(client, logprobs=True).choices[0].logprobs.content[0]
    assert entry.token == str(FIRST_TOKEN_ID) and entry.top_logprobs == []


def test_n_out_of_range_is_a_bad_request():
    with served() as (core, _, client):
        with pytest.raises(openai.BadRequestError) as info:
            create(client, n=17)
    assert "n must be in [1, 16], got 17" in info.value.message
    assert info.value.body["param"] == "n" and info.value.body["type"] == "invalid_request_error"
    assert core.requests == []


def test_saturated_core_answers_429_with_retry_after():
    error = Overloaded("server saturated: 8 running, 16 queued", retry_after_s=2.2)
    with served(FakeRouterCore(admission_error=error)) as (_, base, client):
        with pytest.raises(openai.RateLimitError) as info:
            create(client, stream=True)
        raw = httpx.post(f"{base}/v1/chat/completions", json={"model": "fake-qwen2-vl", "messages": USER})
    assert info.value.response.headers["retry-after"] == "3" and "server saturated" in info.value.message
    assert raw.status_code == 429 and raw.headers["retry-after"] == "3"
    assert raw.json() == {"error": {"message": "server saturated: 8 running, 16 queued", "type": "rate_limit_error",
                                    "param": None, "code": 429}}


def test_unexpected_core_error_is_a_500_without_a_traceback():
    with served(FakeRouterCore(admission_error=KeyError("secret internals"))) as (_, _, client):
        with pytest.raises(openai.InternalServerError) as info:
            create(client)
    assert "internal server error" in info.value.message and "secret" not in str(info.value.body)


def test_failure_mid_stream_reaches_the_client_as_an_api_error():
    with served(FakeRouterCore(fail_after=2)) as (_, _, client):
        with pytest.raises(openai.APIError, match="decode worker 127.0.0.1:1 failed"):
            list(create(client, stream=True))


def test_failure_before_any_output_is_an_http_status_even_when_streaming():
    with served(FakeRouterCore(fail_after=0)) as (_, _, client):
        with pytest.raises(openai.InternalServerError) as info:
            create(client, stream=True)
    assert info.value.status_code == 502 and info.value.body["type"] == "server_error"


def test_client_leaving_a_stream_cancels_the_core():
    core = FakeRouterCore(make_events(["a", "b", "c"]), hang_after=2)
    with served(core) as (_, _, client):
        stream = create(client, stream=True)
        first = [next(iter(stream)) for _ in range(2)]
        assert first[1].choices[0].delta.content == "a"
        stream.close()
        assert core.wait_cancelled(5), "the core's stream was not closed after the client left"
    assert core.completed == []


def test_client_leaving_a_non_stream_request_cancels_the_core():
    core = FakeRouterCore(hang_after=1)
    with served(core) as (_, _, client):
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).chat.completions.create(model="fake-qwen2-vl", messages=USER)
        assert core.wait_cancelled(5)


def test_client_leaving_a_stream_before_its_first_event_cancels_the_core():
    # the wait for the first event watches the connection (no polling): a hang-up ends it at once
    core = FakeRouterCore(hang_after=0)
    with served(core) as (_, _, client):
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).chat.completions.create(model="fake-qwen2-vl", messages=USER,
                                                                      stream=True)
        assert core.wait_cancelled(5)


def test_async_client_streams():
    async def run(base: str) -> str:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(model="fake-qwen2-vl", messages=USER, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

    with served() as (_, base, _):
        assert asyncio.run(run(base)) == "Hello, world!"


def image_request(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def test_image_parts_reach_the_core_as_sent():
    # the front end only translates: the core's pipeline resolves media (tests/router/test_pipeline.py)
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    with served() as (core, _, client):
        create(client, messages=image_request(url))
    assert core.requests[0].messages[0]["content"] == [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "What is this?"}]


def test_models_health_and_metrics():
    with served() as (core, base, client):
        assert [m.id for m in client.models.list()] == ["fake-qwen2-vl"]
        assert client.models.retrieve("fake-qwen2-vl").id == "fake-qwen2-vl"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        core.health_status = "degraded"
        assert httpx.get(f"{base}/health").status_code == 503
        metrics = httpx.get(f"{base}/metrics")
        assert metrics.headers["content-type"].startswith("text/plain") and b"epd_router_requests_total 3.0" \
            in metrics.content
        missing = httpx.get(f"{base}/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_invalid_json_and_invalid_fields_are_openai_errors():
    with served() as (_, base, client):
        bad_json = httpx.post(f"{base}/v1/chat/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        with pytest.raises(openai.BadRequestError, match=r"temperature must be in \[0, 2\], got 3.0"):
            create(client, temperature=3)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]


def test_server_stops_promptly_after_a_hanging_stream():
    # A stream the client abandons must not keep uvicorn from shutting down.
    core = FakeRouterCore(hang_after=1)
    started = time.monotonic()
    with served(core) as (_, _, client):
        stream = create(client, stream=True)
        next(iter(stream))
        stream.close()
    assert time.monotonic() - started < 8


def test_a_model_the_server_does_not_serve_is_a_404_and_a_served_one_is_echoed():
    core = FakeRouterCore()
    core.served_model_names = ("fake-qwen2-vl", "alias")
    with serve_app(build_app(core)) as base:
        missing = httpx.post(f"{base}/v1/chat/completions", json={"model": "gpt-4o", "messages": USER}, timeout=10)
        assert missing.status_code == 404
        assert missing.json()["error"]["param"] == "model" and "'gpt-4o' does not exist" in missing.text
        assert not core.requests, "refused before any work"
        ok = httpx.post(f"{base}/v1/chat/completions", json={"model": "alias", "messages": USER}, timeout=10)
        assert ok.status_code == 200 and ok.json()["model"] == "alias"
        listed = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in listed] == ["fake-qwen2-vl", "alias"]
        assert httpx.get(f"{base}/v1/models/alias", timeout=10).status_code == 200
        assert httpx.get(f"{base}/v1/models/gpt-4o", timeout=10).status_code == 404


def test_continuous_usage_stats_put_usage_on_every_chunk_and_unknown_stream_options_are_a_400():
    with served() as (_, base, client):
        chunks = list(create(client, stream=True, stream_options={"include_usage": True},
                             extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
        with pytest.raises(openai.BadRequestError, match="stream_options.frobnicate"):
            create(client, stream=True, extra_body={"stream_options": {"frobnicate": True}})
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    completions = [c.usage.completion_tokens for c in with_choices]
    assert completions == sorted(completions) and completions[-1] == 4 and chunks[-1].usage.completion_tokens == 4


class FloodCore(FakeRouterCore):
    """Streams 8 MB to a request whose message is "flood" (far past what the kernel buffers for a
    client that reads nothing), counting what it gave; scripted events to the others."""

    yielded = 0

    async def generate(self, request):
        if request.messages[0]["content"] != "flood":
            async for event in super().generate(request):
                yield event
            return
        self.requests.append(request)
        try:
            for event in make_events(["x" * 2000] * 4000):  # 8 MB: far past what the kernel buffers
                await asyncio.sleep(0)
                self.yielded += 1
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            self._cancelled_event.set()
            raise


def test_a_client_that_stops_reading_holds_up_only_its_own_stream():
    """The stream is written by its own pump: one stalled at the socket's flow control (its client
    reads nothing) stops taking events and leaves the others alone, and its client leaving cancels
    its request."""
    core = FloodCore(make_events(["Hello", "!"]))
    with served(core) as (_, base, client):
        host, port = base.removeprefix("http://").split(":")
        stalled = stalled_flood(host, int(port))
        try:
            progress = []
            for _ in range(20):  # until the flood stops taking events: its pump waits at the socket
                time.sleep(0.25)
                progress.append(core.yielded)
                if len(progress) > 2 and progress[-1] == progress[-3] > 0:
                    break
            assert 0 < progress[-1] < 4000 and progress[-1] == progress[-3], progress
            for _ in range(3):
                chunks = list(create(client, messages=[{"role": "user", "content": "hi"}], stream=True))
                assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello!"
            assert core.yielded == progress[-1] and core.cancelled == [] and len(core.completed) == 3
        finally:
            stalled.close()
        assert core.wait_cancelled(10), "the stalled client left, but its request was not cancelled"
    assert core.cancelled == [core.requests[0].request_id]


def stalled_flood(host: str, port: int):
    """A client that asks for the flood and reads nothing (a small receive buffer)."""
    body = json.dumps({"model": "fake-qwen2-vl", "messages": [{"role": "user", "content": "flood"}],
                       "stream": True}).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.settimeout(10)
    stalled.connect((host, port))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return stalled


def test_a_stream_stuck_on_a_client_that_reads_nothing_is_cut_past_its_deadline(monkeypatch):
    """Its request would hold its admission slot for as long as the client stays connected: past the
    request's deadline (and a grace) the stream is cut and the request cancelled."""
    from epd.router.openai import streaming
    monkeypatch.setattr(streaming, "_OVERDUE_GRACE_S", 0.2)
    core = FloodCore(make_events(["Hello", "!"]))
    core.request_timeout_s = 1.0
    with served(core) as (_, base, _):
        host, port = base.removeprefix("http://").split(":")
        stalled = stalled_flood(host, int(port))
        try:
            started = time.monotonic()
            assert core.wait_cancelled(10), "a stream stuck past its deadline was never cut"
            assert 1.0 <= time.monotonic() - started < 5 and 0 < core.yielded < 4000
        finally:
            stalled.close()


def test_a_frame_that_cannot_be_spelled_ends_the_stream_with_an_error_and_cancels_at_once(monkeypatch):
    from epd.router.openai import chat
    spell = chat._ChatFrames.event
    calls = []

    def broken(self, event):
        calls.append(event)
        if len(calls) == 2:
            raise KeyError("a bug")
        return spell(self, event)

    monkeypatch.setattr(chat._ChatFrames, "event", broken)
    core = FakeRouterCore(make_events(["a", "b", "c"]), hang_after=2)
    with served(core) as (_, _, client):
        with pytest.raises(openai.APIError, match="internal server error"):
            list(create(client, stream=True))
        started = time.monotonic()
        assert core.wait_cancelled(3) and time.monotonic() - started < 3  # not after the 5 s linger


def test_logprobs_stream_no_empty_chunk_for_an_output_with_no_tokens():
    events = make_events(["Hi", "!"], with_logprobs=True, finish_reason=None)
    events.append(StreamEvent(token_ids=[], text="", finish_reason="stop"))
    with served(FakeRouterCore(events)) as (_, _, client):
        chunks = list(create(client, stream=True, logprobs=True, top_logprobs=1))
    with_logprobs = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert [c.choices[0].delta.content for c in with_logprobs] == ["Hi", "!"]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stopping_cancels_every_request_still_being_read_before_the_backend_closes():
    from epd.router.openai.streaming import CorePump, stop_pumps
    from epd.types import ChatRequest, SamplingParams

    async def main():
        core = FakeRouterCore(make_events(["a", "b"]), hang_after=1)
        request = ChatRequest(messages=USER, sampling=SamplingParams(max_tokens=4), request_id="chatcmpl-stop")
        pump = CorePump(core, request)
        assert (await pump.next(None)).text == "a"  # the request is running, its reader parked
        stopped = await stop_pumps(timeout_s=2)
        return stopped, core.cancelled

    assert asyncio.run(main()) == (1, ["chatcmpl-stop"])
