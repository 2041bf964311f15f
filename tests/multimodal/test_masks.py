import pytest
import torch

from epd.multimodal.masks import (
    MultimodalEncoderItemMetadata,
    compute_mm_masks,
    embed_mask_cumsum,
    find_mm_embedding_lengths_from_masks,
)

T, F = True, False


def _bools(values):
    return torch.tensor(values, dtype=torch.bool)


def test_seed_example_masks():
    masks = compute_mm_masks(
        torch.tensor([1, 5, 5, 6, 5, 7, 2]),
        mm_token_ids=torch.tensor([5], dtype=torch.int32),
        mm_special_token_ids=torch.tensor([6, 7]),
    )
    assert torch.equal(masks.embed_mask, _bools([F, T, T, F, T, F, F]))
    assert torch.equal(masks.mm_mask, _bools([F, T, T, T, T, T, F]))
    assert torch.equal(masks.special_mask, _bools([F, F, F, T, F, T, F]))


def test_without_special_ids_mm_mask_equals_embed_mask():
    masks = compute_mm_masks(torch.tensor([1, 5, 6, 5]), mm_token_ids=torch.tensor([5]))
    assert masks.special_mask is None
    assert torch.equal(masks.mm_mask, masks.embed_mask)
    assert torch.equal(masks.embed_mask, _bools([F, T, F, T]))


def test_oov_fallback_and_precedence_of_mm_token_ids():
    input_ids = torch.tensor([1, 11, 11, 3, 5])
    oov = compute_mm_masks(input_ids, vocab_size=10)
    assert torch.equal(oov.embed_mask, _bools([F, T, T, F, F]))
    declared = compute_mm_masks(input_ids, mm_token_ids=torch.tensor([5]), vocab_size=10)
    assert torch.equal(declared.embed_mask, _bools([F, F, F, F, T]))


def test_special_oov_sentinel_is_not_an_embed_slot():
    masks = compute_mm_masks(
        torch.tensor([1, 11, 12, 11]), vocab_size=10, mm_special_token_ids=torch.tensor([12])
    )
    assert torch.equal(masks.embed_mask, _bools([F, T, F, T]))
    assert torch.equal(masks.mm_mask, _bools([F, T, T, T]))


def test_no_discriminator_is_an_error():
    with pytest.raises(ValueError, match="mm_token_ids or vocab_size"):
        compute_mm_masks(torch.tensor([1, 2]))


def test_embedding_lengths_exclude_specials_per_item():
    # Seed example: one item spanning 5 positions, 3 of them embed slots.
    masks = compute_mm_masks(
        torch.tensor([1, 5, 5, 6, 5, 7, 2]),
        mm_token_ids=torch.tensor([5]),
        mm_special_token_ids=torch.tensor([6, 7]),
    )
    assert find_mm_embedding_lengths_from_masks(masks.mm_mask, masks.embed_mask, [5]) == [3]


def test_embedding_lengths_for_deepseek_like_grid():
    # rows x cols = 2 x 3 features, span = rows * (cols + 1) + 2 with
    # start(8) / newline(9) / end(10) specials; two items split by text.
    start, newline, end, image = 8, 9, 10, 5
    item = [start] + ([image] * 3 + [newline]) * 2 + [end]
    input_ids = torch.tensor([1] + item + [2, 3] + item + [4])
    masks = compute_mm_masks(
        input_ids,
        mm_token_ids=torch.tensor([image]),
        mm_special_token_ids=torch.tensor([start, newline, end]),
    )
    span = 2 * (3 + 1) + 2
    lengths = find_mm_embedding_lengths_from_masks(masks.mm_mask, masks.embed_mask, [span, span])
    assert lengths == [6, 6]


def test_embedding_lengths_enforce_placeholder_count_invariant():
    masks = compute_mm_masks(torch.tensor([5, 5, 1, 5]), mm_token_ids=torch.tensor([5]))
    with pytest.raises(ValueError, match=r"\(3\) does not match .* \(4\): num_mm_tokens=\[2, 2\]"):
        find_mm_embedding_lengths_from_masks(masks.mm_mask, masks.embed_mask, [2, 2])
    with pytest.raises(ValueError, match="non-negative"):
        find_mm_embedding_lengths_from_masks(masks.mm_mask, masks.embed_mask, [4, -1])


def test_embed_mask_cumsum_is_int64_cpu_prefix_sum():
    cs = embed_mask_cumsum(_bools([F, T, T, F, T, F, F]))
    assert cs.dtype == torch.int64 and cs.device.type == "cpu"
    assert cs.tolist() == [0, 1, 2, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="1-D"):
        embed_mask_cumsum(torch.zeros(2, 2, dtype=torch.bool))


def test_item_metadata_validate():
    metadata = MultimodalEncoderItemMetadata(
        item_refs=[("image", 0), ("image", 1)],
        encoder_token_lengths=[16, 64],
        output_embedding_lengths=[4, 16],
    )
    metadata.validate()
    assert metadata.output_embedding_lengths == [4, 16]

    misaligned = metadata._replace(encoder_token_lengths=[16])
    counts = "2 item_refs, 1 encoder_token_lengths, 2 output_embedding_lengths"
    with pytest.raises(ValueError, match=counts):
        misaligned.validate()

    zero_rows = metadata._replace(output_embedding_lengths=[4, 0])
    offending = r"output_embedding_lengths must be positive, got \[4, 0\].*\('image', 1\), 0"
    with pytest.raises(ValueError, match=offending):
        zero_rows.validate()

    negative_tokens = metadata._replace(encoder_token_lengths=[-1, 64])
    with pytest.raises(ValueError, match="encoder_token_lengths must be positive"):
        negative_tokens.validate()
