"""The vision tower cut for CUDA-graph capture (prelude / block loop / postlude) equals transformers'
own tower, and padding to a graph bucket, as the encoder's graph runner does it, changes no real row.
All on CPU: the capture itself is tested in tests/encoder/test_graph_runner_cuda.py."""
from __future__ import annotations

import pytest
import torch

from epd.encoder.graph_runner import EncoderGraphBuckets
from epd.models.locate import resolve_model
from epd.models.qwen2_vl.vision import QwenVisionEncoder
from epd.models.qwen2_vl.vision_blocks import HIDDEN, WINDOW_IDS

from ..conftest import make_image_bytes

IMAGE_SETS = {
    "one": [(224, 224)],
    "three, uneven windows": [(300, 140), (90, 200), (224, 168)],
}


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def encoder(request) -> QwenVisionEncoder:
    return QwenVisionEncoder(resolve_model(request.param))


def _pixels(encoder: QwenVisionEncoder, sizes):
    images = [make_image_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    return encoder.preprocess(images)


@pytest.mark.parametrize("sizes", IMAGE_SETS.values(), ids=IMAGE_SETS.keys())
def test_split_tower_equals_transformers_tower(encoder, sizes):
    pixel_values, grid_thw = _pixels(encoder, sizes)
    with torch.inference_mode():
        reference = encoder.tower(pixel_values, grid_thw=grid_thw).pooler_output
    ours = encoder.block_loop().run_eager(pixel_values, grid_thw)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_windowed_tower_really_uses_several_windows(encoder):
    """Guards the test above: with one window per image, window and full attention coincide."""
    if encoder.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2-VL has no window attention")
    prelude = encoder.block_loop().prelude(*_pixels(encoder, IMAGE_SETS["three, uneven windows"]))
    assert prelude.inputs[WINDOW_IDS].unique().numel() > len(prelude.seq_lengths)


@pytest.mark.parametrize("bucket", [(2000, 4), (1400, 3)], ids=["roomy", "tight"])
def test_padding_to_a_bucket_changes_no_real_row(encoder, bucket):
    """What the graph runner does before a replay, done by hand: zero rows after the real tokens,
    dummy contexts after the real ones; the real rows must come out as without padding."""
    pixel_values, grid_thw = _pixels(encoder, IMAGE_SETS["three, uneven windows"])
    loop = encoder.block_loop()
    prelude = loop.prelude(pixel_values, grid_thw)
    num_tokens = prelude.inputs[HIDDEN].shape[0]
    plan = EncoderGraphBuckets([bucket])
    chosen = plan.select_bucket(num_tokens, len(prelude.seq_lengths))
    assert chosen is not None, f"{num_tokens} tokens should fit bucket {bucket}"
    padded_tokens = plan.padded_key_for_bucket(chosen).total_tokens
    padded = {name: torch.cat([t, t.new_zeros((padded_tokens - num_tokens, *t.shape[1:]))])
              for name, t in prelude.inputs.items()}
    metadata = loop.metadata_provider.create(plan.padded_key_for_bucket(chosen), torch.device("cpu"))
    loop.metadata_provider.prepare(metadata, plan.padded_seq_lengths(prelude.seq_lengths, chosen))
    with torch.inference_mode():
        hidden = loop.block_loop(padded, metadata)[HIDDEN][:num_tokens]
        unpadded = loop.run_eager(pixel_values, grid_thw)
    torch.testing.assert_close(loop.postlude(hidden, prelude), unpadded, rtol=1e-5, atol=1e-5)


def test_metadata_refill_keeps_the_buffer_and_checks_the_token_count(encoder):
    loop = encoder.block_loop()
    metadata = loop.metadata_provider.create(EncoderGraphBuckets([(8, 2)]).padded_key_for_bucket(
        EncoderGraphBuckets([(8, 2)]).buckets[0]), torch.device("cpu"))
    address = metadata.segment_ids.data_ptr()
    loop.metadata_provider.prepare(metadata, [3, 5, 1])
    assert metadata.segment_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2]
    assert metadata.segment_ids.data_ptr() == address
    with pytest.raises(ValueError, match="cover 4 tokens, the metadata holds 9"):
        loop.metadata_provider.prepare(metadata, [2, 2])
