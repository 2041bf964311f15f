"""Bucket arithmetic, padding and pointer checks: plain CPU (capture/replay: test_graph_runner_cuda.py)."""
from types import SimpleNamespace

import pytest
import torch

from epd.encoder.graph_runner import (  # noqa: I001
    _PADDING_TOKEN_RESERVE,
    CuSeqlensMetadataProvider,
    EncoderGraphBuckets,
    EncoderGraphKey,
    EncoderGraphTensorSpec,
    MultimodalEncoderGraphRunner,
    _assert_metadata_buffers_stable,
    _slice_token_axis,
    _snapshot_metadata_tensor_ptrs,
)

BUCKETS = [(256, 4), (64, 2), (64, 1), (128, 2)]


def test_key_field_order_is_smallest_fit_order():
    assert EncoderGraphKey._fields == ("total_tokens", "num_contexts")
    plan = EncoderGraphBuckets(BUCKETS)
    assert plan.buckets == [(64, 1), (64, 2), (128, 2), (256, 4)]
    assert all(isinstance(b, EncoderGraphKey) for b in plan.buckets)


def test_padded_key_reserves_one_token_and_one_context():
    assert _PADDING_TOKEN_RESERVE == 1
    plan = EncoderGraphBuckets(BUCKETS)
    assert plan.padded_key_for_bucket(EncoderGraphKey(64, 2)) == (65, 3)
    assert EncoderGraphBuckets(BUCKETS, enable_padding=False).padded_key_for_bucket(EncoderGraphKey(64, 2)) == (64, 2)


def test_select_picks_the_smallest_fitting_bucket():
    plan = EncoderGraphBuckets(BUCKETS)
    assert plan.select_bucket(10, 1) == (64, 1)
    assert plan.select_bucket(64, 1) == (64, 1)  # exactly full: the reserve token feeds the dummy
    assert plan.select_bucket(40, 2) == (64, 2)
    assert plan.select_bucket(65, 1) == (128, 2)
    assert plan.select_bucket(200, 3) == (256, 4)
    assert plan.select_bucket(257, 1) is None  # too many tokens: run eager
    assert plan.select_bucket(10, 5) is None  # too many contexts


def test_select_needs_a_padding_token_for_every_extra_context():
    plan = EncoderGraphBuckets([(64, 4), (128, 4)])
    # 63 tokens in 1 context: 64 + 1 - 63 = 2 padding tokens for 5 - 1 = 4 extra contexts: no
    assert not plan.fits(EncoderGraphKey(64, 4), 63, 1)
    assert plan.select_bucket(63, 1) == (128, 4)
    assert plan.select_bucket(61, 1) == (64, 4)


def test_padded_seq_lengths_fill_the_padded_key_without_empty_contexts():
    plan = EncoderGraphBuckets(BUCKETS)
    bucket = EncoderGraphKey(256, 4)
    lengths = plan.padded_seq_lengths([100, 50], bucket)
    assert lengths == [100, 50, 105, 1, 1]
    assert sum(lengths) == 257 and len(lengths) == 5 and min(lengths) >= 1
    assert plan.padded_seq_lengths([64], EncoderGraphKey(64, 1)) == [64, 1]
    assert plan.dummy_padded_seq_lengths(bucket) == [253, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="do not fit bucket"):
        plan.padded_seq_lengths([65], EncoderGraphKey(64, 1))
    with pytest.raises(ValueError, match="must be positive"):
        plan.padded_seq_lengths([0, 5], bucket)


def test_without_padding_only_exact_matches_fit():
    plan = EncoderGraphBuckets(BUCKETS, enable_padding=False)
    assert plan.select_bucket(64, 2) == (64, 2)
    assert plan.select_bucket(63, 2) is None
    assert plan.padded_seq_lengths([30, 34], EncoderGraphKey(64, 2)) == [30, 34]
    assert sum(plan.dummy_padded_seq_lengths(EncoderGraphKey(64, 3))) == 64


def test_bucket_validation():
    with pytest.raises(ValueError, match="at least one"):
        EncoderGraphBuckets([])
    with pytest.raises(ValueError, match="0 < num_contexts <= total_tokens"):
        EncoderGraphBuckets([(2, 3)])


def test_tensor_spec_inserts_the_token_axis():
    assert EncoderGraphTensorSpec((32,), torch.float32).full_shape(10) == (10, 32)
    assert EncoderGraphTensorSpec((4, 8), torch.float32, token_dim=1).full_shape(10) == (4, 10, 8)


def test_outputs_are_views_sliced_on_the_token_axis():
    captured = torch.arange(24.0).reshape(2, 12)
    view = _slice_token_axis(captured, 1, 5)
    assert view.shape == (2, 5) and view.data_ptr() == captured.data_ptr()
    captured.add_(1)
    assert view[0, 0] == 1  # aliases the captured output


def test_metadata_pointer_snapshot_catches_reallocation():
    provider = CuSeqlensMetadataProvider()
    metadata = provider.create(EncoderGraphKey(9, 3), torch.device("cpu"))
    provider.prepare(metadata, [4, 3, 2])
    assert metadata.cu_seqlens.tolist() == [0, 4, 7, 9] and metadata.seq_lens.tolist() == [4, 3, 2]
    snapshot = _snapshot_metadata_tensor_ptrs(metadata, provider.graph_critical_attrs)
    provider.prepare(metadata, [1, 1, 7])  # refills in place
    _assert_metadata_buffers_stable(metadata, snapshot, EncoderGraphKey(9, 3))
    metadata.cu_seqlens = torch.zeros(4, dtype=torch.int32)  # a reassignment the graph cannot see
    with pytest.raises(RuntimeError, match=r"metadata.cu_seqlens moved from 0x[0-9a-f]+ to 0x[0-9a-f]+; "
                                           r"the captured kernels would read stale memory"):
        _assert_metadata_buffers_stable(metadata, snapshot, EncoderGraphKey(9, 3))
    with pytest.raises(ValueError, match="'missing' is not a tensor"):
        _snapshot_metadata_tensor_ptrs(SimpleNamespace(), ["missing"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_runner_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device, got cpu"):
        MultimodalEncoderGraphRunner(lambda i, m: {}, buckets=[(8, 1)], input_specs={}, output_specs={},
                                     metadata_provider=CuSeqlensMetadataProvider(), device="cpu")
