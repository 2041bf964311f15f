"""Paged attention: a backend protocol plus the CPU reference backend (torch SDPA).

KV lives in per-layer slot arrays ``[num_blocks * block_size, num_kv_heads, head_dim]``; a token's
slot is ``block_table[pos // block_size] * block_size + pos % block_size``. A GPU kernel backend
(flash/paged) plugs in by implementing ``AttentionBackend.forward`` over the same metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from epd.registry import Registry


@dataclass
class PrefillSegment:
    """One sequence's prefill chunk: queries ``[q_start, q_start + q_len)`` of the flat batch
    attend to the sequence's first ``kv_len`` cached positions (the chunk is the last ``q_len``)."""

    q_start: int
    q_len: int
    kv_slots: torch.Tensor  # [kv_len] int64

    @property
    def kv_len(self) -> int:
        return int(self.kv_slots.shape[0])


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    prefills: list[PrefillSegment]
    decode_q_indices: torch.Tensor | None = None  # [B] rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded with block 0
    decode_kv_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool, True = attend
    block_size: int = 16  # slots per KV block (the cache's slot s is row s % block_size of block s // block_size)


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer: [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        shape = (num_slots, num_kv_heads, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    @property
    def bytes_per_slot(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t.shape[1] * t.shape[2] * t.element_size()


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (new tokens) -> [T, H, D]."""


ATTENTION_BACKENDS: Registry[type] = Registry("attention backend")


@ATTENTION_BACKENDS.register("sdpa")
class SdpaAttentionBackend:
    """Gathers each sequence's KV from its slots and runs torch SDPA; decodes go as one padded
    batch (one gather + one SDPA per layer), prefill chunks one sequence at a time."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for seg in meta.prefills:
            out[seg.q_start:seg.q_start + seg.q_len] = _prefill_attention(
                q[seg.q_start:seg.q_start + seg.q_len], k_cache[seg.kv_slots], v_cache[seg.kv_slots], scale)
        if meta.decode_q_indices is not None:
            out[meta.decode_q_indices] = _decode_attention(q[meta.decode_q_indices], k_cache, v_cache,
                                                           meta, scale)
        return out


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D] are the last n of kv_len positions; causal with that offset."""
    n, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if n == kv_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        allowed = torch.arange(kv_len, device=q.device)[None, :] <= torch.arange(
            kv_len - n, kv_len, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, H, D] one token per sequence -> [B, H, D].

    KV is read a block at a time (a block's slots are contiguous: one copy of block_size rows, not
    one indexed copy per token), and the query heads that share a KV head go as that head's query
    rows (GQA packing): SDPA then takes its fused kernel, with no ``enable_gqa`` and no K/V repeated
    per query head."""
    k = _gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)  # [B, KVH, L, D]
    v = _gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
    batch, heads, dim = q.shape
    packed = q.view(batch, k.shape[1], heads // k.shape[1], dim)  # query head h reads KV head h // (H / KVH)
    o = F.scaled_dot_product_attention(packed, k, v, attn_mask=meta.decode_kv_mask, scale=scale)
    return o.reshape(batch, heads, dim)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, KVH, D] cache, [B, nb] block tables -> [B, KVH, nb * block_size, D]."""
    num_slots, kv_heads, dim = cache.shape
    batch, num_blocks = tables.shape
    # index_select of whole rows (one block each) is ~4x faster on CPU than advanced indexing per slot
    blocks = cache.view(num_slots // block_size, -1).index_select(0, tables.reshape(-1))
    return blocks.view(batch, num_blocks * block_size, kv_heads, dim).transpose(1, 2)
