"""``epd.LLM``: the whole model in one process (encoder + engine), the reference the tiers are
checked against and the engine behind ``epd generate``."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.engine.mm_inputs import ItemRows, SequenceMultimodal
from epd.engine.sampling_params import SamplingParams
from epd.engine.sequence import MultimodalItemSpan, Sequence, TokenLogprobs
from epd.models.registry import family_for
from epd.models.tokenizer_loading import load_tokenizer
from epd.models.qwen2_vl.processor import ProcessedPrompt, QwenVLInputProcessor
from epd.multimodal.messages import extract_images


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """``LLM(model="tiny-qwen2-vl").chat(messages)``; ``model`` is a preset name or a HF directory."""

    def __init__(self, model: str = "tiny-qwen2-vl", *, engine_config: EngineConfig | None = None,
                 allowed_local_media_path: str | os.PathLike | None = "/") -> None:
        from epd.models.presets import resolve_model
        self.model_dir = resolve_model(model)
        family = family_for(self.model_dir)
        self.engine_config = engine_config or EngineConfig()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.mm_spec = family.mm_spec(self.model_dir)
        self.processor = QwenVLInputProcessor(self.model_dir, self.tokenizer, self.mm_spec,
                                              model_id=str(self.model_dir))
        self.vision = family.load_vision(self.model_dir, dtype=self.engine_config.torch_dtype,
                                         device=self.engine_config.device)
        eos = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        mm_ids = (self.mm_spec.image_token_id, self.mm_spec.video_token_id)
        self.engine = LLMEngine(family.load_llm(self.model_dir), self.engine_config, eos_token_ids=eos,
                                mm_token_ids=mm_ids)
        self.allowed_local_media_path = allowed_local_media_path

    # ---- public API ----------------------------------------------------------------------------
    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, run concurrently."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = _per_request(sampling_params, len(conversations))
        seqs = [self.add_conversation(conv, p) for conv, p in zip(conversations, params)]
        self.engine.run_until_done(seqs)
        return [self._output(s) for s in seqs]

    def generate(self, prompt_token_ids: list[list[int]], sampling_params=None,
                 images: list[list[bytes]] | None = None) -> list[RequestOutput]:
        """Token-level entry: each prompt holds one ``<|image_pad|>`` per image (expanded here)."""
        params = _per_request(sampling_params, len(prompt_token_ids))
        images = images or [[] for _ in prompt_token_ids]
        seqs = [self.add_processed(self.processor.process_token_ids(ids, imgs), p)
                for ids, imgs, p in zip(prompt_token_ids, images, params)]
        self.engine.run_until_done(seqs)
        return [self._output(s) for s in seqs]

    def add_conversation(self, messages: list[dict], params: SamplingParams) -> Sequence:
        messages, images = self.extract_images(messages)
        return self.add_processed(self.processor.process_messages(messages, images), params)

    def add_processed(self, prompt: ProcessedPrompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        mm = None
        if prompt.items:
            rows = self._encode(prompt)
            mm = SequenceMultimodal(ItemRows.from_tensors(rows), prompt.embed_positions, prompt.embed_mask_cumsum,
                                    prompt.mrope_positions, prompt.mrope_delta)
        spans = [MultimodalItemSpan(i.offset, i.num_rows, i.mm_hash) for i in prompt.items]
        return self.engine.add_request(prompt.prompt_token_ids, params, request_id=request_id, mm=mm,
                                       mm_items=spans)

    # ---- helpers -------------------------------------------------------------------------------
    def extract_images(self, messages: list[dict]) -> tuple[list[dict], list[bytes]]:
        return extract_images(messages, allowed_local_root=self.allowed_local_media_path)

    def _encode(self, prompt: ProcessedPrompt) -> list[torch.Tensor]:
        rows = self.vision.encode_images([item.data for item in prompt.items])
        for i, (item, r) in enumerate(zip(prompt.items, rows)):
            if r.shape[0] != item.num_rows:
                raise ValueError(f"image {i}: the encoder produced {r.shape[0]} rows but the prompt has "
                                 f"{item.num_rows} placeholders (grid {item.geometry.grid_thw})")
        return rows

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                             self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
                             seq.finish_reason, seq.output_logprobs)


def _per_request(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} requests")
    return list(params)
