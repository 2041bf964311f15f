"""The Qwen3 decoder (the LLM half of Qwen3-VL) on our engine: the Qwen2 decoder's shape with an
RMSNorm on every query and key head, no q/k/v bias, an explicit head size, interleaved M-RoPE, and
deepstack: the vision tower's intermediate levels added to the hidden states after the first
layers, at the placeholder positions (zeros elsewhere, so a text token is untouched).

Inputs are flat (all scheduled tokens of all sequences): ``inputs_embeds [T, D]``, ``positions
[3, T]`` and, for a step with image rows, ``deepstack`` (one ``[T, D]`` tensor per level).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.models.layers import InterleavedMRotaryEmbedding, RMSNorm
from epd.models.parallel import SINGLE, TensorParallel
from epd.models.qwen2_vl.llm import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM


@dataclass(frozen=True)
class Qwen3TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    deepstack_levels: int  # the vision tower's deepstack outputs, added after layers 0 .. levels - 1

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.deepstack_levels > self.num_hidden_layers:
            raise ValueError(f"{self.deepstack_levels} deepstack levels need as many layers, the model has "
                             f"{self.num_hidden_layers}")


class Qwen3Attention(Qwen2Attention):
    qkv_bias = False

    def __init__(self, cfg: Qwen3TextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, layer_idx, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before the rotary
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    layer_class = Qwen3DecoderLayer
    rotary_class = InterleavedMRotaryEmbedding

    @property
    def deepstack_levels(self) -> int:
        return self.config.deepstack_levels
