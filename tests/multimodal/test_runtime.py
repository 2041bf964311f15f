import pytest
import torch

from epd.multimodal.masks import embed_mask_cumsum
from epd.multimodal.runtime import MultimodalRuntimeData, join_embeddings


def _cumsum(*runs):
    """Prompt built from (is_embed, length) runs."""
    mask = torch.cat([torch.full((n,), is_embed, dtype=torch.bool) for is_embed, n in runs])
    return embed_mask_cumsum(mask)


def _counts(runtime):
    return (
        runtime.num_cached_mm_tokens,
        runtime.num_mm_tokens_in_chunk,
        runtime.total_embeds_in_request,
    )


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


# Two text tokens, eight image rows, two text tokens.
EIGHT_ROWS = _cumsum((False, 2), (True, 8), (False, 2))


def test_two_cached_three_in_chunk():
    runtime = MultimodalRuntimeData(
        past_seen_token_num=4, chunk_end_pos=7, embed_mask_cumsum=EIGHT_ROWS
    )
    assert _counts(runtime) == (2, 3, 8)
    embeds = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    first = runtime.num_cached_mm_tokens  # what the model runner takes: rows [cached, cached + in chunk)
    active = join_embeddings([embeds], first, first + runtime.num_mm_tokens_in_chunk)
    assert torch.equal(active, embeds[2:5])
    assert _storage(active) == _storage(embeds)


def test_chunked_prefill_120_576_80():
    cs = _cumsum((False, 120), (True, 576), (False, 80))
    first = MultimodalRuntimeData(past_seen_token_num=0, chunk_end_pos=600, embed_mask_cumsum=cs)
    second = MultimodalRuntimeData(past_seen_token_num=600, chunk_end_pos=776, embed_mask_cumsum=cs)
    assert (first.num_cached_mm_tokens, first.num_mm_tokens_in_chunk) == (0, 480)
    assert (second.num_cached_mm_tokens, second.num_mm_tokens_in_chunk) == (480, 96)
    assert first.total_embeds_in_request == second.total_embeds_in_request == 576


def test_non_contiguous_embed_positions():
    # Seed mask [F, T, T, F, T, F, F]: the special at position 3 is not a row.
    cs = embed_mask_cumsum(torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.bool))
    runtime = MultimodalRuntimeData(past_seen_token_num=3, chunk_end_pos=5, embed_mask_cumsum=cs)
    assert _counts(runtime) == (2, 1, 3)


def test_runtime_validation():
    with pytest.raises(ValueError, match="must be on CPU, got meta"):
        MultimodalRuntimeData(0, 1, torch.zeros(3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        MultimodalRuntimeData(0, 0, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="past_seen_token_num=5, chunk_end_pos=4, prompt_len=12"):
        MultimodalRuntimeData(5, 4, EIGHT_ROWS)
    with pytest.raises(ValueError, match="chunk_end_pos=13, prompt_len=12"):
        MultimodalRuntimeData(0, 13, EIGHT_ROWS)


def test_join_single_segment_stays_a_view():
    first, second = torch.randn(4, 2), torch.randn(3, 2)
    whole_first = join_embeddings([first])
    assert _storage(whole_first) == _storage(first)
    inside_second = join_embeddings([first, second], start=5, end=7)
    assert torch.equal(inside_second, second[1:3])
    assert _storage(inside_second) == _storage(second)


def test_join_slices_before_concatenating():
    first, second, third = torch.randn(4, 2), torch.randn(3, 2), torch.randn(2, 2)
    joined = join_embeddings([first, second, third], start=2, end=8)
    assert torch.equal(joined, torch.cat([first, second, third])[2:8])
    # only the 6 rows asked for were copied: joining all 9 and slicing after would hold them all
    assert joined.untyped_storage().nbytes() == 6 * 2 * first.element_size()
    assert torch.equal(join_embeddings([first, second]), torch.cat([first, second]))
    assert join_embeddings([first, second], start=4, end=4).shape == (0, 2)


def test_join_rejects_bad_ranges():
    with pytest.raises(ValueError, match="start=3, end=9"):
        join_embeddings([torch.zeros(4, 2), torch.zeros(4, 2)], start=3, end=9)
    with pytest.raises(ValueError, match="at least one segment"):
        join_embeddings([])
