"""Preset checkpoints: the registry, the cache, and that transformers loads and runs what we write."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import epd.models
from epd.models.cache import atomic_directory, epd_cache_dir
from epd.models.locate import resolve_model
from epd.models.presets import (
    IMAGE_TOKEN_ID,
    PRESETS,
    PresetSpec,
    TextDims,
    VisionDims,
    build_preset_model,
    load_processor,
    write_preset_checkpoint,
)

TINY = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]
SMALL = ["small-qwen2-vl", "small-qwen2.5-vl"]
REPO_ROOT = Path(epd.models.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def torch_threads():
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module", params=TINY)
def tiny(request, torch_threads):
    """(name, checkpoint dir, model, processor) of one tiny preset."""
    from transformers import AutoModelForImageTextToText

    path = resolve_model(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return request.param, path, model, load_processor(path)


def _expected_image_tokens(height: int, width: int, spec: PresetSpec) -> int:
    """Qwen2-VL smart resize, written out independently of transformers."""
    factor = spec.vision.patch_size * spec.vision.spatial_merge_size
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


def _image(width: int, height: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _inputs(processor, text: str, image=None):
    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(images=[image] if image is not None else None, text=[prompt], return_tensors="pt")


def _greedy(model, inputs, num_tokens: int = 32) -> list[int]:
    out = model.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# --- registry and resolution (no model built) ---


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_dims_are_consistent(name):
    spec = PRESETS[name]
    text = spec.text
    assert text.num_key_value_heads < text.num_attention_heads  # GQA
    assert sum(text.mrope_section) == text.head_dim // 2
    qwen3 = spec.family == "qwen3_vl"
    assert spec.vision.patch_size == (16 if qwen3 else 14) and spec.vision.spatial_merge_size == 2
    assert spec.vision.temporal_patch_size == 2
    assert spec.init_std > 0.02
    family = "qwen3_vl" if "qwen3" in name else "qwen2_5_vl" if "2.5" in name else "qwen2_vl"
    assert name.startswith(("tiny", "small")) and spec.family == family
    if qwen3:  # deepstack levels, and the learned position grid is a square
        assert spec.vision.deepstack_visual_indexes and int(spec.vision.num_position_embeddings ** 0.5) ** 2 == \
            spec.vision.num_position_embeddings


def test_invalid_dims_are_rejected():
    with pytest.raises(ValueError, match="mrope_section"):
        TextDims(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionDims(depth=1, embed_dim=30, num_heads=3, intermediate_size=60)
    spec = PRESETS["tiny-qwen2-vl"]
    with pytest.raises(ValueError, match="family"):
        PresetSpec(family="llava", text=spec.text, vision=spec.vision,  # type: ignore[arg-type]
                   min_pixels=3136, max_pixels=9999)


def test_resolve_model_errors_are_actionable(tmp_path):
    with pytest.raises(ValueError, match="tiny-qwen2-vl, small-qwen2-vl, tiny-qwen2.5-vl, small-qwen2.5-vl"):
        resolve_model("tiny-llama")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown preset"):
        write_preset_checkpoint("nope", tmp_path / "x")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_atomic_directory_keeps_the_first_complete_copy(tmp_path):
    final = tmp_path / "entry"
    with atomic_directory(final) as tmp:
        (tmp / "mine").write_text("1")
        final.mkdir()
        (final / "theirs").write_text("2")  # another process finished first
    assert [p.name for p in final.iterdir()] == ["theirs"]
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "failed") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("build failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no partial entry, no temp left


# --- tiny checkpoints, loaded and run by transformers ---


def test_checkpoint_files_and_config(tiny):
    name, path, model, _ = tiny
    spec = PRESETS[name]
    for file in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"]:
        assert (path / file).is_file(), file
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == spec.family
    assert config["image_token_id"] == IMAGE_TOKEN_ID and config["video_token_id"] == 151656
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (151652, 151653)
    text = config["text_config"]
    assert text["vocab_size"] == 151936
    assert text["rope_parameters"]["mrope_section"] == list(spec.text.mrope_section)
    assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (151643, 151645, 151643)
    assert config["tie_word_embeddings"] == spec.text.tie_word_embeddings
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert pre["size"] == {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643] and generation["do_sample"] is False


def test_loaded_weights_are_the_seeded_ones(tiny):
    import torch

    name, _, model, _ = tiny
    assert type(model).__name__ == ("Qwen2VLForConditionalGeneration" if "2-vl" in name else
                                    "Qwen2_5_VLForConditionalGeneration")
    assert model.dtype == torch.float32
    rebuilt = build_preset_model(PRESETS[name], seed=PRESETS[name].seed).state_dict()
    loaded = model.state_dict()
    assert rebuilt.keys() == loaded.keys()
    assert all(torch.equal(rebuilt[k], loaded[k]) for k in rebuilt)
    other = build_preset_model(PRESETS[name], seed=PRESETS[name].seed + 1).state_dict()
    assert not torch.equal(other["model.language_model.layers.0.self_attn.q_proj.bias"],
                           loaded["model.language_model.layers.0.self_attn.q_proj.bias"])


@pytest.mark.parametrize(("width", "height"), [(333, 517), (1000, 800), (30, 40)])
def test_processor_expands_image_placeholder(tiny, width, height):
    name, _, _, processor = tiny
    inputs = _inputs(processor, "Describe this image.", _image(width, height))
    expected = _expected_image_tokens(height, width, PRESETS[name])
    assert int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == expected
    assert int(inputs["image_grid_thw"].prod()) == inputs["pixel_values"].shape[0] == expected * 4
    assert inputs["mm_token_type_ids"].shape == inputs["input_ids"].shape


def test_greedy_text_output_varies(tiny):
    _, _, model, processor = tiny
    tokens = _greedy(model, _inputs(processor, "Write a short poem about the sea."))
    assert len(tokens) == 32 and len(set(tokens)) >= 8, tokens


def test_greedy_image_output_varies_and_depends_on_the_image(tiny):
    _, _, model, processor = tiny
    first = _greedy(model, _inputs(processor, "What is in the picture?", _image(333, 517, seed=1)))
    second = _greedy(model, _inputs(processor, "What is in the picture?", _image(333, 517, seed=2)))
    assert len(set(first)) >= 8, first
    assert first != second


def test_processor_without_torchvision_rejects_video(tiny):
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        pytest.skip("torchvision is installed: load_processor returns AutoProcessor")
    with pytest.raises(ValueError, match="torchvision"):
        tiny[3](text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[_image(56, 56)] * 2])


# --- slower: small presets, explicit seeds, concurrent writers ---


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_small_preset_loads(name, torch_threads):
    from transformers import AutoModelForImageTextToText

    path = resolve_model(name)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.text_config.hidden_size == PRESETS[name].text.hidden_size
    assert model.config.vision_config.depth == PRESETS[name].vision.depth
    inputs = _inputs(load_processor(path), "Hi", _image(333, 517))
    assert int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == _expected_image_tokens(517, 333, PRESETS[name])


@pytest.mark.slow
def test_write_preset_checkpoint_with_seed_replaces_and_differs(tmp_path, torch_threads):
    from safetensors import safe_open

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale").write_text("old")
    assert write_preset_checkpoint("tiny-qwen2-vl", out, seed=123) == out
    assert not (out / "stale").exists()
    assert json.loads((out / "epd_preset.json").read_text())["seed"] == 123
    key = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(out / "model.safetensors", "pt") as mine, \
            safe_open(resolve_model("tiny-qwen2-vl") / "model.safetensors", "pt") as default:
        assert not mine.get_tensor(key).equal(default.get_tensor(key))


@pytest.mark.slow
def test_concurrent_processes_resolve_one_complete_preset(tmp_path):
    import shutil

    # Share the built tokenizer so the two writers only race on the checkpoint itself.
    shutil.copytree(epd_cache_dir() / "tokenizer", tmp_path / "tokenizer")
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    code = "from epd.models.locate import resolve_model; print(resolve_model('tiny-qwen2-vl'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tmp_path / "presets" / "tiny-qwen2-vl")] * 2
    assert sorted(p.name for p in (tmp_path / "presets").iterdir()) == ["tiny-qwen2-vl"]  # no temp dirs left
    assert (tmp_path / "presets" / "tiny-qwen2-vl" / "model.safetensors").is_file()
