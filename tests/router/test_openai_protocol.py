"""OpenAI request -> ChatRequest conversion, validation messages, stop strings, response shapes."""
from __future__ import annotations

import pytest

from epd.errors import EPDError
from epd.router.openai.requests import parse_chat_body, to_chat_request
from epd.router.openai.responses import ChatCompletionChunk, DeltaMessage, StreamChoice, logprobs_content
from epd.types import TokenLogprobs

USER = [{"role": "user", "content": "hi"}]


def convert(**fields):
    return to_chat_request({"model": "m", "messages": USER, **fields}, "chatcmpl-1", default_max_tokens=64)


def refused(**fields) -> EPDError:
    with pytest.raises(EPDError) as info:
        convert(**fields)
    assert info.value.http_status == 400
    return info.value


def test_defaults_follow_openai():
    chat = convert()
    params = chat.sampling
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    assert params.max_tokens == 64 and params.min_tokens == 0 and params.seed is None
    assert params.logprobs is None and chat.stop_strings == [] and chat.request_id == "chatcmpl-1"


def test_all_sampling_fields_are_mapped():
    chat = convert(max_tokens=10, min_tokens=2, temperature=0, top_p=0.5, top_k=5, seed=7, stop=["a", "bc", "a"],
                   stop_token_ids=[3], ignore_eos=True, logprobs=True, top_logprobs=3, user="u", unknown_field=1)
    p = chat.sampling
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (10, 2, 0.0, 0.5, 5, 7)
    assert p.stop_token_ids == (3,) and p.ignore_eos and p.logprobs == 3
    assert chat.stop_strings == ["a", "bc"]


def test_max_completion_tokens_wins_and_single_stop_string():
    chat = convert(max_tokens=10, max_completion_tokens=20, stop="###")
    assert chat.sampling.max_tokens == 20 and chat.stop_strings == ["###"]


def test_penalties_min_p_and_logit_bias_become_sampling_params():
    sampling = convert(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, min_p=0.1,
                       logit_bias={"42": 5, "7": -100}).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.25, 1.3)
    assert sampling.min_p == 0.1 and sampling.logit_bias == ((7, -100.0), (42, 5.0))
    plain = convert().sampling
    assert not plain.has_logits_processors and plain.min_p == 0.0


def test_logprobs_without_top_is_zero():
    assert convert(logprobs=True).sampling.logprobs == 0
    assert convert(logprobs=False, top_logprobs=0).sampling.logprobs is None


@pytest.mark.parametrize("fields, param, fragment", [
    ({"n": 0}, "n", "n must be in [1, 16], got 0"),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens", "in [0, max_completion_tokens=4], got 5"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "in [0, 20], got 21"),
    ({"top_logprobs": 2}, "logprobs", "true when top_logprobs > 0"),
    ({"stop": ["x", ""]}, "stop", "non-empty"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"seed": 2**64}, "seed", "64-bit"),
    ({"max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"presence_penalty": 5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 5"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0}, "repetition_penalty", "in (0, 2], got 0"),
    ({"min_p": 1.5}, "min_p", "in [0, 1], got 1.5"),
    ({"logit_bias": {"12": 101}}, "logit_bias", "values in [-100, 100], got 101"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keyed by token ids"),
])
def test_invalid_values_say_expected_and_got(fields, param, fragment):
    err = refused(**fields)
    assert err.param == param and fragment in err.message, err.message


def test_message_validation_names_the_place():
    with pytest.raises(EPDError) as info:
        parse_chat_body({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert info.value.param == "messages[0].content[0].image_url.url"
    with pytest.raises(EPDError) as info:
        parse_chat_body({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert "'text', 'image_url'" in info.value.message
    with pytest.raises(EPDError, match="messages: List should have at least 1 item"):
        parse_chat_body({"messages": []})
    with pytest.raises(EPDError, match="expected a JSON object"):
        parse_chat_body([1, 2])


def test_messages_keep_image_urls_and_map_developer_role():
    body = {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what?"},
                                     {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                                     {"type": "image_url", "image_url": "http://example.com/a.png"}]},
        {"role": "assistant", "content": None}]}
    chat = to_chat_request(body, "r", default_max_tokens=8)
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.messages[1]["content"] == [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    assert chat.messages[2] == {"role": "assistant", "content": ""}


def test_logprobs_content_sorted_limited_and_finite():
    entries = [TokenLogprobs(5, float("-inf"), {5: float("-inf"), 6: -0.1, 7: -3.0})]
    [entry] = logprobs_content(entries, lambda t: f"é{t}", num_top=2)
    assert entry.token == "é5" and entry.logprob == -9999.0 and entry.bytes == list("é5".encode())
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("é6", -0.1), ("é7", -3.0)]


def test_chunk_json_omits_extensions_but_keeps_nulls():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[StreamChoice(delta=DeltaMessage(content="x"))])
    data = chunk.model_dump()
    assert data["choices"][0] == {"index": 0, "delta": {"content": "x"}, "finish_reason": None, "stop_reason": None,
                                  "logprobs": None}  # stop_reason: vLLM's, sent as it does
    assert "usage" not in data and "prompt_token_ids" not in data
