"""Prompt preprocessing for Qwen2-VL / Qwen2.5-VL, from the media headers alone (no pixels): chat
template -> token ids -> each image's or video's placeholder expanded to its embedding-row count
-> content hashes and item metadata.

This is the router's half of the work; the encoder turns the same bytes into pixels and rows, and
the two must agree on every item's row count (both come from ``multimodal.geometry`` and
``multimodal.video`` under the same ``MediaSettings``). Where a sequence is built (prefill, the
in-process engine), ``family.prompt_layout`` derives the masks, the embed-mask cumsum and the
M-RoPE positions from the ids and the items and checks them again.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from epd.models.checkpoint import read_preprocessor_config, read_video_preprocessor_config
from epd.models.spec import MultimodalSpec, ProcessedItem, ProcessedPrompt
from epd.multimodal.geometry import VisionGeometryConfig, image_geometry_from_bytes
from epd.multimodal.hashing import hash_encoded_media
from epd.multimodal.masks import MultimodalEncoderItemMetadata
from epd.multimodal.media import MediaInput
from epd.multimodal.processor_kwargs import MediaSettings
from epd.multimodal.video import VideoSampling, hash_encoded_video, video_geometry_from_bytes


def media_settings_for(model_dir: str | Path) -> MediaSettings:
    """A checkpoint's own image geometry and video sampling."""
    model_dir = Path(model_dir)
    return MediaSettings(VisionGeometryConfig.from_preprocessor_config(read_preprocessor_config(model_dir)),
                         VideoSampling.from_preprocessor_config(read_video_preprocessor_config(model_dir)))


class QwenVLInputProcessor:
    def __init__(self, model_dir: str | Path, tokenizer, spec: MultimodalSpec, *, model_id: str) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.model_id = model_id
        self.settings = media_settings_for(model_dir)

    @property
    def geometry_config(self) -> VisionGeometryConfig:
        return self.settings.image

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(template_kwargs or {}))

    def process_messages(self, messages: list[dict], media: Sequence[MediaInput | bytes],
                         tools: list[dict] | None = None, add_generation_prompt: bool = True,
                         template_kwargs: dict | None = None, processor_kwargs: dict | None = None
                         ) -> ProcessedPrompt:
        """``media`` are the encoded images and videos in the order their parts appear in
        ``messages`` (plain bytes: an image); ``tools``: rendered by the chat template (OpenAI's
        tool definitions); ``template_kwargs``: the template's own variables (``add_vision_id`` for
        Qwen-VL's); ``processor_kwargs``: vLLM's ``mm_processor_kwargs`` for every item."""
        token_ids = self.tokenizer.encode(self.render(messages, tools, add_generation_prompt, template_kwargs),
                                          add_special_tokens=False)
        return self.process_token_ids(token_ids, media, processor_kwargs)

    def process_token_ids(self, token_ids: list[int], media: Sequence[MediaInput | bytes],
                          processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """Expand the single ``<|image_pad|>`` / ``<|video_pad|>`` of each item to its row count
        and build metadata. Placeholders and items must agree in number and modality, in order."""
        items_in = [MediaInput.of(x) for x in media]
        pads = {self.spec.image_token_id: "image", self.spec.video_token_id: "video"}
        found = [pads[t] for t in token_ids if t in pads]
        given = [item.modality for item in items_in]
        if found != given:
            raise ValueError(f"the prompt's placeholders are {_count(found)} in the order {found} but the "
                             f"request gives {_count(given)} in the order {given}")
        settings = self.media_settings(processor_kwargs)
        items = [self._item(item, settings) for item in items_in]
        expanded, offsets = _expand_placeholders(token_ids, pads, [item.num_rows for item in items])
        items = [ProcessedItem(i.modality, i.data, i.mm_hash, offset, i.geometry, i.processor_kwargs)
                 for i, offset in zip(items, offsets)]
        return self._build(expanded, items)

    def media_settings(self, processor_kwargs: dict | None) -> MediaSettings:
        """The settings items are made with under ``processor_kwargs`` (checked: ``ValueError``)."""
        return self.settings.with_kwargs(processor_kwargs)

    def _item(self, item: MediaInput, settings: MediaSettings) -> ProcessedItem:
        """An item's geometry, hash and encoder kwargs (its offset is set once all are known)."""
        kwargs = settings.item_kwargs(item.modality, self.settings)
        if item.modality == "video":
            geometry = video_geometry_from_bytes(item.data, settings.video)
            # the sampled frames are a function of the bytes and these settings: no frame is hashed
            # (frames built by hand come with their pixels' hash, which names them instead)
            mm_hash = hash_encoded_video(item.data, geometry, processor_kwargs=settings.video.kwargs,
                                         model_id=self.model_id, frames_hash=item.content_hash)
        else:
            geometry = image_geometry_from_bytes(item.data, settings.image)
            # the prefix cache's block keys include it: other pixel bounds are other rows
            mm_hash = hash_encoded_media(item.data, modality="image", processor_kwargs=settings.image.pixel_kwargs,
                                         model_id=self.model_id)
        return ProcessedItem(item.modality, item.data, mm_hash, 0, geometry, kwargs)

    def _build(self, token_ids: list[int], items: list[ProcessedItem]) -> ProcessedPrompt:
        metadata = MultimodalEncoderItemMetadata(
            item_refs=[(item.modality, i) for i, item in enumerate(items)],
            encoder_token_lengths=[item.geometry.num_patches for item in items],
            output_embedding_lengths=[item.num_rows for item in items])
        metadata.validate()
        return ProcessedPrompt(token_ids, items, metadata)


def _count(modalities: list[str]) -> str:
    images, videos = modalities.count("image"), modalities.count("video")
    return f"{images} image(s) and {videos} video(s)"


def _expand_placeholders(token_ids: list[int], pads: dict[int, str], rows: list[int]) -> tuple[list[int], list[int]]:
    out, offsets, item = [], [], 0
    for tok in token_ids:
        if tok in pads:
            offsets.append(len(out))
            out.extend([tok] * rows[item])
            item += 1
        else:
            out.append(tok)
    return out, offsets
