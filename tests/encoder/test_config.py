import pytest

from epd.config import ConfigError, EncoderConfig, load_config


def test_defaults_and_yaml_style_buckets():
    assert EncoderConfig().encoder_batch_size > 0
    config = load_config(EncoderConfig, {"device": "cuda:1", "cuda_graph_buckets": [[1024, 4], [256, 1]]})
    assert config.cuda_graph_buckets == ((1024, 4), (256, 1))
    hash(config)  # frozen and hashable


@pytest.mark.parametrize("kwargs, message", [
    ({"encoder_batch_size": 0}, "encoder_batch_size: Input should be greater than 0, got 0"),
    ({"encoder_max_num_tokens": True}, "encoder_max_num_tokens: expected an integer, got True"),
    ({"output_budget_bytes": -1}, "output_budget_bytes: Input should be greater than 0, got -1"),
    ({"output_budget_bytes": 10, "max_output_rows": 2}, "output_budget_bytes or max_output_rows, not both"),
    ({"output_budget_bytes": 100, "encoder_cache_max_bytes": 99},
     "encoder_cache_max_bytes=99 must be >= output_budget_bytes=100"),
    ({"dtype": "int8"}, "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'int8'"),
    ({"device": "gpu"}, "device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ({"device": "cuda", "cuda_graph_buckets": [(8,)]}, r"cuda_graph_buckets.0.1: Field required"),
    ({"device": "cuda", "cuda_graph_buckets": [(2, 3)]}, "total_tokens must be >= num_contexts"),
    ({"device": "cuda", "cuda_graph_buckets": [(8, 1), (8, 1)]}, "duplicates"),
    ({"device": "cpu", "cuda_graph_buckets": [(8, 1)]}, "needs a CUDA device, got device='cpu'"),
])
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(EncoderConfig, kwargs, source="encoder.yaml")
    assert str(info.value).startswith("encoder.yaml: ") and "\n" not in str(info.value)


def test_torch_dtype():
    import torch
    assert EncoderConfig(dtype="bfloat16").torch_dtype is torch.bfloat16
