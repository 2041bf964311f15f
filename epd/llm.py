"""``epd.LLM``: the whole model in one process (vision tower + engine): the reference the tiers
are checked against, the engine behind ``epd generate`` and the router's in-process backend."""
from __future__ import annotations

import functools
import os

import torch

from epd.config import EncoderConfig, EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.engine.memory_profile import with_model_len
from epd.engine.mm_inputs import ItemRows, SequenceMultimodal
from epd.engine.sequence import Sequence
from epd.engine.tensor_parallel import load_engine
from epd.engine.threads import apply_thread_policy
from epd.errors import InvalidRequest
from epd.models.generation_config import generation_defaults
from epd.models.registry import family_for
from epd.models.spec import ProcessedPrompt
from epd.models.tokenizer_loading import load_tokenizer
from epd.multimodal.media import MediaInput
from epd.multimodal.messages import extract_media
from epd.types import RequestOutput, SamplingParams


class LLM:
    """``LLM(model="tiny-qwen2-vl").chat(messages)``; ``model`` is a preset name or a HF directory."""

    def __init__(self, model: str = "tiny-qwen2-vl", *, engine_config: EngineConfig | None = None,
                 allowed_local_media_path: str | os.PathLike | None = "/", set_threads: bool = True) -> None:
        """``set_threads``: size torch's intra-op threads on this thread (``epd.engine.threads``: the
        ``num_threads`` of ``engine_config``, else the usable cores); False when the caller already
        did, e.g. an engine loop that counts its process's event loop as a busy thread."""
        from epd.models.locate import resolve_model
        self.model_dir = resolve_model(model)
        self.family = family_for(self.model_dir)
        self.engine_config = with_model_len(engine_config or EngineConfig(), self.model_dir)
        if set_threads:  # the user's thread: it runs every torch op of chat() / generate()
            apply_thread_policy("epd.LLM", override=self.engine_config.num_threads)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.mm_spec = self.family.mm_spec(self.model_dir)
        self.processor = self.family.input_processor(self.model_dir, self.tokenizer)
        self.vision = self.family.load_vision(self.model_dir, dtype=self.engine_config.torch_dtype,
                                              device=self.engine_config.target_device)
        # every EOS id the checkpoint's generation_config.json lists ends a request, as in transformers and vLLM
        self.generation = generation_defaults(self.model_dir)
        own = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        eos = own + tuple(t for t in dict.fromkeys(self.generation.eos_token_ids) if t not in own)
        build = functools.partial(LLMEngine, config=self._sized_beside_the_vision_tower(), eos_token_ids=eos,
                                  mm_token_ids=self.mm_spec.mm_token_ids, load_tokenizer=lambda: self.tokenizer)
        self.engine = load_engine(self.model_dir, self.engine_config, self.mm_spec.mm_token_ids, build)
        self.allowed_local_media_path = allowed_local_media_path

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (nothing to do with one rank). Idempotent;
        a closed LLM with ranks refuses further steps (the engine keeps the closed group)."""
        self.engine.close()

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel rank is lost or a step failed across them."""
        return self.engine.healthy

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sized_beside_the_vision_tower(self) -> EngineConfig:
        """The vision tower shares this process's device: a KV cache sized from the GPU's memory
        leaves the encoder's output budget free (one encoder iteration's rows, as an encoder tier
        would hold them), planned with the KV pool instead of found missing under load."""
        config = self.engine_config
        if config.kv_gpu_memory_utilization is None or not config.target_device.startswith("cuda"):
            return config
        from epd.encoder.engine import output_budgets_for

        output_bytes, _ = output_budgets_for(self.model_dir, EncoderConfig(device=config.device, dtype=config.dtype))
        return config.model_copy(update={"reserved_device_bytes": config.reserved_device_bytes + output_bytes})

    # ---- public API ----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses (vLLM's name and rule): ours, with the values the
        checkpoint's generation_config.json sets over them."""
        return SamplingParams(**self.generation.sampling_fields())

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, run concurrently.
        ``mm_processor_kwargs``: the image processor's ``min_pixels`` / ``max_pixels`` for every
        image (vLLM's name), within the checkpoint's own ``max_pixels``."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = _per_request(sampling_params, len(conversations), self.get_default_sampling_params)
        seqs = [self.add_conversation(conv, p, mm_processor_kwargs) for conv, p in zip(conversations, params)]
        self.engine.run_until_done(seqs)
        return [self._output(s) for s in seqs]

    def generate(self, prompt_token_ids: list[list[int]], sampling_params=None,
                 images: list[list[bytes]] | None = None, *, mm_processor_kwargs: dict | None = None
                 ) -> list[RequestOutput]:
        """Token-level entry: each prompt holds one ``<|image_pad|>`` per image (expanded here)."""
        params = _per_request(sampling_params, len(prompt_token_ids), self.get_default_sampling_params)
        images = images or [[] for _ in prompt_token_ids]
        seqs = [self.add_processed(self._processed(self.processor.process_token_ids, ids, imgs,
                                                   processor_kwargs=mm_processor_kwargs), p)
                for ids, imgs, p in zip(prompt_token_ids, images, params)]
        self.engine.run_until_done(seqs)
        return [self._output(s) for s in seqs]

    def add_conversation(self, messages: list[dict], params: SamplingParams,
                         mm_processor_kwargs: dict | None = None) -> Sequence:
        messages, media = self.extract_media(messages)
        return self.add_processed(self._processed(self.processor.process_messages, messages, media,
                                                  processor_kwargs=mm_processor_kwargs), params)

    def add_processed(self, prompt: ProcessedPrompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Encode the prompt's images (here, on the caller's thread) and add it to the engine."""
        mm = self._multimodal(prompt) if prompt.items else None
        return self.engine.add_request(prompt.prompt_token_ids, params, request_id=request_id, mm=mm,
                                       mm_items=[item.span for item in prompt.items])

    # ---- helpers -------------------------------------------------------------------------------
    def _processed(self, process, *args, processor_kwargs: dict | None) -> ProcessedPrompt:
        if not processor_kwargs:
            return process(*args)
        try:
            self.processor.media_settings(processor_kwargs)
        except ValueError as err:
            raise InvalidRequest(f"mm_processor_kwargs: {err}", param="mm_processor_kwargs") from None
        return process(*args, processor_kwargs=processor_kwargs)

    def extract_media(self, messages: list[dict]) -> tuple[list[dict], list[MediaInput]]:
        return extract_media(messages, allowed_local_root=self.allowed_local_media_path)

    def _multimodal(self, prompt: ProcessedPrompt) -> SequenceMultimodal:
        # a preempted sequence recomputes its prompt from a fresh encode: stripped rows are gone
        layout = self.family.prompt_layout(self.mm_spec, prompt.prompt_token_ids,
                                           [item.span for item in prompt.items])
        return SequenceMultimodal.from_layout(layout, ItemRows.from_tensors(self._encode(prompt)),
                                              rebuild=lambda: self._multimodal(prompt))

    def _encode(self, prompt: ProcessedPrompt) -> list[torch.Tensor]:
        rows = self.vision.encode_images([MediaInput(item.data, item.modality, item.processor_kwargs)
                                          for item in prompt.items])
        for i, (item, r) in enumerate(zip(prompt.items, rows)):
            if r.shape[0] != item.num_rows:
                raise InvalidRequest(f"{item.modality} {i}: the encoder produced {r.shape[0]} rows but the prompt "
                                     f"has {item.num_rows} placeholders (grid {item.geometry.grid_thw})")
        return rows

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                             self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
                             seq.finish_reason, seq.output_logprobs, seq.num_cached_tokens)


def _per_request(params, n: int, default) -> list[SamplingParams]:
    if params is None:
        return [default()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} requests")
    return list(params)
