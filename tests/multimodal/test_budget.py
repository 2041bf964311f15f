import logging
from types import SimpleNamespace

import pytest
import torch

from epd.multimodal.budget import (
    log_encoder_token_budget,
    resolve_bytes_per_mm_encoder_embedding,
    resolve_mm_encoder_token_budget,
)


def test_budget_is_raised_to_the_largest_atomic_item():
    assert resolve_mm_encoder_token_budget(4096, 8192) == 8192
    assert resolve_mm_encoder_token_budget(16384, 8192) == 16384
    with pytest.raises(ValueError, match="positive, got 0"):
        resolve_mm_encoder_token_budget(0, 10)
    with pytest.raises(ValueError, match="non-negative, got -1"):
        resolve_mm_encoder_token_budget(10, -1)


def test_budget_log_line_warns_only_when_raised(caplog):
    logger = logging.getLogger("test_budget")
    with caplog.at_level(logging.INFO, logger="test_budget"):
        log_encoder_token_budget(4096, 8192, 8192, logger)
        log_encoder_token_budget(16384, 16384, 8192, logger)
    raised, kept = caplog.records
    assert raised.levelno == logging.WARNING
    assert raised.getMessage().startswith(
        "Multimodal encoder token budget: configured=4096, effective=8192, model_atomic_max=8192"
    )
    assert kept.levelno == logging.INFO
    assert kept.getMessage() == (
        "Multimodal encoder token budget: configured=16384, effective=16384, model_atomic_max=8192"
    )
    assert all("\n" not in record.getMessage() for record in caplog.records)


class _DeclaredModel:
    embedding_dim = 1024
    embedding_dtype = torch.float32


class _UnimplementedMixin:
    @property
    def embedding_dim(self):
        raise NotImplementedError


def test_declared_embedding_dim_and_dtype_win():
    text_layer = torch.nn.Embedding(4, 8, dtype=torch.float16)
    model = _DeclaredModel()
    model.text_embedding_layer = text_layer
    config = SimpleNamespace(hidden_size=7)
    assert resolve_bytes_per_mm_encoder_embedding(model, config, torch.bfloat16) == 1024 * 4


def test_declared_dim_without_dtype_uses_torch_dtype():
    model = SimpleNamespace(embedding_dim=512, embedding_dtype=None)
    assert resolve_bytes_per_mm_encoder_embedding(model, None, torch.bfloat16) == 512 * 2
    assert resolve_bytes_per_mm_encoder_embedding(model, None, "torch.float32") == 512 * 4


def test_falls_back_to_text_embedding_weight():
    text_layer = torch.nn.Embedding(4, 96, dtype=torch.bfloat16, device="meta")
    model = SimpleNamespace(text_embedding_layer=text_layer)
    config = SimpleNamespace(hidden_size=10)
    assert resolve_bytes_per_mm_encoder_embedding(model, config, torch.float32) == 96 * 2
    # A mixin property that is not implemented counts as absent: hidden_size 10 x 2 bytes.
    unimplemented = _UnimplementedMixin()
    assert resolve_bytes_per_mm_encoder_embedding(unimplemented, config, torch.float16) == 20


def test_falls_back_to_pretrained_hidden_size_including_text_config():
    top_level = SimpleNamespace(hidden_size=3584)
    nested = SimpleNamespace(text_config=SimpleNamespace(hidden_size=2048))
    assert resolve_bytes_per_mm_encoder_embedding(object(), top_level, torch.bfloat16) == 3584 * 2
    assert resolve_bytes_per_mm_encoder_embedding(object(), nested, "bfloat16") == 2048 * 2


def test_error_names_all_three_paths():
    with pytest.raises(ValueError) as error:
        resolve_bytes_per_mm_encoder_embedding(object(), SimpleNamespace(), torch.float16)
    message = str(error.value)
    paths = ("model.embedding_dim", "model.text_embedding_layer.weight", "text_config.hidden_size")
    for path in paths:
        assert path in message
    with pytest.raises(ValueError, match="expected a torch.dtype or dtype name, got 'float99'"):
        resolve_bytes_per_mm_encoder_embedding(object(), SimpleNamespace(hidden_size=8), "float99")
