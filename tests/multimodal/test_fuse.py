import pytest
import torch

from epd.multimodal.fuse import (
    filter_mm_token_from_input_ids,
    fuse_input_embeds,
    prepare_multimodal_indices,
    ship_multimodal_indices,
)

VOCAB, HIDDEN = 16, 4
IMAGE_ID = 7  # in-vocab placeholder
OOV_ID = VOCAB + 1  # legacy sentinel


@pytest.fixture
def embedding():
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, HIDDEN)


def _ids(placeholder):
    return torch.tensor([1, placeholder, placeholder, 2, 3, placeholder, 4])


def _mm_embeds():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(rows, HIDDEN, generator=generator) for rows in (2, 1)]


def _reference(embedding, input_ids, placeholder, mm_embed):
    """Row by row: next encoder row at placeholders, vocabulary row elsewhere."""
    rows, next_mm = [], 0
    for token in input_ids.tolist():
        if token == placeholder:
            rows.append(mm_embed[next_mm])
            next_mm += 1
        else:
            rows.append(embedding.weight[token])
    return torch.stack(rows)


@torch.no_grad()
def test_three_paths_match_reference(embedding):
    mm_embeds = _mm_embeds()
    in_vocab, oov = _ids(IMAGE_ID), _ids(OOV_ID)
    expected = _reference(embedding, in_vocab, IMAGE_ID, torch.cat(mm_embeds))
    assert torch.equal(expected, _reference(embedding, oov, OOV_ID, torch.cat(mm_embeds)))

    image_ids = torch.tensor([IMAGE_ID], dtype=torch.int32)
    text_idx, mm_idx = prepare_multimodal_indices(
        in_vocab.tolist(), vocab_size=VOCAB, mm_token_ids=image_ids
    )
    indices = {"text_token_indices": text_idx, "mm_token_indices": mm_idx}
    int32_indices = {"text_token_indices": text_idx.int(), "mm_token_indices": mm_idx.int()}
    results = {
        # (1) indices, OOV-safe gather because mm_token_ids is absent
        "indices": fuse_input_embeds(embedding, in_vocab, mm_embeds, **indices),
        # (1) indices, in-vocab full lookup; int32 indices are cast by _as_copy_index
        "indices+ids": fuse_input_embeds(
            embedding, in_vocab, mm_embeds, mm_token_ids=image_ids, **int32_indices
        ),
        # (2) in-vocab fast path
        "in_vocab": fuse_input_embeds(embedding, in_vocab, mm_embeds, mm_token_ids=image_ids),
        # (3) OOV path: a full lookup of id 17 would be out of bounds
        "oov": fuse_input_embeds(embedding, oov, mm_embeds),
    }
    for name, (fused, extra) in results.items():
        assert extra is None, name
        assert torch.equal(fused, expected), name


@torch.no_grad()
def test_indexed_path_never_calls_torch_where(embedding, monkeypatch):
    input_ids = _ids(OOV_ID)
    text_idx, mm_idx = prepare_multimodal_indices(
        input_ids.tolist(), vocab_size=VOCAB, mm_token_ids=None
    )

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.where would host-sync on an accelerator")

    monkeypatch.setattr(torch, "where", forbidden)
    fused, _ = fuse_input_embeds(
        embedding, input_ids, _mm_embeds(), text_token_indices=text_idx, mm_token_indices=mm_idx
    )
    assert fused.shape == (7, HIDDEN)


@torch.no_grad()
def test_count_mismatch_names_both_counts(embedding):
    too_few = [torch.zeros(2, HIDDEN)]
    counts = "found 3 image tokens in input_ids but received 2 image embeddings"
    with pytest.raises(ValueError, match=counts):
        fuse_input_embeds(embedding, _ids(IMAGE_ID), too_few, mm_token_ids=torch.tensor([IMAGE_ID]))
    with pytest.raises(ValueError, match="Multimodal token count mismatch"):
        fuse_input_embeds(embedding, _ids(OOV_ID), too_few)
    with pytest.raises(ValueError, match="found 3 image tokens .* received 0 image embeddings"):
        fuse_input_embeds(
            embedding,
            _ids(OOV_ID),
            [],
            text_token_indices=torch.tensor([0, 3, 4, 6]),
            mm_token_indices=torch.tensor([1, 2, 5]),
        )


@torch.no_grad()
def test_shape_errors(embedding):
    with pytest.raises(ValueError, match=r"\[rows, 4\]"):
        fuse_input_embeds(embedding, _ids(OOV_ID), [torch.zeros(3, HIDDEN + 1)])
    with pytest.raises(ValueError, match="flat"):
        fuse_input_embeds(embedding, _ids(OOV_ID)[None], _mm_embeds())
    with pytest.raises(ValueError, match="must cover all 7"):
        fuse_input_embeds(
            embedding, _ids(OOV_ID), _mm_embeds(),
            text_token_indices=torch.tensor([0, 3]), mm_token_indices=torch.tensor([1, 2, 5]),
        )


@torch.no_grad()
def test_no_mm_embeds_is_plain_lookup(embedding):
    input_ids = torch.tensor([1, 2, 3])
    for empty in ([], torch.zeros(0, HIDDEN), [torch.zeros(0, HIDDEN)]):
        fused, extra = fuse_input_embeds(
            embedding, input_ids, empty, extra_embeds=[torch.zeros(0, HIDDEN)]
        )
        assert torch.equal(fused, embedding(input_ids))
        assert extra is None


@torch.no_grad()
def test_deepstack_extra_embeds_are_zero_at_text_rows(embedding):
    input_ids = _ids(IMAGE_ID)
    features = [torch.full((3, 6), 1.0), torch.arange(18, dtype=torch.float32).reshape(3, 6)]
    image_ids = torch.tensor([IMAGE_ID])
    _, extra = fuse_input_embeds(
        embedding, input_ids, _mm_embeds(), mm_token_ids=image_ids, extra_embeds=features
    )
    mm_rows = [1, 2, 5]
    text_rows = [0, 3, 4, 6]
    assert len(extra) == 2
    for fused_feature, feature in zip(extra, features):
        assert fused_feature.shape == (7, 6)
        assert torch.equal(fused_feature[text_rows], torch.zeros(4, 6))
        assert torch.equal(fused_feature[mm_rows], feature)
    with pytest.raises(ValueError, match="deepstack feature 0 has 2 rows .* 3 multimodal tokens"):
        fuse_input_embeds(
            embedding,
            input_ids,
            _mm_embeds(),
            mm_token_ids=image_ids,
            extra_embeds=[torch.zeros(2, 6)],
        )


def test_filter_mm_token_from_input_ids_both_discriminators():
    input_ids = torch.tensor([1, 17, 7, 2])
    text_idx, mm_idx = filter_mm_token_from_input_ids(input_ids, vocab_size=VOCAB)
    assert text_idx.tolist() == [0, 2, 3] and mm_idx.tolist() == [1]
    text_idx, mm_idx = filter_mm_token_from_input_ids(
        input_ids, vocab_size=VOCAB, mm_token_ids=torch.tensor([7])
    )
    assert text_idx.tolist() == [0, 1, 3] and mm_idx.tolist() == [2]


def test_prepare_multimodal_indices_are_int64_on_cpu():
    text_idx, mm_idx = prepare_multimodal_indices(
        [1, 7, 7, 2], vocab_size=VOCAB, mm_token_ids=torch.tensor([7], dtype=torch.int32)
    )
    for index in (text_idx, mm_idx):
        assert index.dtype == torch.int64 and index.device.type == "cpu"
    assert text_idx.tolist() == [0, 3] and mm_idx.tolist() == [1, 2]


def test_ship_multimodal_indices_appends_trailing_text_tokens():
    text_idx, mm_idx = torch.tensor([0, 3]), torch.tensor([1, 2])
    shipped_text, shipped_mm = ship_multimodal_indices(
        text_idx, mm_idx, "cpu", num_ctx_tokens=4, total_num_tokens=7
    )
    assert shipped_text.tolist() == [0, 3, 4, 5, 6] and shipped_text.dtype == torch.int64
    assert shipped_mm.tolist() == [1, 2]
    meta_text, meta_mm = ship_multimodal_indices(
        text_idx, mm_idx, "meta", num_ctx_tokens=4, total_num_tokens=4
    )
    assert meta_text.device.type == meta_mm.device.type == "meta"
    assert meta_text.shape == (2,)


def test_ship_multimodal_indices_rejects_bad_input():
    with pytest.raises(ValueError, match=r"total_num_tokens \(3\) must be >= num_ctx_tokens \(4\)"):
        ship_multimodal_indices(
            torch.tensor([0]), torch.tensor([1]), "cpu", num_ctx_tokens=4, total_num_tokens=3
        )
    with pytest.raises(ValueError, match="mm_idx_cpu must be computed on CPU"):
        on_meta = torch.tensor([1], device="meta")
        ship_multimodal_indices(
            torch.tensor([0]), on_meta, "cpu", num_ctx_tokens=2, total_num_tokens=2
        )
