"""The zero-cost model (a benchmark tool): real prompts, row counts and handles, no arithmetic,
tokens fixed by position, and the same tokens in one process and across the split."""
from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.locate import resolve_model
from epd.models.null.checkpoint import NULL_PRESETS, NullSpec, write_null_checkpoint
from epd.models.presets import IMAGE_TOKEN_ID
from epd.models.registry import family_for, load_llm_for
from epd.types import SamplingParams
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message

IMAGES = [make_image_bytes(448, 300, seed=1), make_image_bytes(100, 900, seed=2)]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("null-qwen2-vl")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir))


def test_the_preset_is_served_by_name_and_its_llm_has_no_weights(model_dir):
    assert "null-qwen2-vl" in NULL_PRESETS and type(family_for(model_dir)).__name__ == "NullFamily"
    model = load_llm_for(model_dir, EngineConfig())
    assert sum(p.numel() for p in model.parameters()) == 0
    assert not list(model_dir.glob("*.safetensors"))


def test_each_image_gets_the_rows_transformers_processor_gives_it(llm, model_dir):
    spec = NULL_PRESETS["null-qwen2-vl"]
    processor = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, patch_size=14,
                                         temporal_patch_size=2, merge_size=2)
    grids = processor(images=[Image.open(io.BytesIO(b)) for b in IMAGES], return_tensors="pt")["image_grid_thw"]
    seq = llm.add_conversation(user_message("Describe.", IMAGES), SamplingParams(max_tokens=4))
    assert [item.length for item in seq.mm_items] == (grids.prod(-1) // 4).tolist()
    assert seq.token_ids.count(IMAGE_TOKEN_ID) == int(grids.prod(-1).sum()) // 4
    rows = llm.vision.encode_images(IMAGES)  # the rows prefill would get: zeros of the hidden width
    assert [tuple(r.shape) for r in rows] == [(n, spec.hidden_size) for n in (grids.prod(-1) // 4).tolist()]


def test_tokens_are_fixed_by_position_whatever_the_sampling_and_run_to_max_tokens(llm):
    messages = user_message("Tell me a story.", IMAGES[:1])
    greedy = llm.chat(messages, SamplingParams(max_tokens=40))[0]
    sampled = llm.chat(messages, SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7))[0]
    assert greedy.token_ids == sampled.token_ids and len(greedy.token_ids) == 40 and greedy.finish_reason == "length"
    assert len(set(greedy.token_ids)) > 30  # a position -> token map that varies, not one token
    spec = NULL_PRESETS["null-qwen2-vl"]
    assert all(spec.first_token_id <= t < spec.num_logits for t in greedy.token_ids)
    assert llm.tokenizer.decode(greedy.token_ids).strip()  # whole BPE pieces: text


def test_the_kv_and_rows_have_the_configured_size(tmp_path):
    spec = NullSpec(hidden_size=512, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                    num_logits=1024)
    model_dir = write_null_checkpoint(tmp_path / "null", spec)
    llm = LLM(str(model_dir), engine_config=EngineConfig(block_size=16, num_kv_blocks=64))
    kv = llm.engine.runner.kv_cache
    head_dim = spec.hidden_size // spec.num_attention_heads
    assert len(kv.k) == len(kv.v) == 3 and tuple(kv.k[0].shape) == (64 * 16, 4, head_dim)  # slots x heads x dim
    assert kv.bytes_per_slot == 2 * 3 * 4 * head_dim * 4  # what a token's KV handle weighs (float32)
    assert llm.vision.encode_images(IMAGES[:1])[0].shape[1] == 512


def test_a_bad_spec_is_refused_naming_it():
    with pytest.raises(ValueError, match="hidden_size 100 must split into num_attention_heads 12"):
        NullSpec(hidden_size=100)
    with pytest.raises(ValueError, match=r"step_ms must be in \[0, 60000\], got -1"):
        NullSpec(step_ms=-1)


def test_a_paced_checkpoint_sleeps_each_forward_and_gives_the_same_tokens(tmp_path, llm, monkeypatch):
    """``step_ms``: every forward waits that long asleep (a device's step, no CPU); the tokens stay."""
    import epd.models.null.llm as null_llm

    paced = LLM(str(write_null_checkpoint(tmp_path / "paced", NullSpec(step_ms=25))))
    slept: list[float] = []
    monkeypatch.setattr(null_llm.time, "sleep", slept.append)
    messages = user_message("Tell me a story.", IMAGES[:1])
    out = paced.chat(messages, SamplingParams(max_tokens=6))[0]
    assert out.token_ids == llm.chat(messages, SamplingParams(max_tokens=6))[0].token_ids
    assert len(slept) >= 6 and set(slept) == {0.025}  # the prompt's chunk(s) and each decode step


@pytest.mark.slow
def test_across_the_split_the_tokens_equal_the_in_process_ones(llm, model_dir):
    from epd.router.sync import SyncRouter
    from epd.server.local import LocalCluster

    messages = user_message("Describe both.", IMAGES)
    expected = llm.chat(messages, SamplingParams(max_tokens=24))[0]
    with LocalCluster(str(model_dir)) as cluster, SyncRouter.over_workers(
            model_dir, encoders=cluster.encoders, prefills=cluster.prefills, decodes=cluster.decodes) as router:
        out = router.chat(messages, SamplingParams(max_tokens=24))
    assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids
