"""Prompt preprocessing for Qwen2-VL / Qwen2.5-VL, from the image headers alone (no pixels):
chat template -> token ids -> each image's placeholder expanded to its embedding-row count ->
content hashes and item metadata.

This is the router's half of the work; the encoder turns the same bytes into pixels and rows, and
the two must agree on every item's row count (both come from ``multimodal.geometry``). Where a
sequence is built (prefill, the in-process engine), ``family.prompt_layout`` derives the masks,
the embed-mask cumsum and the M-RoPE positions from the ids and the items and checks them again.
"""
from __future__ import annotations

from pathlib import Path

from epd.models.checkpoint import read_preprocessor_config
from epd.models.spec import MultimodalSpec, ProcessedItem, ProcessedPrompt
from epd.multimodal.geometry import VisionGeometryConfig, image_geometry_from_bytes
from epd.multimodal.hashing import hash_encoded_media
from epd.multimodal.masks import MultimodalEncoderItemMetadata


class QwenVLInputProcessor:
    def __init__(self, model_dir: str | Path, tokenizer, spec: MultimodalSpec, *, model_id: str) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.model_id = model_id
        self.processor_config = read_preprocessor_config(Path(model_dir))
        self.geometry_config = VisionGeometryConfig.from_preprocessor_config(self.processor_config)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(template_kwargs or {}))

    def process_messages(self, messages: list[dict], images: list[bytes], tools: list[dict] | None = None,
                         add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                         processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """``images`` are the encoded images in the order their parts appear in ``messages``;
        ``tools``: rendered by the chat template (OpenAI's tool definitions); ``template_kwargs``:
        the template's own variables (``add_vision_id`` for Qwen-VL's); ``processor_kwargs``: the
        image processor's (``min_pixels`` / ``max_pixels``) for every image of this prompt."""
        token_ids = self.tokenizer.encode(self.render(messages, tools, add_generation_prompt, template_kwargs),
                                          add_special_tokens=False)
        return self.process_token_ids(token_ids, images, processor_kwargs)

    def process_token_ids(self, token_ids: list[int], images: list[bytes],
                          processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """Expand the single ``<|image_pad|>`` of each image to its row count and build metadata."""
        pad = self.spec.image_token_id
        num_pads = sum(1 for t in token_ids if t == pad)
        if num_pads != len(images):
            raise ValueError(f"prompt has {num_pads} image placeholders but {len(images)} images were given")
        geometry, overrides = self.geometry_for(processor_kwargs)
        geometries = [image_geometry_from_bytes(data, geometry) for data in images]
        expanded, offsets = _expand_placeholders(token_ids, pad, [g.num_embedding_rows for g in geometries])
        items = [ProcessedItem("image", data, self._hash(data, geometry), offset, geo, overrides)
                 for data, offset, geo in zip(images, offsets, geometries)]
        return self._build(expanded, items)

    def geometry_for(self, processor_kwargs: dict | None) -> tuple[VisionGeometryConfig, dict[str, int] | None]:
        """The geometry images are sized by under ``processor_kwargs`` (checked: ``ValueError``), and
        the kwargs the encoder must be given for it: None when they change nothing, so an image
        sent with and without the checkpoint's own values is one encoder-cache entry."""
        geometry = self.geometry_config.with_pixel_kwargs(processor_kwargs)
        return geometry, (None if geometry == self.geometry_config else geometry.pixel_kwargs)

    def _hash(self, data: bytes, geometry: VisionGeometryConfig) -> str:
        # the prefix cache's block keys include it: other pixel bounds are other rows
        return hash_encoded_media(data, modality="image", processor_kwargs=geometry.pixel_kwargs,
                                  model_id=self.model_id)

    def _build(self, token_ids: list[int], items: list[ProcessedItem]) -> ProcessedPrompt:
        metadata = MultimodalEncoderItemMetadata(
            item_refs=[("image", i) for i in range(len(items))],
            encoder_token_lengths=[item.geometry.num_patches for item in items],
            output_embedding_lengths=[item.num_rows for item in items])
        metadata.validate()
        return ProcessedPrompt(token_ids, items, metadata)


def _expand_placeholders(token_ids: list[int], pad: int, rows: list[int]) -> tuple[list[int], list[int]]:
    out, offsets, item = [], [], 0
    for tok in token_ids:
        if tok == pad:
            offsets.append(len(out))
            out.extend([pad] * rows[item])
            item += 1
        else:
            out.append(tok)
    return out, offsets
