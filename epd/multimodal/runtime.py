"""Which embedding rows one forward needs under chunked prefill and KV-prefix reuse.

A request's embedding rows can be spread over several forwards: a cached
prefix was served from the KV cache, and the rest may be split into chunks.
``embed_mask_cumsum`` (see masks.py) turns "how many rows lie before position
p" into one lookup, so the bookkeeping is O(1) per request per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epd.multimodal.params import has_mm_payload_keys


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


def check_mm_embed_cumsum_if_needed(
    mm_data: dict | None, *, begin_compute: int, end_compute: int, prompt_len: int
) -> None:
    """Raise iff chunked prefill or KV-cache reuse is in effect AND MM data has no embed cumsum.

    Triggers on the two cases where the scheduler advances less than the whole
    prompt in one step:
      * ``begin_compute > 0``: KV-cache reuse served a prefix from cache, or
      * ``end_compute < prompt_len``: chunked prefill split the remaining tokens.
    A full prefill consumes the whole payload and needs no cumsum.
    """
    if not has_mm_payload_keys(mm_data):
        return
    if mm_data.get("multimodal_embed_mask_cumsum") is not None:
        return
    is_chunked_or_reused = begin_compute > 0 or end_compute < prompt_len
    if is_chunked_or_reused:
        raise ValueError(
            "Request requires multimodal_embed_mask_cumsum for chunked prefill or KV-cache "
            f"reuse (begin_compute={begin_compute}, end_compute={end_compute}, "
            f"prompt_len={prompt_len}) but multimodal_data has keys {sorted(mm_data)} with no "
            "cumsum. The input processor may be missing a discriminator (override "
            "get_mm_token_ids or ensure get_vocab_size resolves)."
        )


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


def find_input_mm_embeds(
    mm_embeds: list[torch.Tensor],
    runtimes: list[MultimodalRuntimeData | None],
    is_chunk: list[bool] | None = None,
) -> list[torch.Tensor]:
    """Keep only the rows this forward needs: per request [cached, cached + in_chunk).

    Two layouts:
      * per-request batching: ``len(mm_embeds) == len(runtimes)``, one tensor per
        request, sliced in local coordinates;
      * pre-concatenated batching: ``len(mm_embeds) == 1``, a global cursor
        advances by each request's ``total_embeds_in_request``.
    Example: 8 rows, 2 cached, 3 in this chunk -> rows [2:5].

    ``is_chunk[i]`` marks a request whose tensor already holds only this chunk's rows
    (``multimodal_embedding_is_chunk``). If any request in the batch is chunk-local, every other
    request is cut to its chunk rows too, so the batch's row layout is consistent (seed §7.5);
    their full payloads are left intact for later chunks.
    """
    if is_chunk is not None and any(is_chunk):
        return _mix_chunk_local(mm_embeds, runtimes, is_chunk)
    if all(runtime is None for runtime in runtimes):
        return mm_embeds  # full prefill, no reuse: the whole payload is used
    if len(mm_embeds) == len(runtimes):
        needed_rows = [
            embed.shape[0] if runtime is None else runtime.num_mm_tokens_in_chunk
            for embed, runtime in zip(mm_embeds, runtimes)
        ]
    elif len(mm_embeds) == 1:
        needed_rows = [
            _runtime_at(runtimes, index).num_mm_tokens_in_chunk for index in range(len(runtimes))
        ]
    else:
        raise ValueError(
            f"expected one embedding tensor per request ({len(runtimes)}) or one "
            f"pre-concatenated tensor, got {len(mm_embeds)}"
        )
    if sum(needed_rows) == sum(embed.shape[0] for embed in mm_embeds):
        # Item-scheduled batches were already sliced by the producer/gather
        # path. Do not apply the cached-prefix offset a second time.
        return mm_embeds
    if len(mm_embeds) == 1:
        # Also covers one request with one tensor: both layouts agree there.
        return [_slice_concatenated(mm_embeds[0], runtimes)]
    return [
        _slice_request(embed, runtime, index)
        for index, (embed, runtime) in enumerate(zip(mm_embeds, runtimes))
    ]


def _mix_chunk_local(
    mm_embeds: list[torch.Tensor], runtimes: list[MultimodalRuntimeData | None], is_chunk: list[bool]
) -> list[torch.Tensor]:
    if not len(mm_embeds) == len(runtimes) == len(is_chunk):
        raise ValueError(
            f"chunk-local mixing needs one tensor, runtime and flag per request, got "
            f"{len(mm_embeds)} tensors, {len(runtimes)} runtimes, {len(is_chunk)} flags"
        )
    out = []
    for index, (embed, runtime, local) in enumerate(zip(mm_embeds, runtimes, is_chunk)):
        if not local:
            out.append(_slice_request(embed, runtime, index))  # a view: the payload stays whole
            continue
        if runtime is not None and embed.shape[0] != runtime.num_mm_tokens_in_chunk:
            raise ValueError(
                f"request {index} is chunk-local with {embed.shape[0]} rows but its chunk "
                f"needs {runtime.num_mm_tokens_in_chunk}"
            )
        out.append(embed)
    return out


def _runtime_at(runtimes: list[MultimodalRuntimeData | None], index: int) -> MultimodalRuntimeData:
    runtime = runtimes[index]
    if runtime is None:
        # Without a runtime we cannot know where this request's rows end in
        # the shared tensor, so the cursor of every later request is unknown.
        raise ValueError(
            f"request {index} has no MultimodalRuntimeData but the embeddings are "
            "pre-concatenated; every request needs one to locate its rows"
        )
    return runtime


def _slice_request(
    embed: torch.Tensor, runtime: MultimodalRuntimeData | None, index: int
) -> torch.Tensor:
    if runtime is None:
        return embed
    start = runtime.num_cached_mm_tokens
    end = start + runtime.num_mm_tokens_in_chunk
    _check_rows(embed, end, f"request {index}")
    return embed[start:end]


def _slice_concatenated(
    embed: torch.Tensor, runtimes: list[MultimodalRuntimeData | None]
) -> torch.Tensor:
    cursor = 0
    pieces = []
    for index in range(len(runtimes)):
        runtime = _runtime_at(runtimes, index)
        start = cursor + runtime.num_cached_mm_tokens
        pieces.append((start, start + runtime.num_mm_tokens_in_chunk))
        cursor += runtime.total_embeds_in_request
    if cursor != embed.shape[0]:
        raise ValueError(
            f"pre-concatenated embedding has {embed.shape[0]} rows but the requests' "
            f"total_embeds_in_request sum to {cursor}"
        )
    return join_embeddings([embed[start:end] for start, end in pieces])


def _check_rows(embed: torch.Tensor, end: int, owner: str) -> None:
    # Slicing past the end truncates silently; that would shift every later row.
    if end > embed.shape[0]:
        raise ValueError(
            f"{owner} needs embedding rows up to {end} but its tensor has {embed.shape[0]} rows"
        )
