"""The reference backend (torch SDPA): decodes as one batch reading KV a page at a time, prefill
chunks one sequence at a time (SDPA has no variable-length form)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from epd.engine.attention.base import ATTENTION_BACKENDS
from epd.engine.attention.metadata import AttentionMetadata, KVCache


@dataclass
class _SdpaPlan:
    decode_tables: torch.Tensor | None  # [num_decodes, pages] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, pages * block_size] bool, True = attend
    prefills: list[tuple[int, int, torch.Tensor]]  # (first query row, queries, the sequence's KV slots)


@ATTENTION_BACKENDS.register("sdpa")
class SdpaAttentionBackend:
    reads_page_list = False

    def __init__(self, spec=None) -> None:
        self.spec = spec

    def plan(self, meta: AttentionMetadata) -> None:
        host, nd, bs = meta.host, meta.num_decodes, meta.block_size
        tables = meta.block_tables
        decode_tables = decode_mask = None
        if nd:
            pages = int(-(-host.seq_lens[:nd].max() // bs))
            decode_tables = tables[:nd, :pages].long()
            decode_mask = _decode_mask(host.seq_lens[:nd], meta.seq_lens[:nd], pages * bs)[:, None, None, :]
        prefills = []
        for s in range(nd, meta.num_seqs):  # SDPA's own loop: one call per prefill chunk
            kv_len = int(host.seq_lens[s])
            positions = torch.arange(kv_len, device=tables.device)
            slots = tables[s, positions // bs].long() * bs + positions % bs
            first = int(host.query_start_loc[s])
            prefills.append((first, int(host.query_start_loc[s + 1]) - first, slots))
        meta.plan = _SdpaPlan(decode_tables, decode_mask, prefills)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_cache.write(layer_idx, meta.slot_mapping, k, v)
        k_cache, v_cache, plan = kv_cache.k[layer_idx], kv_cache.v[layer_idx], meta.plan
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, plan.decode_tables, plan.decode_mask,
                                        meta.block_size, scale)
        for first, num, slots in plan.prefills:
            out[first:first + num] = prefill_attention(q[first:first + num], k_cache[slots], v_cache[slots], scale)
        return out


def _decode_mask(host_lens: np.ndarray, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: True where a decode row attends (a position below its sequence's length).
    On the host numpy builds it ~5x faster than torch's broadcast compare (0.07 against 0.36 ms at
    256 rows of 3,008: a large decode batch's step spent a quarter of its time here); on a device
    it is made there from the device's lengths (no copy from the host)."""
    if lens.device.type == "cpu":
        return torch.from_numpy(np.arange(width, dtype=host_lens.dtype)[None, :] < host_lens[:, None])
    return torch.arange(width, device=lens.device)[None, :] < lens[:, None]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     mask: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q: [B, H, D] one token per sequence -> [B, H, D].

    KV is read a page at a time (a page's slots are contiguous: one copy of block_size rows, not
    one indexed copy per token), and the query heads that share a KV head go as that head's query
    rows (GQA packing): SDPA then takes its fused kernel, with no ``enable_gqa`` and no K/V repeated
    per query head."""
    k = _gather_pages(k_cache, tables, block_size)  # [B, KVH, L, D]
    v = _gather_pages(v_cache, tables, block_size)
    batch, heads, dim = q.shape
    packed = q.view(batch, k.shape[1], heads // k.shape[1], dim)  # query head h reads KV head h // (H / KVH)
    o = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)
    return o.reshape(batch, heads, dim)


def _gather_pages(cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, KVH, D] cache, [B, pages] tables -> [B, KVH, pages * block_size, D]."""
    num_slots, kv_heads, dim = cache.shape
    batch, num_pages = tables.shape
    # index_select of whole rows (one page each) is ~4x faster on CPU than advanced indexing per slot
    pages = cache.view(num_slots // block_size, -1).index_select(0, tables.reshape(-1))
    return pages.view(batch, num_pages * block_size, kv_heads, dim).transpose(1, 2)
