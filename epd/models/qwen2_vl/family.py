"""Qwen2-VL and Qwen2.5-VL: identical LLM (Qwen2 decoder), different vision towers. This module
owns both families: weights, the vision tower, the input processor and the M-RoPE layout."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from epd.models.checkpoint import iter_weight_slices, read_config
from epd.models.layers import PackedLinear, default_weight_loader, skipping_init
from epd.models.parallel import SINGLE, TensorParallel
from epd.models.qwen2_vl.llm import Qwen2ForCausalLM, Qwen2TextConfig
from epd.models.spec import MultimodalSpec
from epd.multimodal.layout import PromptLayout, build_prompt_layout
from epd.multimodal.processor_kwargs import MediaSettings
from epd.types import MultimodalItemSpan

# checkpoints name the LLM weights in two layouts: transformers 4.x/5.x saves
# "model.layers.*"/"lm_head.*"; some exports use "model.language_model.layers.*"
_LLM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIP_PREFIXES = ("visual.", "model.visual.")


def text_config_from_hf(hf: dict) -> Qwen2TextConfig:
    """Accept both the nested (``text_config``) and the older flat config layouts."""
    text = {**hf, **hf.get("text_config", {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section") or hf.get("rope_scaling", {}).get("mrope_section")
    if not section:
        raise ValueError("config has no mrope_section (rope_parameters / rope_scaling)")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return Qwen2TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", text.get("rope_theta", 1_000_000.0)),
        mrope_section=tuple(section), tie_word_embeddings=bool(tie),
        max_position_embeddings=text.get("max_position_embeddings", 32768))


def _canonical_llm_name(name: str) -> str | None:
    if name.startswith(_SKIP_PREFIXES):
        return None
    if name.startswith("lm_head."):
        return name
    for prefix in _LLM_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def load_llm_weights(model: Qwen2ForCausalLM, model_dir: Path) -> None:
    """Every LLM weight of the checkpoint into ``model``, read lazily: a tensor-parallel layer
    (``epd.models.parallel``) reads only its own rows or columns from the file."""
    params = dict(model.named_parameters())
    loaded = set()
    for ckpt_name, lazy in iter_weight_slices(model_dir):
        name = _canonical_llm_name(ckpt_name)
        if name is None or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        for ckpt_part, (packed, shard) in model.packed_modules_mapping.items():
            if f".{ckpt_part}." in name:
                target = name.replace(f".{ckpt_part}.", f".{packed}.")
                module_name, param_name = target.rsplit(".", 1)
                model.get_submodule(module_name).load_shard(param_name, lazy, shard)
                loaded.add(f"{target}#{shard}")
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint weight {ckpt_name!r} has no place in the LLM")
            module_name, _, param_name = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            if param_name == "weight" and hasattr(module, "load_weight"):
                module.load_weight(lazy)
            else:
                default_weight_loader(params[name], lazy[:])
            loaded.add(name)
    _check_all_loaded(model, loaded, model_dir)


def _check_all_loaded(model: Qwen2ForCausalLM, loaded: set[str], model_dir: Path) -> None:
    expected = set()
    for name, _ in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(module, PackedLinear):
            expected |= {f"{name}#{i}" for i in range(module.num_shards)}
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks LLM weights {missing[:8]}")


def build_llm(model_class: type, cfg, model_dir: Path, *, device: str, dtype: torch.dtype,
              tp: TensorParallel = SINGLE):
    """``model_class(cfg, tp)`` with the checkpoint's weights, straight to ``device`` in ``dtype``,
    one checkpoint tensor at a time: no float32 copy of the whole model on the host first (30 GB for
    a 7B model), and with ``tp`` only this rank's part of each."""
    with torch.device("meta"), skipping_init():
        model = model_class(cfg, tp).to(dtype)  # on meta: no memory yet
    model = model.to_empty(device=device)  # the rotary frequencies are recomputed, in float32
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_llm_weights(model, Path(model_dir))
    return model.eval()


class QwenVLFamily:
    supports_tensor_parallel = True  # its LLM takes a ``tp`` (epd.models.parallel)

    def __init__(self, name: str) -> None:
        self.name = name

    def load_llm(self, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tp: TensorParallel = SINGLE) -> Qwen2ForCausalLM:
        return build_llm(Qwen2ForCausalLM, text_config_from_hf(read_config(model_dir)), model_dir, device=device,
                         dtype=dtype, tp=tp)

    def load_vision(self, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from epd.models.qwen2_vl.vision import QwenVisionEncoder
        return QwenVisionEncoder(model_dir, dtype=dtype, device=device)

    def mm_spec(self, model_dir: Path) -> MultimodalSpec:
        hf = read_config(model_dir)
        text = text_config_from_hf(hf)
        return MultimodalSpec.from_config(
            hf, vocab_size=text.vocab_size, embedding_dim=text.hidden_size,
            tokens_per_second=float(hf["vision_config"].get("tokens_per_second") or 0) if self.name == "qwen2_5_vl"
            else 0.0)

    def media_settings(self, model_dir: Path) -> MediaSettings:
        from epd.models.qwen2_vl.processor import media_settings_for
        return media_settings_for(model_dir)

    def input_processor(self, model_dir: Path, tokenizer):
        from epd.models.qwen2_vl.processor import QwenVLInputProcessor
        model_dir = Path(model_dir)
        return QwenVLInputProcessor(model_dir, tokenizer, self.mm_spec(model_dir), model_id=str(model_dir))

    def prompt_layout(self, spec: MultimodalSpec, token_ids: Sequence[int],
                      items: Sequence[MultimodalItemSpan]) -> PromptLayout:
        from epd.models.qwen2_vl.mrope import compute_mrope_positions

        def positions(n: int, spans: Sequence[MultimodalItemSpan]):
            # a video's temporal positions step by seconds on Qwen2.5-VL (tokens_per_second > 0)
            return compute_mrope_positions(n, [(s.offset, s.grid_thw, _interval(s, spec)) for s in spans],
                                           spec.spatial_merge_size)

        return build_prompt_layout(token_ids, items, mm_token_ids=spec.mm_token_ids, positions_fn=positions)


def _interval(span: MultimodalItemSpan, spec: MultimodalSpec) -> float:
    if span.second_per_grid_t and spec.tokens_per_second:
        return spec.tokens_per_second * span.second_per_grid_t
    return 1.0


QWEN2_VL = QwenVLFamily("qwen2_vl")
QWEN2_5_VL = QwenVLFamily("qwen2_5_vl")
