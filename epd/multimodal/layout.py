"""Where a prompt's embedding rows go, derived from the prompt ids and its items' spans: built
where a sequence is built (the prefill tier, the in-process engine), never shipped over the wire.

The embed mask marks the placeholder positions whose rows come from the encoder; its int64 CPU
prefix sum answers "how many rows lie before position p" in one lookup for every chunk
(``MultimodalRuntimeData``). M-RoPE positions are the model family's (``positions_fn``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from epd.multimodal.masks import compute_mm_masks, embed_mask_cumsum, find_mm_embedding_lengths_from_masks
from epd.types import MultimodalItemSpan


@dataclass(frozen=True)
class PromptLayout:
    embed_mask_cumsum: torch.Tensor  # [prompt_len] int64 CPU
    embed_positions: torch.Tensor  # [rows] int64 CPU: the prompt position of each embedding row
    mrope_positions: torch.Tensor  # [3, prompt_len] int64 CPU
    mrope_delta: int  # a generated token's position = its index + mrope_delta


PositionsFn = Callable[[int, Sequence[MultimodalItemSpan]], tuple[torch.Tensor, int]]


def build_prompt_layout(token_ids: Sequence[int], items: Sequence[MultimodalItemSpan], *, mm_token_ids: Sequence[int],
                        positions_fn: PositionsFn) -> PromptLayout:
    """Masks in one pass over the ids, checked against the items: placeholder count == rows, item
    by item (a prompt whose spans disagree with its items is refused, never run misaligned)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    masks = compute_mm_masks(ids, mm_token_ids=torch.tensor(list(mm_token_ids), dtype=torch.long))
    rows = [item.length for item in items]
    find_mm_embedding_lengths_from_masks(masks.mm_mask, masks.embed_mask, rows)
    embed_positions = masks.embed_mask.nonzero().squeeze(1)
    for index, item in enumerate(items):
        first = sum(rows[:index])
        if item.length and int(embed_positions[first]) != item.offset:
            raise ValueError(f"item {index} says its placeholders start at {item.offset}, the prompt has them at "
                             f"{int(embed_positions[first])}")
        per_segment = item.length // len(item.segment_offsets) if item.segment_offsets else 0
        found = [int(embed_positions[first + j * per_segment]) for j in range(len(item.segment_offsets))]
        if found != list(item.segment_offsets):
            raise ValueError(f"item {index} says its segments start at {list(item.segment_offsets)}, the prompt has "
                             f"them at {found}")
    positions, delta = positions_fn(len(ids), items)
    return PromptLayout(embed_mask_cumsum(masks.embed_mask), embed_positions, positions, delta)
