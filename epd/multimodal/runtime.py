"""Which embedding rows one forward needs under chunked prefill and KV-prefix reuse, and how they
are joined.

A request's embedding rows can be spread over several forwards: a cached prefix was served from
the KV cache, and the rest may be split into chunks. ``embed_mask_cumsum`` (see masks.py) turns
"how many rows lie before position p" into one lookup, so the bookkeeping is O(1) per request per
forward. The model runner (``engine/model_runner.py``) takes exactly rows
``[num_cached_mm_tokens, + num_mm_tokens_in_chunk)`` of each sequence for each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MultimodalRuntimeData:
    """Row accounting for one request in one forward.

    ``past_seen_token_num``: prompt tokens already in the KV cache.
    ``chunk_end_pos``: exclusive end of this forward's prompt range.
    ``embed_mask_cumsum``: int64 CPU, [prompt_len].
    """

    past_seen_token_num: int
    chunk_end_pos: int
    embed_mask_cumsum: torch.Tensor
    num_cached_mm_tokens: int = field(init=False)
    num_mm_tokens_in_chunk: int = field(init=False)
    total_embeds_in_request: int = field(init=False)

    def __post_init__(self) -> None:
        cs = self.embed_mask_cumsum
        # int(cs[idx]) below would D2H-sync if cs lived on an accelerator.
        if cs.device.type != "cpu":
            raise ValueError(f"embed_mask_cumsum must be on CPU, got {cs.device}")
        if cs.dim() != 1 or cs.numel() == 0:
            raise ValueError(
                f"embed_mask_cumsum must be a non-empty 1-D tensor, got shape {tuple(cs.shape)}"
            )
        prompt_len = cs.numel()
        if not 0 <= self.past_seen_token_num <= self.chunk_end_pos <= prompt_len:
            raise ValueError(
                "expected 0 <= past_seen_token_num <= chunk_end_pos <= prompt_len, got "
                f"past_seen_token_num={self.past_seen_token_num}, "
                f"chunk_end_pos={self.chunk_end_pos}, prompt_len={prompt_len}"
            )
        self.num_cached_mm_tokens = _rows_before(cs, self.past_seen_token_num)
        rows_to_chunk_end = _rows_before(cs, self.chunk_end_pos)
        self.num_mm_tokens_in_chunk = rows_to_chunk_end - self.num_cached_mm_tokens
        self.total_embeds_in_request = int(cs[-1])


def _rows_before(cs: torch.Tensor, position: int) -> int:
    """Embed slots in prompt positions [0, position)."""
    return int(cs[position - 1]) if position > 0 else 0


def join_embeddings(
    segments: list[torch.Tensor], start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Rows [start, end) of the row-wise concatenation of ``segments``.

    Slice before joining: a long request must not copy all of its cached output
    for every small chunk. If the range falls in one segment the result is a
    view of it (no copy).
    """
    if not segments:
        raise ValueError("join_embeddings needs at least one segment to know the row width")
    total_rows = sum(segment.shape[0] for segment in segments)
    end = total_rows if end is None else end
    if not 0 <= start <= end <= total_rows:
        raise ValueError(
            f"expected 0 <= start <= end <= {total_rows} (total rows), got start={start}, end={end}"
        )
    pieces = _overlapping_slices(segments, start, end)
    if not pieces:
        return segments[0][0:0]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=0)


def _overlapping_slices(segments: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    pieces = []
    offset = 0
    for segment in segments:
        rows = segment.shape[0]
        lo, hi = max(start, offset), min(end, offset + rows)
        if lo < hi:
            pieces.append(segment[lo - offset : hi - offset])
        offset += rows
    return pieces
