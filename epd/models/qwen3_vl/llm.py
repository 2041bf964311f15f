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
from torch import nn

from epd.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from epd.models.layers import InterleavedMRotaryEmbedding, PackedLinear, RMSNorm, apply_rotary
from epd.models.qwen2_vl.llm import Qwen2MLP


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


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before the rotary
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = apply_rotary(self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = backend.forward(self.layer_idx, q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(num_tokens, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Qwen3TextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = InterleavedMRotaryEmbedding(cfg.head_dim, cfg.rope_theta, list(cfg.mrope_section))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def deepstack_levels(self) -> int:
        return self.config.deepstack_levels

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend,
                deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """inputs_embeds [T, D], positions [3, T], deepstack: per level [T, D] (zeros off the
        placeholders) or None for a step without image rows -> final hidden states [T, D]."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, meta, backend)
            if deepstack is not None and index < len(deepstack):
                x = x + deepstack[index]
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
