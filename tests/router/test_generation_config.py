"""A checkpoint's generation_config.json as vLLM reads it (``--generation-config auto``): the
sampling fields a request leaves unset take its values, its ``max_new_tokens`` is the default
max_tokens, and every EOS id it lists ends generation; over HTTP and gRPC alike. ``vllm`` turns it
off. The checkpoint here lists two EOS ids (the second one a token the model really emits) and a
default temperature of 0."""
from __future__ import annotations

import json

import pytest

from epd.models.generation_config import OPENAI_DEFAULTS, GenerationConfigError, generation_defaults
from epd.models.presets import write_preset_checkpoint
from epd.router.backends.in_process import InProcessBackend
from tests.router.test_pipeline import both_front_ends, make_pipeline

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
IM_END = 151645


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("gen") / "ckpt", seed=97)


def _serve(model_dir, mode: str):
    backend = InProcessBackend(model_dir)
    return make_pipeline(model_dir, backend, generation_config=mode)


def _chat(client, ignore_eos: bool = False, **fields):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, **fields, extra_body={
        "return_token_ids": True, **({"ignore_eos": True} if ignore_eos else {})})
    return out.choices[0].token_ids if hasattr(out.choices[0], "token_ids") else \
        out.choices[0].model_extra["token_ids"], out.choices[0].finish_reason


def test_the_checkpoints_defaults_and_eos_ids_apply_where_a_request_is_silent(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    with both_front_ends(_serve(model_dir, "auto")) as (client, _):
        greedy, _ = _chat(client, temperature=0, max_tokens=16, ignore_eos=True)
    stop_at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != IM_END)
    (model_dir / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [IM_END, greedy[stop_at]], "temperature": 0.0, "max_new_tokens": 12}))
    assert generation_defaults(model_dir).changed() == {"temperature": 0.0, "max_tokens": 12,
                                                        "eos_token_ids": (IM_END, greedy[stop_at])}
    with both_front_ends(_serve(model_dir, "auto")) as (client, sdk):
        tokens, finish = _chat(client)  # no temperature, no max_tokens: the checkpoint's
        assert (tokens[:stop_at], finish) == (greedy[:stop_at], "stop")  # greedy, and the second EOS ends it
        assert len(tokens) <= stop_at + 1
        tokens, finish = _chat(client, ignore_eos=True)
        assert (tokens, finish) == (greedy[:12], "length")  # max_new_tokens
        sampled, _ = _chat(client, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
        assert sampled != greedy[:12]  # a field the request sets is the request's
        over_grpc = sdk.chat(MESSAGES, ignore_eos=True)
        assert list(over_grpc.token_ids) == greedy[:12]
    with both_front_ends(_serve(model_dir, "vllm")) as (client, _):  # off: OpenAI's defaults, one EOS id
        tokens, _ = _chat(client, max_tokens=12, seed=5)
        assert tokens != greedy[:12] and len(tokens) == 12  # temperature 1, and greedy[stop_at] does not stop it


def test_a_bad_generation_config_names_the_file_and_the_field(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 3}))
    with pytest.raises(GenerationConfigError, match=r"generation_config.json: temperature must be in \[0, 2\], got 3"):
        generation_defaults(tmp_path)
    assert generation_defaults(tmp_path, "vllm") is OPENAI_DEFAULTS
    assert generation_defaults(tmp_path / "none") is OPENAI_DEFAULTS  # auto without a file: OpenAI's
    with pytest.raises(GenerationConfigError, match="--generation-config /nowhere: no generation_config.json"):
        generation_defaults(tmp_path, "/nowhere")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "eos_token_id": [1, "x"]}))
    with pytest.raises(GenerationConfigError, match="eos_token_id must be a token id or a list of them"):
        generation_defaults(tmp_path)


def test_epd_llm_without_sampling_params_takes_the_checkpoints_values_over_its_own(tmp_path):
    """vLLM's LLM rule (get_default_sampling_params): a call without SamplingParams gets ours with
    the values the file sets over them; given SamplingParams are the caller's, whole."""
    from epd.llm import LLM
    from epd.types import SamplingParams

    model_dir = write_preset_checkpoint("tiny-qwen2-vl", tmp_path / "ckpt", seed=98)
    (model_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "repetition_penalty": 1.2,
                                                                  "eos_token_id": [IM_END]}))
    llm = LLM(str(model_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.repetition_penalty, defaults.temperature) == (3, 1.2, 0.0)
    prompt = [[100 + i for i in range(12)]]
    assert len(llm.generate(prompt)[0].token_ids) <= 3
    assert len(llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8
