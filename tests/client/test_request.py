"""Pure conversions: SDK inputs -> ChatGenerateRequest, and the front end's stop-string matching."""
from __future__ import annotations

import pytest

from epd.client import InvalidRequest
from epd.client.request import build_request


def test_prompt_becomes_one_user_message_with_images_first():
    request = build_request("Describe", images=[b"img", "data:image/png;base64,AAAA", "https://x/y.png"])
    (message,) = request.messages
    assert message.role == "user"
    assert [p.WhichOneof("part") for p in message.content] == ["image_bytes", "image_url", "image_url", "text"]
    assert message.content[1].image_url == "data:image/png;base64,AAAA"


def test_images_attach_to_the_last_user_message():
    request = build_request([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "user", "content": [{"type": "text", "text": "c"}]}], images=[b"i"])
    assert [len(m.content) for m in request.messages] == [1, 1, 2]
    assert request.messages[2].content[0].image_bytes == b"i"


def test_sampling_unset_is_zero_and_set_fields_travel():
    assert not build_request("x").sampling.HasField("seed")
    assert not build_request("x").sampling.HasField("logprobs")
    sampling = build_request("x", max_tokens=3, top_k=-1, seed=0, logprobs=5).sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, sampling.logprobs) == (3, -1, 0, 5)
    assert not sampling.HasField("repetition_penalty") and not sampling.logit_bias
    processed = build_request("x", presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1,
                              logit_bias={42: 5, 7: -100}).sampling
    assert (processed.presence_penalty, processed.frequency_penalty, processed.min_p) == pytest.approx((0.5, -1.0, 0.1))
    assert processed.repetition_penalty == pytest.approx(1.2) and dict(processed.logit_bias) == {42: 5.0, 7: -100.0}
    with pytest.raises(TypeError, match="frequncy_penalty"):
        build_request("x", frequncy_penalty=1.0)  # a misspelt option is an error, not ignored
    assert build_request("x", stop="END").stop == ["END"]


@pytest.mark.parametrize("messages, images, match", [
    ([], (), "non-empty list of messages"),
    ({"role": "user", "content": "x"}, (), "non-empty list of messages"),
    ([{"content": "x"}], (), r"messages\[0\]"),
    ([{"role": "user", "content": [{"type": "audio"}]}], (), r"messages\[0\].content\[0\].*'audio'"),
    ([{"role": "system", "content": "x"}], [b"i"], "user message"),
    ("x", [3.5], r"images\[0\].*float"),
    ("x", ["/no/such/file.png"], "cannot read image file"),
])
def test_bad_inputs_are_invalid_before_any_call(messages, images, match):
    with pytest.raises(InvalidRequest, match=match):
        build_request(messages, images=images)
