"""Conversions between wire messages (``epd.v1``) and internal types, in one place: tiers convert
once at their edge so proto types never leak inward."""
from __future__ import annotations

import torch

from epd.engine.sampling_params import SamplingParams
from epd.engine.sequence import MultimodalItemSpan, TokenLogprobs
from epd.v1 import common_pb2


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature,
                                    top_p=p.top_p, top_k=p.top_k, stop_token_ids=list(p.stop_token_ids),
                                    ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=msg.max_tokens, min_tokens=msg.min_tokens, temperature=msg.temperature,
                          top_p=msg.top_p, top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None,
                          stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None)


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top),
                                    top_logprobs=list(lp.top.values()))


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, dict(zip(msg.top_token_ids, msg.top_logprobs)))


def item_spans(meta: common_pb2.RequestMetadata) -> list[MultimodalItemSpan]:
    return [MultimodalItemSpan(item.offset, item.expected_rows, item.content_hash) for item in meta.items]


def cumsum_from_proto(meta: common_pb2.RequestMetadata) -> torch.Tensor | None:
    if not meta.items:
        return None
    cumsum = torch.tensor(list(meta.embed_mask_cumsum), dtype=torch.long)
    if cumsum.shape[0] != len(meta.token_ids):
        raise ValueError(f"request {meta.request_id}: embed_mask_cumsum has {cumsum.shape[0]} entries, "
                         f"the prompt has {len(meta.token_ids)} tokens")
    return cumsum


def embed_positions_from_cumsum(cumsum: torch.Tensor) -> torch.Tensor:
    """Prompt positions of the embedding rows: where the prefix sum steps up."""
    return torch.nonzero(torch.diff(cumsum, prepend=cumsum.new_zeros(1))).squeeze(1)


def request_metadata(request_id: str, prompt, params: SamplingParams, eos_token_ids: tuple[int, ...],
                     *, with_media: bool = False, deadline_unix_s: float = 0.0) -> common_pb2.RequestMetadata:
    """A processed prompt (``epd.models.*.processor.ProcessedPrompt``) as the wire request.
    Media bytes ride along only for encoders (``with_media``); prefill and decode never get them."""
    items = [multimodal_item(i, item, with_media=with_media) for i, item in enumerate(prompt.items)]
    return common_pb2.RequestMetadata(
        request_id=request_id, token_ids=prompt.prompt_token_ids, items=items,
        embed_mask_cumsum=prompt.embed_mask_cumsum.tolist() if prompt.items else [],
        sampling=sampling_to_proto(params), eos_token_ids=list(eos_token_ids), deadline_unix_s=deadline_unix_s)


def multimodal_item(index: int, item, *, with_media: bool) -> common_pb2.MultimodalItem:
    geo = item.geometry
    return common_pb2.MultimodalItem(
        item_index=index, modality=item.modality, data=item.data if with_media else b"",
        content_hash=item.mm_hash, offset=item.offset, expected_rows=geo.num_embedding_rows,
        encoder_tokens=geo.num_patches, grid_thw=list(geo.grid_thw))
