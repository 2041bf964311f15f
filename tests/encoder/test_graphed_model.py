"""GraphedVisionEncoder's plumbing on CPU: prelude -> bucketed block loop -> postlude -> rows per
item, and the eager fallback. The CUDA runner is replaced by one that does on CPU what a replay does
(zero-padded static buffers, dummy contexts); capture itself: test_graphed_model_cuda.py."""
import pytest
import torch

import epd.encoder.graphed_model as graphed_model
from epd.encoder.graph_runner import EncoderGraphBuckets
from epd.models.locate import resolve_model
from epd.models.qwen2_vl.vision import QwenVisionEncoder

from ..conftest import make_image_bytes


class PaddedEagerRunner:
    """The data path of MultimodalEncoderGraphRunner.maybe_run, without capture."""

    def __init__(self, encoder_fn, *, buckets, input_specs, output_specs, metadata_provider, device):
        self.encoder_fn, self.specs, self.provider = encoder_fn, input_specs, metadata_provider
        self.plan = EncoderGraphBuckets(buckets)
        self.device = torch.device(device)
        self.buckets, self.captured_keys = self.plan.buckets, [self.plan.padded_key_for_bucket(b)
                                                               for b in self.plan.buckets]
        self.replayed_keys = []

    def select_bucket(self, total_tokens, num_contexts):
        return self.plan.select_bucket(total_tokens, num_contexts)

    def maybe_run(self, inputs, seq_lengths):
        bucket = self.plan.select_bucket(sum(seq_lengths), len(seq_lengths))
        key = self.plan.padded_key_for_bucket(bucket)
        real = sum(seq_lengths)
        static = {}
        for name, spec in self.specs.items():
            assert inputs[name].dtype == spec.dtype and tuple(inputs[name].shape) == spec.full_shape(real), name
            buffer = torch.zeros(spec.full_shape(key.total_tokens), dtype=spec.dtype)
            buffer[:real] = inputs[name]
            static[name] = buffer
        metadata = self.provider.create(key, self.device)
        self.provider.prepare(metadata, self.plan.padded_seq_lengths(seq_lengths, bucket))
        self.replayed_keys.append(key)
        return {name: out[:real] for name, out in self.encoder_fn(static, metadata).items()}


@pytest.fixture(params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def graphed(request, monkeypatch):
    monkeypatch.setattr(graphed_model, "MultimodalEncoderGraphRunner", PaddedEagerRunner)
    model = QwenVisionEncoder(resolve_model(request.param))
    return graphed_model.GraphedVisionEncoder(model, ((1024, 2), (4096, 4)), device="cpu")


def test_bucketed_rows_equal_the_eager_tower_item_by_item(graphed):
    images = [make_image_bytes(w, h, seed=i) for i, (w, h) in enumerate([(300, 140), (90, 200), (224, 168)])]
    pixel_values, grid_thw = graphed.preprocess(images)
    rows = graphed.encode(pixel_values, grid_thw)
    assert graphed.num_graph_batches == 1 and graphed.runner.replayed_keys == [(4097, 5)]
    for ours, ref in zip(rows, graphed.model.encode(pixel_values, grid_thw), strict=True):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_what_fits_no_bucket_goes_to_the_eager_tower(graphed):
    images = [make_image_bytes(112, 112, seed=i) for i in range(5)]  # 5 contexts > 4
    rows = graphed.encode(*graphed.preprocess(images))
    assert (graphed.num_graph_batches, graphed.num_eager_batches) == (0, 1) and len(rows) == 5
    assert graphed.runner.replayed_keys == []
