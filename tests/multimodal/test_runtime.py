import pytest
import torch

from epd.multimodal.masks import embed_mask_cumsum
from epd.multimodal.runtime import (
    MultimodalRuntimeData,
    check_mm_embed_cumsum_if_needed,
    find_input_mm_embeds,
    join_embeddings,
)


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


def test_seed_example_two_cached_three_in_chunk():
    runtime = MultimodalRuntimeData(
        past_seen_token_num=4, chunk_end_pos=7, embed_mask_cumsum=EIGHT_ROWS
    )
    assert _counts(runtime) == (2, 3, 8)
    embeds = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    (active,) = find_input_mm_embeds([embeds], [runtime])
    assert torch.equal(active, embeds[2:5])
    assert _storage(active) == _storage(embeds)


def test_seed_chunked_prefill_120_576_80():
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


def _check(mm_data, begin, end, prompt_len=10):
    check_mm_embed_cumsum_if_needed(
        mm_data, begin_compute=begin, end_compute=end, prompt_len=prompt_len
    )


def test_cumsum_check_raises_only_when_chunked_or_reused():
    payload = {"image": {"pixel_values": torch.zeros(1)}}
    _check(payload, 0, 10)  # full prefill: no cumsum needed
    reused = r"begin_compute=4, end_compute=10, prompt_len=10.*\['image'\]"
    with pytest.raises(ValueError, match=reused):
        _check(payload, 4, 10)
    with pytest.raises(ValueError, match="chunked prefill"):
        _check(payload, 0, 6)
    _check({**payload, "multimodal_embed_mask_cumsum": torch.zeros(10)}, 4, 6)
    _check({"mrope_config": {}}, 4, 6)  # metadata only: nothing to slice
    _check(None, 4, 6)


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
    assert torch.equal(join_embeddings([first, second]), torch.cat([first, second]))
    assert join_embeddings([first, second], start=4, end=4).shape == (0, 2)


def test_join_rejects_bad_ranges():
    with pytest.raises(ValueError, match="start=3, end=9"):
        join_embeddings([torch.zeros(4, 2), torch.zeros(4, 2)], start=3, end=9)
    with pytest.raises(ValueError, match="at least one segment"):
        join_embeddings([])


def test_all_runtimes_none_returns_input_unchanged():
    embeds = [torch.zeros(3, 2), torch.zeros(5, 2)]
    assert find_input_mm_embeds(embeds, [None, None]) is embeds


def test_per_request_batching_slices_locally():
    cs_a = _cumsum((True, 6))
    cs_b = _cumsum((False, 1), (True, 4))
    runtimes = [MultimodalRuntimeData(2, 5, cs_a), MultimodalRuntimeData(0, 3, cs_b)]
    embeds = [torch.arange(12.0).reshape(6, 2), torch.arange(8.0).reshape(4, 2)]
    active = find_input_mm_embeds(embeds, runtimes)
    assert torch.equal(active[0], embeds[0][2:5])
    assert torch.equal(active[1], embeds[1][0:2])


def test_per_request_batching_keeps_request_without_runtime_whole():
    runtimes = [MultimodalRuntimeData(2, 5, _cumsum((True, 6))), None]
    embeds = [torch.zeros(6, 2), torch.ones(4, 2)]
    active = find_input_mm_embeds(embeds, runtimes)
    assert active[0].shape == (3, 2) and active[1] is embeds[1]


def test_pre_concatenated_batching_advances_global_cursor():
    cs_a = _cumsum((True, 6))  # 6 rows, 2 cached, 3 in chunk
    cs_b = _cumsum((False, 1), (True, 4))  # 4 rows, 0 cached, 2 in chunk
    runtimes = [MultimodalRuntimeData(2, 5, cs_a), MultimodalRuntimeData(0, 3, cs_b)]
    embeds = torch.arange(20.0).reshape(10, 2)
    (active,) = find_input_mm_embeds([embeds], runtimes)
    assert torch.equal(active, torch.cat([embeds[2:5], embeds[6:8]]))


def test_already_sliced_payload_is_not_offset_twice():
    runtimes = [
        MultimodalRuntimeData(2, 5, _cumsum((True, 6))),
        MultimodalRuntimeData(0, 3, _cumsum((False, 1), (True, 4))),
    ]
    already_sliced = [torch.zeros(5, 2)]  # 3 + 2 rows: exactly this chunk
    assert find_input_mm_embeds(already_sliced, runtimes) is already_sliced


def test_find_input_mm_embeds_layout_errors():
    runtime = MultimodalRuntimeData(2, 5, _cumsum((True, 6)))
    with pytest.raises(ValueError, match="request 1 has no MultimodalRuntimeData"):
        find_input_mm_embeds([torch.zeros(10, 2)], [runtime, None])
    with pytest.raises(ValueError, match="has 7 rows but .* sum to 6"):
        find_input_mm_embeds([torch.zeros(7, 2)], [runtime])
    too_short = "request 0 needs embedding rows up to 5 but its tensor has 4 rows"
    with pytest.raises(ValueError, match=too_short):
        find_input_mm_embeds([torch.zeros(4, 2), torch.zeros(1, 2)], [runtime, None])
    with pytest.raises(ValueError, match=r"one embedding tensor per request \(3\)"):
        find_input_mm_embeds([torch.zeros(1, 2)] * 2, [runtime] * 3)


def test_chunk_local_mixing_cuts_full_payloads_to_the_chunk():
    # seed §7.5: A is already chunk-local (480 rows), B still holds its whole 576-row payload
    # of which 480 are cached and 96 belong to this chunk
    from epd.multimodal.runtime import MultimodalRuntimeData, find_input_mm_embeds

    cs_a = torch.cumsum(torch.tensor([0] * 120 + [1] * 576 + [0] * 80), 0)
    run_a = MultimodalRuntimeData(past_seen_token_num=0, chunk_end_pos=600, embed_mask_cumsum=cs_a)
    run_b = MultimodalRuntimeData(past_seen_token_num=600, chunk_end_pos=776, embed_mask_cumsum=cs_a)
    a = torch.randn(run_a.num_mm_tokens_in_chunk, 4)
    b = torch.randn(576, 4)
    b_before = b.clone()
    out = find_input_mm_embeds([a, b], [run_a, run_b], is_chunk=[True, False])
    assert out[0] is a
    assert out[1].shape[0] == 96 and torch.equal(out[1], b[480:])
    assert out[1].untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # a view, not a copy
    assert torch.equal(b, b_before)
    with pytest.raises(ValueError, match="chunk-local with 10 rows"):
        find_input_mm_embeds([a[:10], b], [run_a, run_b], is_chunk=[True, False])
