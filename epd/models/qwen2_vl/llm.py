"""The Qwen2 decoder (the LLM half of Qwen2-VL / Qwen2.5-VL) on our engine: GQA with M-RoPE,
RMSNorm, SwiGLU, tied or untied head, paged KV through an attention backend.

Inputs are flat (all scheduled tokens of all sequences concatenated): ``inputs_embeds [T, D]``
and ``positions [3, T]``; the caller has already fused multimodal embeddings into the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from epd.models.layers import MRotaryEmbedding, RMSNorm, SiluAndMul, apply_rotary
from epd.models.parallel import (
    SINGLE,
    ColumnParallelPacked,
    HeadLayout,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class Qwen2TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")


class Qwen2Attention(nn.Module):
    qkv_bias = True

    def __init__(self, cfg: Qwen2TextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        """With ``tp``: this rank's heads only (``epd.models.parallel.HeadLayout``)."""
        super().__init__()
        self.layer_idx = layer_idx
        heads = HeadLayout.of(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_start = heads.first_kv_head * self.head_dim
        self.qkv_proj = ColumnParallelPacked(cfg.hidden_size, [q_size, kv_size, kv_size],
                                             [heads.first_head * self.head_dim, kv_start, kv_start], bias=self.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, tp,
                                        "num_attention_heads x head_dim")
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = self.head_dim ** -0.5

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key heads ``[T, heads, head_dim]`` as the rotary takes them (as they are here)."""
        return q, k

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, k = self.normed(q.view(num_tokens, self.num_heads, self.head_dim),
                           k.view(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = backend.forward(self.layer_idx, q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(num_tokens, -1))


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        local = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelPacked(cfg.hidden_size, [local] * 2, [tp.rank * local] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, "intermediate_size")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Qwen2Attention

    def __init__(self, cfg: Qwen2TextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, layer_idx, tp)
        self.mlp = Qwen2MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2ForCausalLM(nn.Module):
    # checkpoint projection name -> (packed parameter name, shard index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    layer_class: type[nn.Module] = Qwen2DecoderLayer
    rotary_class: type[nn.Module] = MRotaryEmbedding
    deepstack_levels = 0  # vision levels added after the first layers (Qwen3-VL's deepstack)

    def __init__(self, cfg, tp: TensorParallel = SINGLE) -> None:
        """``tp``: this process's rank among the tensor-parallel ranks (``epd.models.parallel``);
        every rank builds the model with its own, and holds 1/``tp.size`` of it."""
        super().__init__()
        self.config, self.tp = cfg, tp
        heads = HeadLayout.of(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.local_heads = (heads.num_heads, heads.num_kv_heads)  # what this rank's KV cache and attention hold
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([self.layer_class(cfg, i, tp) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.rotary_class(cfg.head_dim, cfg.rope_theta, list(cfg.mrope_section))
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend,
                deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """inputs_embeds [T, D], positions [3, T] -> final hidden states [T, D]. ``deepstack``: per
        level a [T, D] added after that layer (zeros off the image positions; None: no rows)."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, meta, backend)
            if deepstack is not None and index < len(deepstack):
                x = x + deepstack[index]
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
