"""Placeholder masks and per-item row accounting, computed once per prompt on CPU.

A placeholder position is one of:
  * an embed slot: its row comes from the encoder output (``embed_mask``);
  * a special token (image_break, image_newline, ...): part of the item's span
    but embedded from the vocabulary (``special_mask``).
``mm_mask`` is their union: the item's full span in the prompt. The invariant
that holds the pipeline together is: placeholder count == embedding rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class MultimodalMasks:
    mm_mask: torch.Tensor  # bool, like input_ids: embed slot or special token
    embed_mask: torch.Tensor  # bool, like input_ids: embed slot only
    special_mask: torch.Tensor | None  # bool, like input_ids; None without special ids


def compute_mm_masks(
    input_ids: torch.Tensor,
    *,
    mm_token_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
    mm_special_token_ids: torch.Tensor | None = None,
) -> MultimodalMasks:
    """Classify every position of ``input_ids`` in one pass.

    ``mm_token_ids`` (in-vocabulary placeholder ids) wins over ``vocab_size``
    (legacy out-of-vocabulary sentinels, ``id >= vocab_size``). Example:
    input_ids=[1, 5, 5, 6, 5, 7, 2], mm_token_ids=[5], special=[6, 7] gives
    embed_mask=[F, T, T, F, T, F, F] and mm_mask=[F, T, T, T, T, T, F].
    """
    if mm_token_ids is not None:
        embed_mask = torch.isin(input_ids, mm_token_ids.to(input_ids.device))
    elif vocab_size is not None:
        embed_mask = input_ids >= vocab_size
    else:
        # Without a discriminator every mask would be all False and images would
        # silently never reach the model.
        raise ValueError(
            "compute_mm_masks needs mm_token_ids or vocab_size to tell placeholders "
            "from text; got neither"
        )
    if mm_special_token_ids is None:
        return MultimodalMasks(mm_mask=embed_mask, embed_mask=embed_mask, special_mask=None)
    special_mask = torch.isin(input_ids, mm_special_token_ids.to(input_ids.device))
    # A special id that also looks like a placeholder (e.g. an OOV sentinel
    # break token) is still special: its row comes from the vocabulary.
    embed_mask = embed_mask & ~special_mask
    return MultimodalMasks(
        mm_mask=embed_mask | special_mask, embed_mask=embed_mask, special_mask=special_mask
    )


def find_mm_embedding_lengths_from_masks(
    mm_mask: torch.Tensor, embed_mask: torch.Tensor, num_mm_tokens: list[int]
) -> list[int]:
    """Embedding rows per item, given each item's full span ``num_mm_tokens``.

    Spans are consecutive runs of ``mm_mask`` positions in prompt order; an
    item's rows are the embed slots inside its span (span minus specials).
    """
    if mm_mask.shape != embed_mask.shape:
        raise ValueError(
            f"mm_mask and embed_mask must have the same shape, got "
            f"{tuple(mm_mask.shape)} and {tuple(embed_mask.shape)}"
        )
    negative = [length for length in num_mm_tokens if length < 0]
    if negative:
        raise ValueError(f"num_mm_tokens must be non-negative, got {num_mm_tokens}")
    mm_positions = torch.nonzero(mm_mask.reshape(-1)).squeeze(1)
    expected_total = sum(num_mm_tokens)
    if mm_positions.numel() != expected_total:
        raise ValueError(
            f"Number of multimodal tokens ({mm_positions.numel()}) does not match sum of "
            f"per-item lengths ({expected_total}): num_mm_tokens={num_mm_tokens}"
        )
    embed_at_mm = embed_mask.reshape(-1)[mm_positions].to(torch.int64)
    return [int(span.sum()) for span in torch.split(embed_at_mm, list(num_mm_tokens))]


def embed_mask_cumsum(embed_mask: torch.Tensor) -> torch.Tensor:
    """int64 CPU prefix sum of ``embed_mask``: cs[i] = embed slots in positions [0, i].

    Lets MultimodalRuntimeData answer "which rows does this chunk need" with
    O(1) lookups. Kept on CPU because those lookups are Python scalar reads.
    """
    if embed_mask.dim() != 1:
        raise ValueError(
            f"embed_mask must be 1-D (one prompt), got shape {tuple(embed_mask.shape)}"
        )
    return torch.cumsum(embed_mask.to("cpu"), dim=0, dtype=torch.int64)


class MultimodalEncoderItemMetadata(NamedTuple):
    # (modality, local index) per atomic item, in prompt order.
    item_refs: list[tuple[str, int]]
    # Encoder attention tokens per item (pre-merger patches for Qwen ViTs): the
    # unit charged against encoder_max_num_tokens.
    encoder_token_lengths: list[int]
    # Embedding rows per item in the LLM prompt (post-merger); must equal the
    # item's embed slots, and sizes/splits the encoder output.
    output_embedding_lengths: list[int]

    def validate(self) -> None:
        num_refs = len(self.item_refs)
        num_encoder = len(self.encoder_token_lengths)
        num_output = len(self.output_embedding_lengths)
        if not num_refs == num_encoder == num_output:
            raise ValueError(
                "Multimodal encoder item references and lengths must align: "
                f"{num_refs} item_refs, {num_encoder} encoder_token_lengths, "
                f"{num_output} output_embedding_lengths"
            )
        # A zero-row item usually means the placeholder discriminator is missing
        # (all-False embed_mask); fail here rather than run with no image.
        _check_positive("encoder_token_lengths", self.encoder_token_lengths, self.item_refs)
        _check_positive("output_embedding_lengths", self.output_embedding_lengths, self.item_refs)


def _check_positive(name: str, lengths: list[int], item_refs: list[tuple[str, int]]) -> None:
    bad = [(ref, length) for ref, length in zip(item_refs, lengths) if length <= 0]
    if bad:
        raise ValueError(
            f"Multimodal encoder {name} must be positive, got {lengths}; "
            f"offending (item_ref, length): {bad}"
        )
