"""The SDPA backend's decode path (KV read by block table, GQA-packed queries) against attention
written out by hand per sequence: blocks scattered over the cache, sequences of different lengths
(padded blocks masked), several query heads per KV head."""
from __future__ import annotations

import math

import torch

from epd.engine.attention import AttentionMetadata, KVCache, SdpaAttentionBackend

BLOCK, HEADS, KV_HEADS, DIM = 4, 8, 2, 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [H, D]; k, v: [L, KVH, D] -> [H, D], query head h reading KV head h // (H / KVH)."""
    group = HEADS // KV_HEADS
    out = []
    for h in range(HEADS):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        weights = torch.softmax(kh @ q[h].double() / math.sqrt(DIM), dim=0)
        out.append(weights @ vh)
    return torch.stack(out).float()


def test_decode_by_block_table_equals_attention_by_hand():
    torch.manual_seed(0)
    cache = KVCache.allocate(1, 64 * BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    lengths = [1, 7, 13, 4]  # tokens in KV after this step, the new one included
    order = torch.randperm(64).tolist()
    tables = [[order.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    q = torch.randn(len(lengths), HEADS, DIM)
    k_new, v_new = torch.randn(len(lengths), KV_HEADS, DIM), torch.randn(len(lengths), KV_HEADS, DIM)
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lengths)])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=slots, prefills=[], decode_q_indices=torch.arange(len(lengths)),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_kv_mask=(torch.arange(width * BLOCK)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :],
        block_size=BLOCK)
    out = SdpaAttentionBackend().forward(0, q, k_new, v_new, cache, meta, 1 / math.sqrt(DIM))
    for i, (table, n) in enumerate(zip(tables, lengths)):
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        expected = _reference(q[i], cache.k[0][seq_slots], cache.v[0][seq_slots])
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.k[0][slots], k_new)  # the new token's K/V landed in its slot
