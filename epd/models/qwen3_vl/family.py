"""Qwen3-VL as a model family: the Qwen3 decoder on our engine, transformers' vision tower whose
output rows carry the deepstack levels beside the main embedding, and the Qwen-VL input processor
(images are placed and sized as for Qwen2-VL, with 16-pixel patches).

Deepstack over EPD: each embedding row an encoder makes is one packed tensor, ``[main | level 1 |
... | level L]`` (``(1 + L) * hidden`` wide), rather than one handle per level. The levels are
produced by one forward and consumed together, chunk by chunk, at the same placeholder positions:
packed, they are one cache entry, one handle, one transfer and one lease per item, and the cumsum
slicing that cuts an item's rows for a prefill chunk cuts every level the same way by construction.
The runner splits a chunk's rows into the main embedding (fused into the inputs) and the levels
(scattered into zero-filled ``[T, hidden]`` tensors and added after the first L layers)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from epd.models.checkpoint import read_config
from epd.models.parallel import SINGLE, TensorParallel
from epd.models.qwen2_vl.family import QwenVLFamily, build_llm
from epd.models.qwen3_vl.llm import Qwen3ForCausalLM, Qwen3TextConfig
from epd.models.spec import MultimodalSpec
from epd.multimodal.layout import PromptLayout, build_prompt_layout
from epd.types import MultimodalItemSpan


def text_config_from_hf(hf: dict) -> Qwen3TextConfig:
    text = hf.get("text_config") or hf
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ValueError("Qwen3-VL config has no mrope_section (text_config.rope_parameters)")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    heads = text["num_attention_heads"]
    return Qwen3TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", text.get("rope_theta", 5_000_000.0)), mrope_section=tuple(section),
        tie_word_embeddings=bool(tie), max_position_embeddings=text.get("max_position_embeddings", 128_000),
        deepstack_levels=len(hf.get("vision_config", {}).get("deepstack_visual_indexes") or ()))


class Qwen3VLFamily(QwenVLFamily):
    """Qwen2-VL's vision loading, media settings and input processor; its own LLM, spec and layout."""

    def load_llm(self, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tp: TensorParallel = SINGLE) -> Qwen3ForCausalLM:
        return build_llm(Qwen3ForCausalLM, text_config_from_hf(read_config(model_dir)), model_dir, device=device,
                         dtype=dtype, tp=tp)

    def mm_spec(self, model_dir: Path) -> MultimodalSpec:
        hf = read_config(model_dir)
        text = text_config_from_hf(hf)
        return MultimodalSpec.from_config(
            hf, vocab_size=text.vocab_size, embedding_dim=text.hidden_size * (1 + text.deepstack_levels),
            deepstack_levels=text.deepstack_levels, video_timestamps=True)

    def prompt_layout(self, spec: MultimodalSpec, token_ids: Sequence[int],
                      items: Sequence[MultimodalItemSpan]) -> PromptLayout:
        from epd.models.qwen2_vl.mrope import compute_mrope_positions

        def positions(n: int, spans: Sequence[MultimodalItemSpan]):
            # a video's temporal patches stand apart (each after its timestamp): each is placed as an
            # image of one frame, as transformers' get_rope_index splits video_grid_thw
            pieces = [(start, (1, *s.grid_thw[1:])) for s in spans for start in s.segment_offsets] + \
                [(s.offset, s.grid_thw) for s in spans if not s.segment_offsets]
            return compute_mrope_positions(n, pieces, spec.spatial_merge_size)

        return build_prompt_layout(token_ids, items, mm_token_ids=spec.mm_token_ids, positions_fn=positions)


QWEN3_VL = Qwen3VLFamily("qwen3_vl")
