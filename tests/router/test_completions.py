"""/v1/completions, /tokenize, /detokenize, /version and HEAD /health, over the real pipeline (a
scripted backend): a text or token-id prompt without the chat template, streaming, echo, legacy
logprobs, the shared sampling rules; tokenize counts what generation counts, images included."""
from __future__ import annotations

import httpx
import openai
import pytest

from epd.router.openai.app import build_app
from tests.conftest import make_image_bytes
from tests.router.fake_backend import ScriptedBackend
from tests.router.fake_core import serve_app
from tests.router.test_pipeline import make_pipeline, pieces


@pytest.fixture
def served(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["Hello", " there", "!"]), finish_reason="length")
    pipeline = make_pipeline(model_dir, backend)
    with serve_app(build_app(pipeline, tokenizer=tokenizer)) as base:
        yield backend, base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_dir():
    from epd.models.locate import resolve_model
    return resolve_model("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from epd.models.tokenizer_loading import load_tokenizer
    return load_tokenizer(model_dir)


def test_a_text_prompt_runs_as_it_is_without_the_chat_template(served, tokenizer):
    backend, _, client = served
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == "Hello there!"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert backend.jobs[0].prompt.prompt_token_ids == tokenizer.encode("Once upon a time", add_special_tokens=False)
    ids = client.completions.create(model="tiny", prompt=[9707, 11, 1879], max_tokens=3)
    assert backend.jobs[1].prompt.prompt_token_ids == [9707, 11, 1879] and ids.choices[0].text == "Hello there!"
    assert backend.jobs[2 - 1].sampling.max_tokens == 3
    client.completions.create(model="tiny", prompt="x")
    assert backend.jobs[2].sampling.max_tokens == 16  # OpenAI's and vLLM's default here


def test_streaming_echo_and_legacy_logprobs(served):
    _, _, client = served
    chunks = list(client.completions.create(model="tiny", prompt="Hi", stream=True, max_tokens=3))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello there!"
    assert chunks[-1].choices[0].finish_reason == "length"
    echoed = client.completions.create(model="tiny", prompt="Say:", echo=True, max_tokens=3)
    assert echoed.choices[0].text == "Say:Hello there!"
    streamed = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="Say:", echo=True,
                                                                      max_tokens=3, stream=True) if c.choices]
    assert streamed[0] == "Say:" and "".join(streamed) == "Say:Hello there!"  # the prompt first, as its own piece
    with_logprobs = client.completions.create(model="tiny", prompt="Hi", logprobs=2, max_tokens=3)
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 3
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])


def test_continuous_usage_stats_put_the_usage_so_far_on_every_streamed_chunk(served):
    _, _, client = served
    chunks = list(client.completions.create(
        model="tiny", prompt="Hi", stream=True, max_tokens=3,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    completions = [c.usage.completion_tokens for c in with_choices]
    assert completions == sorted(completions) and completions[0] >= 1 and completions[-1] == 3
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens} and chunks[-1].usage.prompt_tokens > 0
    plain = list(client.completions.create(model="tiny", prompt="Hi", stream=True, max_tokens=3,
                                           stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


@pytest.mark.parametrize("fields, match", [
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": "x", "suffix": "y"}, "suffix must be unset"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo must be false with logprobs"),
    ({"prompt": "x", "logprobs": 9}, r"logprobs must be in \[0, 5\]"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools is a chat completions field"),
    ({"prompt": "x", "chat_template_kwargs": {"add_vision_id": True}}, "chat_template_kwargs is a chat completions"),
    ({"prompt": "x", "mm_processor_kwargs": {"max_pixels": 50176}}, "mm_processor_kwargs is a chat completions"),
    ({"prompt": "x", "store": True}, "store is not supported"),
    ({"prompt": [10**9]}, r"prompt token ids must be in \[0, \d+\)"),
    ({"prompt": "x", "temperature": 5}, r"temperature must be in \[0, 2\]"),
])
def test_what_completions_refuse_is_a_400_naming_it(served, fields, match):
    backend, base, _ = served
    response = httpx.post(f"{base}/v1/completions", json={"model": "tiny", **fields}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"], response.text
    import re
    assert re.search(match, response.json()["error"]["message"]), response.json()
    assert backend.jobs == []


def test_tokenize_counts_what_generation_counts_and_detokenize_inverts_it(served, tokenizer):
    backend, base, client = served
    image = make_image_bytes(64, 48, seed=3)
    import base64
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    counted = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": messages}, timeout=30).json()
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert counted["tokens"] == backend.jobs[0].prompt.prompt_token_ids
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 4096
    text = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert text["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    back = httpx.post(f"{base}/detokenize", json={"tokens": text["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and "tokens must be in" in bad.json()["error"]["message"]
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x", "model": "gpt-4"}, timeout=30).status_code == 404


def test_version_and_head_health(served):
    _, base, _ = served
    assert httpx.get(f"{base}/version", timeout=10).json()["version"]
    head = httpx.head(f"{base}/health", timeout=10)
    assert head.status_code in (200, 503) and head.content == b""
