"""Write encoder embeddings into the LLM input at placeholder positions.

``input_ids`` is the flat batch, [num_tokens] = text + placeholders; the
multimodal embedding is [num_mm_tokens, hidden]. The result is
[num_tokens, hidden], with placeholder rows taken from the encoder output.

Finding placeholder positions with ``torch.where`` on an accelerator forces a
host sync, because the output size is data-dependent. The executor therefore
computes the indices on a CPU copy of ``input_ids`` (``prepare_multimodal_indices``)
and ships them pinned + non_blocking (``ship_multimodal_indices``); given both
indices, ``fuse_input_embeds`` never inspects ``input_ids`` values.
"""

from __future__ import annotations

import torch


def filter_mm_token_from_input_ids(
    input_ids: torch.Tensor, *, vocab_size: int, mm_token_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(text_token_indices, mm_token_indices), int64, on ``input_ids``' device.

    ``mm_token_ids`` (in-vocabulary placeholders) wins; otherwise any id
    ``>= vocab_size`` is a placeholder (legacy OOV sentinel).
    """
    if mm_token_ids is not None:
        mm_mask = torch.isin(input_ids, mm_token_ids.to(input_ids.device))
    else:
        mm_mask = input_ids >= vocab_size
    # NOTE: torch.where() enforces a host sync when input_ids is on an accelerator.
    text_token_indices = torch.where(~mm_mask)[0]
    mm_token_indices = torch.where(mm_mask)[0]
    return text_token_indices, mm_token_indices


def prepare_multimodal_indices(
    input_ids: list[int], *, vocab_size: int, mm_token_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholder split computed on CPU, where ``torch.where`` costs no device sync."""
    ids_cpu = torch.tensor(input_ids, dtype=torch.int64, device="cpu")
    if mm_token_ids is not None:
        mm_token_ids = mm_token_ids.to(device="cpu", dtype=torch.int64)
    return filter_mm_token_from_input_ids(ids_cpu, vocab_size=vocab_size, mm_token_ids=mm_token_ids)


def ship_multimodal_indices(
    text_idx_cpu: torch.Tensor,
    mm_idx_cpu: torch.Tensor,
    device: str | torch.device,
    *,
    num_ctx_tokens: int,
    total_num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move CPU-computed indices to ``device`` without a sync.

    Tokens after the context tokens (KV-reuse extend tokens, draft tokens) are
    always text: no path appends placeholders after the context.
    """
    for name, index in (("text_idx_cpu", text_idx_cpu), ("mm_idx_cpu", mm_idx_cpu)):
        if index.device.type != "cpu":
            raise ValueError(f"{name} must be computed on CPU, got a tensor on {index.device}")
    if total_num_tokens < num_ctx_tokens:
        raise ValueError(
            f"total_num_tokens ({total_num_tokens}) must be >= num_ctx_tokens ({num_ctx_tokens})"
        )
    if total_num_tokens > num_ctx_tokens:
        extra_text = torch.arange(num_ctx_tokens, total_num_tokens, dtype=text_idx_cpu.dtype)
        text_idx_cpu = torch.cat([text_idx_cpu, extra_text])
    device = torch.device(device)
    return _to_device(text_idx_cpu, device), _to_device(mm_idx_cpu, device)


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned source memory is what makes non_blocking H2D actually async.
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _as_copy_index(index: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
    """``index`` as the int64 index ``index_copy_`` needs on ``destination``'s device.

    Callers may pass int32 or CPU indices; for the executor's int64 device
    indices this is a no-op.
    """
    return index.to(device=destination.device, dtype=torch.long, non_blocking=True)


def fuse_input_embeds(
    embedding_layer: torch.nn.Embedding,
    input_ids: torch.Tensor,
    mm_embeds: list[torch.Tensor] | torch.Tensor,
    *,
    mm_token_ids: torch.Tensor | None = None,
    text_token_indices: torch.Tensor | None = None,
    mm_token_indices: torch.Tensor | None = None,
    extra_embeds: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Fused input embeddings [num_tokens, hidden] and deepstack embeddings.

    Precedence: (1) both indices given: used as is, no sync; (2) otherwise
    the indices are found on ``input_ids`` via ``mm_token_ids`` or, without it,
    the OOV rule ``id >= num_embeddings``. The lookup itself takes the in-vocab
    fast path (one full lookup, mm rows overwritten) whenever ``mm_token_ids``
    says placeholders are real vocabulary ids, and the OOV path (gather text
    rows, scatter into a fresh buffer) otherwise.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be flat [num_tokens], got shape {tuple(input_ids.shape)}")
    mm_embed = _concat_mm_embeds(mm_embeds)
    if mm_embed is None:
        if mm_token_indices is not None and mm_token_indices.shape[0] > 0:
            raise _count_mismatch(mm_token_indices.shape[0], 0)
        return embedding_layer(input_ids), None
    if text_token_indices is None or mm_token_indices is None:
        text_token_indices, mm_token_indices = filter_mm_token_from_input_ids(
            input_ids, vocab_size=embedding_layer.num_embeddings, mm_token_ids=mm_token_ids
        )
    _check_counts(input_ids, mm_embed, text_token_indices, mm_token_indices, embedding_layer)
    if mm_token_ids is not None:
        input_embeds = _embed_in_vocab(embedding_layer, input_ids)
    else:
        input_embeds = _embed_text_only(embedding_layer, input_ids, text_token_indices)
    input_embeds.index_copy_(
        0,
        _as_copy_index(mm_token_indices, input_embeds),
        mm_embed.to(dtype=input_embeds.dtype, device=input_embeds.device),
    )
    return input_embeds, _scatter_extra_embeds(extra_embeds, mm_token_indices, input_ids.shape[0])


def _concat_mm_embeds(mm_embeds: list[torch.Tensor] | torch.Tensor) -> torch.Tensor | None:
    if isinstance(mm_embeds, torch.Tensor):
        return mm_embeds if mm_embeds.shape[0] > 0 else None
    non_empty = [embed for embed in mm_embeds if embed.shape[0] > 0]
    if not non_empty:
        return None
    return non_empty[0] if len(non_empty) == 1 else torch.cat(non_empty, dim=0)


def _check_counts(
    input_ids: torch.Tensor,
    mm_embed: torch.Tensor,
    text_token_indices: torch.Tensor,
    mm_token_indices: torch.Tensor,
    embedding_layer: torch.nn.Embedding,
) -> None:
    # Shapes are host metadata: these checks never sync.
    if mm_token_indices.shape[0] != mm_embed.shape[0]:
        raise _count_mismatch(mm_token_indices.shape[0], mm_embed.shape[0])
    if text_token_indices.shape[0] + mm_token_indices.shape[0] != input_ids.shape[0]:
        # Uncovered rows would keep torch.empty garbage on the OOV path.
        raise ValueError(
            f"text_token_indices ({text_token_indices.shape[0]}) + mm_token_indices "
            f"({mm_token_indices.shape[0]}) must cover all {input_ids.shape[0]} input_ids"
        )
    if mm_embed.dim() != 2 or mm_embed.shape[-1] != embedding_layer.embedding_dim:
        raise ValueError(
            f"multimodal embeddings must be [rows, {embedding_layer.embedding_dim}], "
            f"got shape {tuple(mm_embed.shape)}"
        )


def _count_mismatch(num_mm_tokens: int, num_mm_rows: int) -> ValueError:
    # Placeholder count == embedding rows is the pipeline's core invariant;
    # fusing anyway would shift every later row silently.
    return ValueError(
        f"Multimodal token count mismatch: found {num_mm_tokens} image tokens in input_ids "
        f"but received {num_mm_rows} image embeddings."
    )


def _embed_in_vocab(embedding_layer: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    # In-vocab fast path: placeholders are real vocabulary ids, so one full
    # lookup is safe. Saves the index_select over text positions, the
    # torch.empty alloc and the text scatter (~2 kernels per VLM forward), at
    # the cost of ~mm-fraction extra lookups whose rows are overwritten.
    return embedding_layer(input_ids)


def _embed_text_only(
    embedding_layer: torch.nn.Embedding, input_ids: torch.Tensor, text_token_indices: torch.Tensor
) -> torch.Tensor:
    # OOV path: placeholder ids are >= num_embeddings (e.g. vocab_size + 1), so
    # embedding the full sequence would index out of bounds. Gather only the
    # in-vocab text positions and scatter them into a fresh buffer.
    text_index = text_token_indices.to(device=input_ids.device, dtype=torch.long, non_blocking=True)
    text_embed = embedding_layer(input_ids.index_select(0, text_index))
    input_embeds = torch.empty(
        input_ids.shape[0],
        embedding_layer.embedding_dim,
        device=text_embed.device,
        dtype=text_embed.dtype,
    )
    input_embeds.index_copy_(0, _as_copy_index(text_token_indices, input_embeds), text_embed)
    return input_embeds


def _scatter_extra_embeds(
    extra_embeds: list[torch.Tensor] | None, mm_token_indices: torch.Tensor, num_tokens: int
) -> list[torch.Tensor] | None:
    """Deepstack features as [num_tokens, dim] tensors, zero at text rows.

    They are added to hidden states of later layers, so text rows must be a
    zero increment, not the text embedding. Single modality only for now.
    """
    if not extra_embeds:
        return None
    scattered = []
    for level, feature in enumerate(extra_embeds):
        if feature.shape[0] != mm_token_indices.shape[0]:
            raise ValueError(
                f"deepstack feature {level} has {feature.shape[0]} rows but input_ids has "
                f"{mm_token_indices.shape[0]} multimodal tokens"
            )
        extra = feature.new_zeros(num_tokens, feature.shape[-1])
        extra.index_copy_(0, _as_copy_index(mm_token_indices, extra), feature)
        scattered.append(extra)
    return scattered
