"""Decode CUDA graphs: the parts that need no GPU (buckets, padding a decode step's page metadata,
the engine deciding when to capture), and on CUDA with FlashInfer, greedy tokens replayed from the
graphs equal the eager engine's."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from epd.engine.attention import build_page_metadata
from epd.engine.decode_graphs import decode_batch_buckets, graph_page_capacity, pad_decode_metadata, smallest_bucket


def test_buckets_are_small_powers_then_steps_of_eight_up_to_max_num_seqs():
    assert decode_batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_batch_buckets(3) == [1, 2, 3]
    assert decode_batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_buckets(1000)[-1] == 256
    assert smallest_bucket([1, 2, 4, 8], 3) == 4 and smallest_bucket([1, 2, 4, 8], 9) is None


def test_padding_rows_read_and_write_only_the_scratch_page():
    tables = np.array([[3, 7, 0], [5, 0, 0], [9, 2, 4]], dtype=np.int32)
    host, slots = build_page_metadata(tables, np.array([20, 3, 40]), np.array([1, 1, 1]), 16)
    padded = pad_decode_metadata(host, 8, scratch_page=99, block_size=16)
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.seq_lens.tolist() == [21, 4, 41] + [1] * 5
    assert padded.kv_indices.tolist() == [3, 7, 5, 9, 2, 4] + [99] * 5
    assert padded.kv_indptr.tolist() == [0, 2, 3, 6, 7, 8, 9, 10, 11]
    assert padded.kv_last_page_len.tolist() == [5, 4, 9] + [1] * 5
    assert padded.slot_mapping.tolist() == slots.tolist() + [99 * 16] * 5
    with pytest.raises(ValueError, match="takes <= 2 one-token decodes"):
        pad_decode_metadata(host, 2, scratch_page=99, block_size=16)


def test_a_graphs_page_table_holds_every_row_at_its_longest_even_when_rows_share_pages():
    # 8 rows of 4,096 tokens in 16-slot pages: 256 pages each, though the cache has only 300
    # (rows that share a cached prefix each list its pages)
    assert graph_page_capacity(8, num_pages=300, block_size=16, max_model_len=4096) == 8 * 256
    assert graph_page_capacity(8, num_pages=100, block_size=16, max_model_len=4096) == 8 * 100  # no row has more
    assert graph_page_capacity(4, num_pages=50, block_size=16, max_model_len=None) == 4 * 50
    tables = np.array([[1, 2, 3], [1, 2, 4]], dtype=np.int32)  # a shared 2-page prefix
    host, _ = build_page_metadata(tables, np.array([40, 40]), np.array([1, 1]), 16)
    padded = pad_decode_metadata(host, 4, scratch_page=9, block_size=16)
    assert len(padded.kv_indices) == 8 > 5  # more entries than distinct pages in use
    assert len(padded.kv_indices) <= graph_page_capacity(4, num_pages=10, block_size=16, max_model_len=48)


def test_a_cpu_engine_captures_nothing_and_keeps_its_pages():
    from epd.config import EngineConfig
    from epd.engine.llm_engine import LLMEngine
    from epd.models.locate import resolve_model
    from epd.models.registry import load_llm_for
    config = EngineConfig(device="cpu", num_kv_blocks=32)
    engine = LLMEngine(load_llm_for(resolve_model("tiny-qwen2-vl"), config), config, eos_token_ids=())
    assert engine.runner.graphs is None and engine.runner.kv_pages == 32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs CUDA and FlashInfer")
def test_greedy_tokens_from_decode_graphs_equal_the_eager_engines():
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.models.locate import resolve_model
    from epd.types import SamplingParams
    from tests.conftest import make_image_bytes
    from tests.fidelity.reference import user_message
    chats = [user_message(f"Say something about number {i}.", [make_image_bytes(64, 48, seed=i)] if i % 2 else [])
             for i in range(5)]  # 5 decodes: a padded bucket (8)
    # bf16: FlashInfer has no float32 kernels. Graph and eager decode may split the KV differently
    # (another rounding of the same sum), so a close call late in a random model's output could
    # differ; a stale or misplaced page changes the tokens at once, so 8 tokens a request tell.
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(resolve_model("small-qwen2-vl")),
                  engine_config=EngineConfig(device="cuda", dtype="bfloat16", enforce_eager=eager, max_num_seqs=16,
                                             kv_cache_bytes=256 << 20))
        assert (llm.engine.runner.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.chat(chats, params)]
    assert outs[False] == outs[True]
