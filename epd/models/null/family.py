"""The zero-cost model family (``model_type: epd_null_vl``): a benchmark tool. Everything a request
meets is real but the arithmetic of the model: the tokenizer, the chat template, each image's and
video's true row count, the encoder's scheduler and cache, shared-memory handles of the configured
row width and KV size, prefill's chunks and prefix cache, decode's batching and block tables, the
sampler (on fixed logits). What is left of a request's cost is EPD's own: the router, the transfers,
the bookkeeping of each step. ``epd serve --model null-qwen2-vl`` serves one like any model.

Limits, by design: the logit vocabulary is small (``null.num_logits`` tokens from
``null.first_token_id``): a ``logit_bias`` or grammar naming a token past it is refused by the
engine's usual checks, and no request ends on EOS (each runs to its max_tokens)."""
from __future__ import annotations

from pathlib import Path

import torch

from epd.models.checkpoint import read_config
from epd.models.null.llm import NullLLM, NullTextConfig
from epd.models.qwen2_vl.family import QwenVLFamily
from epd.models.spec import MultimodalSpec


class NullFamily(QwenVLFamily):
    """Qwen2-VL's prompt rules (processor, template, M-RoPE layout) over the zero-cost models."""

    supports_tensor_parallel = False

    def load_llm(self, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tp=None) -> NullLLM:
        if tp is not None and tp.size > 1:  # LLM checks supports_tensor_parallel first; a direct caller here
            from epd.models.parallel import TensorParallelError
            raise TensorParallelError(f"the zero-cost model is not cut into ranks (tensor_parallel_size {tp.size}); "
                                      "use 1")
        return NullLLM(text_config(read_config(model_dir))).to(device=device, dtype=dtype).eval()

    def load_vision(self, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from epd.models.null.vision import NullVisionEncoder
        from epd.models.qwen2_vl.processor import media_settings_for

        hf = read_config(model_dir)
        return NullVisionEncoder(media_settings_for(model_dir), text_config(hf).hidden_size,
                                 hf["vision_config"]["spatial_merge_size"], dtype=dtype, device=device)

    def mm_spec(self, model_dir: Path) -> MultimodalSpec:
        hf = read_config(model_dir)
        cfg = text_config(hf)
        return MultimodalSpec.from_config(hf, vocab_size=cfg.embedding_vocab_size, embedding_dim=cfg.hidden_size)


def text_config(hf: dict) -> NullTextConfig:
    text, null = hf["text_config"], hf["null"]
    return NullTextConfig(
        vocab_size=null["num_logits"], hidden_size=text["hidden_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["hidden_size"] // text["num_attention_heads"], first_token_id=null["first_token_id"],
        embedding_vocab_size=text["vocab_size"], step_ms=float(null.get("step_ms", 0.0)))


NULL_VL = NullFamily("qwen2_vl")
