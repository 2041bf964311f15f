"""Every attention backend against attention written out by hand per sequence, over one mixed step:
decodes of different lengths (pages scattered over the cache, last pages partly full), a first
prefill chunk, a later chunk of a prompt (its context already in KV) and a chunk after a prefix hit
(its first pages shared with another sequence); GQA with several query heads per KV head."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from epd.engine.attention import ATTENTION_BACKENDS, KVCache, build_page_metadata, metadata_on

BLOCK, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 4, 8, 2, 16, 64


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [n, H, D], the last n of L positions; k, v: [L, KVH, D] -> [n, H, D], causal, query
    head h reading KV head h // (H / KVH), in float64."""
    group, n, length, dim = HEADS // KV_HEADS, q.shape[0], k.shape[0], q.shape[-1]
    out = torch.empty(n, HEADS, dim, dtype=torch.float64)
    for i in range(n):
        visible = length - n + i + 1
        for h in range(HEADS):
            kh, vh = k[:visible, h // group].double(), v[:visible, h // group].double()
            out[i, h] = torch.softmax(kh @ q[i, h].double() / math.sqrt(dim), dim=0) @ vh
    return out.float()


def _step(seed: int = 0, block: int = BLOCK):
    """(starts, query lengths, block tables) of one step with pages of ``block`` slots, decodes first."""
    rng = np.random.default_rng(seed)
    order = [int(b) for b in rng.permutation(NUM_BLOCKS)]
    shared = [order.pop() for _ in range(2)]  # a cached prefix of 2 full pages
    plan = [(0, 1), (6, 1), (12, 1), (3, 1),  # decodes: KV lengths 1, 7, 13, 4
            (0, 9),  # a first prefill chunk
            (10, 7),  # a later chunk: 10 tokens of context, 7 new
            (2 * block, 5)]  # after a prefix hit on the shared pages
    tables = []
    for n, (start, num) in enumerate(plan):
        pages = -(-(start + num) // block)
        head = list(shared) if n == len(plan) - 1 else []
        tables.append(head + [order.pop() for _ in range(pages - len(head))])
    width = max(len(t) for t in tables)
    array = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    return np.array([p[0] for p in plan]), np.array([p[1] for p in plan]), array, tables


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_mixed_step_equals_attention_by_hand(backend):
    torch.manual_seed(0)
    starts, query_lens, array, tables = _step()
    cache = KVCache.allocate(1, NUM_BLOCKS * BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    before = (cache.k[0].clone(), cache.v[0].clone())
    attention = ATTENTION_BACKENDS.get(backend)()
    assert not attention.reads_page_list  # so the step is planned without the CSR page list, as the engine does
    host, slots = build_page_metadata(array, starts, query_lens, BLOCK, page_list=False)
    meta = metadata_on(host, slots, 4, BLOCK, NUM_BLOCKS, lambda t: t)
    total = int(query_lens.sum())
    q = torch.randn(total, HEADS, DIM)
    k_new, v_new = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    attention.plan(meta)
    out = attention.forward(0, q, k_new, v_new, cache, meta, 1 / math.sqrt(DIM))
    assert torch.equal(cache.k[0][torch.from_numpy(slots)], k_new)  # the new K/V landed in their slots
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[torch.from_numpy(slots)] = False
    assert torch.equal(cache.v[0][untouched], before[1][untouched])  # and nowhere else
    for s, (table, start, num) in enumerate(zip(tables, starts, query_lens)):
        length = int(start + num)
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        first = int(host.query_start_loc[s])
        expected = _reference(q[first:first + num], cache.k[0][seq_slots], cache.v[0][seq_slots])
        torch.testing.assert_close(out[first:first + num], expected, atol=2e-5, rtol=2e-5, msg=f"sequence {s}")


def test_page_metadata_is_the_csr_of_the_block_tables():
    starts, query_lens, array, tables = _step(seed=3)
    host, slots = build_page_metadata(array, starts, query_lens, BLOCK)
    seq_lens = starts + query_lens
    assert host.query_start_loc.tolist() == [0, *np.cumsum(query_lens).tolist()]
    assert host.seq_lens.tolist() == seq_lens.tolist() and host.seq_lens.dtype == np.int32
    for s, table in enumerate(tables):
        pages = host.kv_indices[host.kv_indptr[s]:host.kv_indptr[s + 1]].tolist()
        assert pages == table[:-(-int(seq_lens[s]) // BLOCK)]
        assert host.kv_last_page_len[s] == int(seq_lens[s]) - (len(pages) - 1) * BLOCK
    expected = [table[p // BLOCK] * BLOCK + p % BLOCK for table, start, num in zip(tables, starts, query_lens)
                for p in range(int(start), int(start + num))]
    assert slots.tolist() == expected and slots.dtype == np.int64
    bare, bare_slots = build_page_metadata(array, starts, query_lens, BLOCK, page_list=False)
    assert bare.kv_indices is None and np.array_equal(bare_slots, slots)  # the rest as with the list
    for field in ("query_start_loc", "seq_lens", "block_tables", "kv_indptr", "kv_last_page_len"):
        assert np.array_equal(getattr(bare, field), getattr(host, field)), field
    for name in ("query_start_loc", "block_tables", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(host, name).dtype == np.int32, name


def test_the_config_offers_exactly_the_registered_backends_and_auto_picks_by_device():
    import typing

    from epd.config import EngineConfig
    from epd.engine.attention import AUTO, resolve_backend
    offered = typing.get_args(EngineConfig.model_fields["attention_backend"].annotation)
    assert sorted(offered) == sorted([AUTO, *ATTENTION_BACKENDS.names()])
    assert resolve_backend("auto", "cpu") == "sdpa" and resolve_backend("flex", "cpu") == "flex"


def test_auto_takes_flashinfer_on_cuda_only_for_the_dtypes_its_kernels_have(monkeypatch):
    import importlib.util

    from epd.engine.attention import resolve_backend
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else None)
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend("auto", "cuda:1", torch.float16) == "flashinfer"
    assert resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"


def test_flex_on_cuda_tiles_a_page_by_16_and_refuses_pages_it_cannot_tile():
    from epd.engine.attention.flex import kernel_options
    assert kernel_options(torch.device("cpu"), 4) is None
    assert kernel_options(torch.device("cuda", 0), 16) == {"BLOCK_M": 16, "BLOCK_N": 16}
    assert kernel_options(torch.device("cuda", 0), 64) == {"BLOCK_M": 16, "BLOCK_N": 16}
    with pytest.raises(ValueError, match="multiple of 16, got 8"):
        kernel_options(torch.device("cuda", 0), 8)


@pytest.mark.skipif(__import__("importlib").util.find_spec("flashinfer") is not None, reason="FlashInfer is here")
def test_flashinfer_without_flashinfer_says_how_to_get_it():
    from epd.engine.attention import AttentionSpec
    with pytest.raises(RuntimeError, match=r"needs FlashInfer .*pip install 'epd\[gpu\]', or use attention_backend"):
        ATTENTION_BACKENDS.get("flashinfer")(AttentionSpec(HEADS, KV_HEADS, DIM, torch.float32, BLOCK))


def test_flex_compiles_long_prefills_and_then_any_shape_without_failing():
    """Regression: a first compile of a long prefill (more queries than the CPU kernel's split) once
    failed to build in torch's C++ flex template, and so did the dynamic recompile for a second,
    longer prefill on an AVX-512 host (prefills now go in fixed slabs of queries: 600 tokens are
    three); then shapes change every step (prefills of other lengths, decodes of other batch sizes),
    each equal to the SDPA reference."""
    torch.manual_seed(1)
    for qlens, starts, num_decodes in [([290], [0], 0), ([600, 17], [0, 0], 0), ([1] * 9 + [40], [300] * 9 + [5], 9),
                                       ([1] * 3, [16, 31, 64], 3)]:
        block, dim, num_blocks = 16, 32, 200
        pages = [-(-(q + s) // block) for q, s in zip(qlens, starts)]
        firsts = np.cumsum([0, *pages[:-1]])
        array = np.zeros((len(qlens), max(pages)), dtype=np.int32)
        for row, (first, n) in enumerate(zip(firsts, pages)):
            array[row, :n] = np.arange(first, first + n)
        host, slots = build_page_metadata(array, np.array(starts), np.array(qlens), block)
        outs = []
        for backend in ("flex", "sdpa"):
            torch.manual_seed(2)
            cache = KVCache.allocate(1, num_blocks * block, KV_HEADS, dim, torch.float32, "cpu")
            cache.k[0].normal_()
            cache.v[0].normal_()
            total = sum(qlens)
            q, k, v = torch.randn(total, HEADS, dim), torch.randn(total, KV_HEADS, dim), torch.randn(total, KV_HEADS, dim)
            meta = metadata_on(host, slots, num_decodes, block, num_blocks, lambda t: t)
            attention = ATTENTION_BACKENDS.get(backend)(None)
            attention.plan(meta)
            outs.append(attention.forward(0, q, k, v, cache, meta, dim ** -0.5))
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5, msg=str(qlens[:3]))


def test_flex_past_the_recompile_limit_fails_loudly_instead_of_running_unfused():
    """Unfused flex ignores the block lists that keep queries to their own sequence's pages: past the
    recompile limit it must raise, never return other sequences' attention."""
    import torch._dynamo
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from epd.engine.attention.flex import _compiled_flex

    _compiled_flex()
    assert torch._dynamo.config.fail_on_recompile_limit_hit and torch._dynamo.config.recompile_limit >= 64
    torch._dynamo.reset()
    # torch's own patch: pytest's monkeypatch would delete the setting on undo (torch's config module
    # then hides it, and every later compile fails)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(FailOnRecompileLimitHit):
        test_flex_compiles_long_prefills_and_then_any_shape_without_failing()
    torch._dynamo.reset()  # the next test compiles afresh under the real limit
    assert torch._dynamo.config.recompile_limit >= 64
