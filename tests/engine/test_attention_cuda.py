"""The attention backends on a CUDA device (skipped without one; ``scripts/gpu_verify.sh`` runs it):
the same mixed step as ``test_attention`` (decodes, first and later prefill chunks, a prefix hit,
GQA), each backend against attention by hand, in float32 and in bfloat16. FlashInfer only where
it is installed (the ``gpu`` extra). Pages of 16 slots and a head size of 64, as engines use on a GPU
(flex's CUDA kernels tile a page 16 rows at a time, FlashInfer takes 64/128/256-wide heads)."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from epd.engine.attention import ATTENTION_BACKENDS, AttentionSpec, KVCache, build_page_metadata, metadata_on
from tests.engine.test_attention import HEADS, KV_HEADS, NUM_BLOCKS, _reference, _step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BACKENDS = ["sdpa", "flex", pytest.param("flashinfer", marks=pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="FlashInfer is not installed (pip install 'epd[gpu]')"))]
BLOCK, DIM = 16, 64


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixed_step_on_cuda_equals_attention_by_hand(backend, dtype, tolerance):
    torch.manual_seed(0)
    starts, query_lens, array, tables = _step(block=BLOCK)
    cache = KVCache.allocate(1, NUM_BLOCKS * BLOCK, KV_HEADS, DIM, dtype, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    host, slots = build_page_metadata(array, starts, query_lens, BLOCK)
    meta = metadata_on(host, slots, 4, BLOCK, NUM_BLOCKS, lambda t: t.to("cuda"))
    total = int(query_lens.sum())
    q = torch.randn(total, HEADS, DIM, device="cuda", dtype=dtype)
    k_new = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=dtype)
    v_new = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=dtype)
    attention = ATTENTION_BACKENDS.get(backend)(AttentionSpec(HEADS, KV_HEADS, DIM, dtype, BLOCK))
    attention.plan(meta)
    out = attention.forward(0, q, k_new, v_new, cache, meta, 1 / math.sqrt(DIM)).float().cpu()
    k_all, v_all = cache.k[0].float().cpu(), cache.v[0].float().cpu()
    for s, (table, start, num) in enumerate(zip(tables, starts, query_lens)):
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(int(start + num))])
        first = int(host.query_start_loc[s])
        expected = _reference(q[first:first + num].float().cpu(), k_all[seq_slots], v_all[seq_slots])
        torch.testing.assert_close(out[first:first + num], expected, atol=tolerance, rtol=tolerance,
                                   msg=f"{backend} {dtype} sequence {s}")
