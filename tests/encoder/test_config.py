import pytest

from epd.config import from_dict
from epd.encoder.config import EncoderConfig


def test_defaults_and_yaml_style_buckets():
    assert EncoderConfig().encoder_batch_size > 0
    config = from_dict(EncoderConfig, {"device": "cuda:1", "cuda_graph_buckets": [[1024, 4], [256, 1]]})
    assert config.cuda_graph_buckets == ((1024, 4), (256, 1))
    hash(config)  # frozen and hashable


@pytest.mark.parametrize("kwargs, message", [
    ({"encoder_batch_size": 0}, "encoder_batch_size must be a positive int, got 0"),
    ({"encoder_max_num_tokens": True}, "encoder_max_num_tokens must be a positive int, got True"),
    ({"output_budget_bytes": -1}, "output_budget_bytes must be a positive int, got -1"),
    ({"output_budget_bytes": 10, "max_output_rows": 2}, "output_budget_bytes or max_output_rows, not both"),
    ({"output_budget_bytes": 100, "encoder_cache_max_bytes": 99},
     "encoder_cache_max_bytes=99 must be >= output_budget_bytes=100"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ({"device": "cuda", "cuda_graph_buckets": [(8,)]}, r"\(total_tokens, num_contexts\) pairs"),
    ({"device": "cuda", "cuda_graph_buckets": [(2, 3)]}, "total_tokens must be >= num_contexts"),
    ({"device": "cuda", "cuda_graph_buckets": [(8, 1), (8, 1)]}, "duplicates"),
    ({"cuda_graph_buckets": [(8, 1)]}, "needs a CUDA device, got device='cpu'"),
])
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderConfig(**kwargs)


def test_torch_dtype():
    import torch
    assert EncoderConfig(dtype="bfloat16").torch_dtype is torch.bfloat16
