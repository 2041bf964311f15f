"""Wire messages (``epd.v1``) <-> internal types, in one place. Each hop has one internal message
type (``PrefillJob``, ``DecodeJob``); a servicer converts the proto into it once, so workers never
see proto and proto never leaks inward."""
from __future__ import annotations

import json
from dataclasses import dataclass

from epd.errors import InvalidRequest
from epd.types import MultimodalItemSpan, SamplingParams, StructuredOutput, TokenLogprobs
from epd.v1 import common_pb2


# ---- hop types ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillJob:
    """What a prefill worker is asked: prompt ids (placeholder spans expanded) and its items."""

    request_id: str
    token_ids: list[int]
    items: list[MultimodalItemSpan]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()  # already produced elsewhere (a migrated request)


@dataclass(frozen=True)
class DecodeJob:
    """What a decode worker is asked: continue a prompt prefilled elsewhere from its first token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    mrope_delta: int
    output_token_ids: tuple[int, ...] = ()  # produced before ``first_token_id`` (a migrated request)


# ---- sampling and logprobs ------------------------------------------------------------------------
def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature,
                                    top_p=p.top_p, top_k=p.top_k, stop_token_ids=list(p.stop_token_ids),
                                    ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                                    frequency_penalty=p.frequency_penalty, min_p=p.min_p,
                                    logit_bias=dict(p.logit_bias))
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.structured is not None:
        msg.structured.kind, msg.structured.spec = p.structured.kind, p.structured.spec
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=msg.max_tokens, min_tokens=msg.min_tokens,
                          temperature=msg.temperature if msg.HasField("temperature") else 1.0,
                          top_p=msg.top_p, top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None,
                          stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          **logits_processors_from_proto(msg))


def logits_processors_from_proto(msg: common_pb2.SamplingParams) -> dict:
    """The penalties, min_p and logit_bias of a proto SamplingParams, as SamplingParams fields."""
    return {"presence_penalty": msg.presence_penalty, "frequency_penalty": msg.frequency_penalty,
            "repetition_penalty": msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            "min_p": msg.min_p, "logit_bias": tuple(sorted(msg.logit_bias.items())),
            "structured": StructuredOutput(msg.structured.kind, msg.structured.spec) if msg.HasField("structured")
            else None}


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top),
                                    top_logprobs=list(lp.top.values()))


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, dict(zip(msg.top_token_ids, msg.top_logprobs)))


# ---- requests -------------------------------------------------------------------------------------
def request_metadata(request_id: str, prompt, params: SamplingParams, eos_token_ids: tuple[int, ...],
                     *, with_items: bool = True, output_token_ids=()) -> common_pb2.RequestMetadata:
    """A processed prompt (``ProcessedPrompt``) as the wire request for prefill (``with_items``) or
    decode (no items: it keeps nothing multimodal). Media bytes never travel in it.
    ``output_token_ids``: what the request already produced elsewhere (it resumes after them)."""
    items = [multimodal_item(i, item, with_media=False) for i, item in enumerate(prompt.items)] if with_items else []
    return common_pb2.RequestMetadata(request_id=request_id, token_ids=prompt.prompt_token_ids, items=items,
                                      sampling=sampling_to_proto(params), eos_token_ids=list(eos_token_ids),
                                      output_token_ids=list(output_token_ids))


def multimodal_item(index: int, item, *, with_media: bool) -> common_pb2.MultimodalItem:
    geo = item.geometry
    return common_pb2.MultimodalItem(
        item_index=index, modality=item.modality, data=item.data if with_media else b"",
        content_hash=item.mm_hash, offset=item.offset, expected_rows=geo.num_embedding_rows,
        encoder_tokens=geo.num_patches, grid_thw=list(geo.grid_thw), second_per_grid_t=item.second_per_grid_t,
        segment_offsets=list(item.segment_offsets),
        processor_kwargs_json=json.dumps(item.processor_kwargs, sort_keys=True) if item.processor_kwargs else "")


def prefill_job_from_proto(meta: common_pb2.RequestMetadata) -> PrefillJob:
    items = [MultimodalItemSpan(item.offset, item.expected_rows, item.content_hash, tuple(item.grid_thw),
                                item.second_per_grid_t, tuple(item.segment_offsets)) for item in meta.items]
    for index, (item, msg) in enumerate(zip(items, meta.items)):
        if msg.item_index != index or len(item.grid_thw) != 3:
            raise InvalidRequest(f"request {meta.request_id}: item {index} is malformed (index {msg.item_index}, "
                                 f"grid {list(item.grid_thw)}); expected items in prompt order with a 3-D grid")
        segments = item.segment_offsets
        if segments and (segments[0] != item.offset or len(segments) != item.grid_thw[0] or item.length % len(segments)
                         or any(b <= a for a, b in zip(segments, segments[1:]))):
            raise InvalidRequest(f"request {meta.request_id}: item {index} has segments {list(segments)} that do not "
                                 f"split its {item.length} rows from offset {item.offset} into {item.grid_thw[0]} "
                                 f"increasing temporal patches")
        if not (0.0 <= item.second_per_grid_t < float("inf")):
            raise InvalidRequest(f"request {meta.request_id}: item {index} has second_per_grid_t "
                                 f"{item.second_per_grid_t}; expected a finite number >= 0")
    return PrefillJob(meta.request_id, list(meta.token_ids), items, sampling_from_proto(meta.sampling),
                      tuple(meta.eos_token_ids), _resumed_outputs(meta))


def decode_job_from_proto(meta: common_pb2.RequestMetadata, prefill: common_pb2.PrefillResult) -> DecodeJob:
    first_logprobs = logprobs_from_proto(prefill.first_logprobs) if prefill.HasField("first_logprobs") else None
    return DecodeJob(meta.request_id, list(meta.token_ids), sampling_from_proto(meta.sampling),
                     tuple(meta.eos_token_ids), prefill.first_token_id, first_logprobs, prefill.mrope_delta,
                     _resumed_outputs(meta))


def _resumed_outputs(meta: common_pb2.RequestMetadata) -> tuple[int, ...]:
    """A migrated request's outputs so far; it must still have at least one token to produce."""
    outputs = tuple(meta.output_token_ids)
    if outputs and len(outputs) >= meta.sampling.max_tokens:
        raise InvalidRequest(f"request {meta.request_id}: {len(outputs)} tokens already produced leave none of "
                             f"max_tokens={meta.sampling.max_tokens} to resume")
    return outputs
