"""Encoder-side budgets: attention tokens per encoder batch, bytes per output row.

The encoder is budgeted in two units the LLM side never uses: encoder attention
tokens (pre-merger patches, what one encoder forward attends over) and bytes of
resident output embeddings (rows x bytes per row).
"""

from __future__ import annotations

import logging

import torch


def resolve_mm_encoder_token_budget(base_budget: int, model_max_atomic_item_tokens: int) -> int:
    """Keep the model's largest indivisible item schedulable.

    An item cannot be split across encoder batches, so a budget below the
    largest legal item would starve every request that carries one.
    """
    if base_budget <= 0:
        raise ValueError(f"encoder token budget must be positive, got {base_budget}")
    if model_max_atomic_item_tokens < 0:
        raise ValueError(
            f"model_max_atomic_item_tokens must be non-negative, got {model_max_atomic_item_tokens}"
        )
    return max(base_budget, model_max_atomic_item_tokens)


def log_encoder_token_budget(
    configured: int, effective: int, model_atomic_max: int, logger: logging.Logger
) -> None:
    """One diagnostic line; a warning when the configured budget was raised."""
    line = (
        f"Multimodal encoder token budget: configured={configured}, "
        f"effective={effective}, model_atomic_max={model_atomic_max}"
    )
    if effective > configured:
        logger.warning("%s (raised so the largest indivisible item stays schedulable)", line)
    else:
        logger.info("%s", line)


def resolve_bytes_per_mm_encoder_embedding(model, pretrained_config, torch_dtype) -> int:
    """Bytes of one cached embedding row, from the most specific source available.

    1. ``model.embedding_dim`` x element size of ``model.embedding_dtype``
       (or ``torch_dtype``);
    2. ``model.text_embedding_layer.weight``: last dim x element size;
    3. ``pretrained_config.hidden_size`` (or ``.text_config.hidden_size``)
       x ``torch_dtype`` itemsize.
    Most VLMs declare neither attribute of step 1, so steps 2 and 3 are common.
    """
    dtype = _as_torch_dtype(torch_dtype)
    row_bytes = (
        _from_declared_dim(model, dtype)
        or _from_text_embedding(model)
        or _from_pretrained_config(pretrained_config, dtype)
    )
    if row_bytes:
        return row_bytes
    raise ValueError(
        "Cannot determine bytes per multimodal encoder embedding row. Tried: "
        "(1) model.embedding_dim with model.embedding_dtype or torch_dtype, "
        "(2) model.text_embedding_layer.weight, "
        "(3) pretrained_config.hidden_size or pretrained_config.text_config.hidden_size "
        f"with torch_dtype (got torch_dtype={torch_dtype!r}). Declare embedding_dim/"
        "embedding_dtype on the model to fix this."
    )


def _from_declared_dim(model, dtype: torch.dtype | None) -> int | None:
    embedding_dim = _optional_attr(model, "embedding_dim")
    if embedding_dim is None:
        return None
    row_dtype = _as_torch_dtype(_optional_attr(model, "embedding_dtype")) or dtype
    if row_dtype is None:
        return None
    # torch.empty(()) instead of a dtype->bytes table: any dtype torch knows works.
    return int(embedding_dim) * torch.empty((), dtype=row_dtype).element_size()


def _from_text_embedding(model) -> int | None:
    weight = _optional_attr(_optional_attr(model, "text_embedding_layer"), "weight")
    if not isinstance(weight, torch.Tensor):
        return None
    return int(weight.shape[-1]) * weight.element_size()


def _from_pretrained_config(pretrained_config, dtype: torch.dtype | None) -> int | None:
    hidden_size = _optional_attr(pretrained_config, "hidden_size") or _optional_attr(
        _optional_attr(pretrained_config, "text_config"), "hidden_size"
    )
    if hidden_size is None or dtype is None:
        return None
    return int(hidden_size) * dtype.itemsize


def _optional_attr(obj, name: str):
    """``getattr`` that also treats unimplemented optional mixin properties as absent."""
    if obj is None:
        return None
    try:
        return getattr(obj, name, None)
    except NotImplementedError:
        return None


def _as_torch_dtype(value) -> torch.dtype | None:
    """Accept torch dtypes and config strings such as "bfloat16" or "torch.float16"."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(f"expected a torch.dtype or dtype name, got {value!r}")
