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

import dataclasses
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
        text = self.render(messages, tools, add_generation_prompt, template_kwargs)
        items = self._items(media, processor_kwargs)
        if self.spec.video_timestamps:
            text = _timestamped(text, items)
        return self._expand(self.tokenizer.encode(text, add_special_tokens=False), items)

    def process_token_ids(self, token_ids: list[int], media: Sequence[MediaInput | bytes],
                          processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """Expand each ``<|image_pad|>`` / ``<|video_pad|>`` to its row count and build metadata.
        Placeholders and items must agree in number and modality, in order (a Qwen3-VL video has
        one placeholder per temporal patch, each after its timestamp)."""
        return self._expand(list(token_ids), self._items(media, processor_kwargs))

    def _items(self, media: Sequence[MediaInput | bytes], processor_kwargs: dict | None) -> list[ProcessedItem]:
        settings = self.media_settings(processor_kwargs)
        return [self._item(MediaInput.of(x), settings) for x in media]

    def _segments(self, item: ProcessedItem) -> int:
        """Placeholders an item has in the prompt: one, or one per temporal patch (Qwen3-VL videos)."""
        return item.geometry.grid_thw[0] if item.modality == "video" and self.spec.video_timestamps else 1

    def _expand(self, token_ids: list[int], items: list[ProcessedItem]) -> ProcessedPrompt:
        pads = {self.spec.image_token_id: "image", self.spec.video_token_id: "video"}
        slots = [(k, n) for k, item in enumerate(items) for n in [self._segments(item)] for _ in range(n)]
        found = [pads[t] for t in token_ids if t in pads]
        expected = [items[k].modality for k, _ in slots]
        if found != expected:
            raise ValueError(f"the prompt's placeholders are {_count(found)} in the order {found} but the "
                             f"request gives {_count(expected)} in the order {expected}")
        out, starts = [], [[] for _ in items]
        slot = iter(slots)
        for tok in token_ids:
            if tok in pads:
                k, n = next(slot)
                starts[k].append(len(out))
                out.extend([tok] * (items[k].num_rows // n))
            else:
                out.append(tok)
        items = [dataclasses.replace(item, offset=offsets[0], segment_offsets=tuple(offsets) if len(offsets) > 1 or
                                     self._segments(item) > 1 else ()) for item, offsets in zip(items, starts)]
        return self._build(out, items)

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


_VIDEO_WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"


def _timestamped(text: str, items: list[ProcessedItem]) -> str:
    """Each video's one placeholder, as the chat template writes it, becomes one placeholder per
    temporal patch, each after its time in the video (Qwen3-VL's processor: the mean time of the
    patch's frames, ``<1.5 seconds>``). A placeholder without a video is left for the count check."""
    videos = [item.geometry for item in items if item.modality == "video"]
    pieces = text.split(_VIDEO_WRAPPER)
    out = [pieces[0]]
    for index, piece in enumerate(pieces[1:]):
        if index < len(videos):
            geometry = videos[index]
            times = _patch_times(geometry.frames_indices, geometry.metadata.fps,
                                 len(geometry.frames_indices) // geometry.grid_thw[0])
            out.append("".join(f"<{t:.1f} seconds>{_VIDEO_WRAPPER}" for t in times))
        else:
            out.append(_VIDEO_WRAPPER)
        out.append(piece)
    return "".join(out)


def _patch_times(indices: Sequence[int], fps: float, frames_per_patch: int) -> list[float]:
    seconds = [index / fps for index in indices]
    return [(seconds[i] + seconds[i + frames_per_patch - 1]) / 2 for i in range(0, len(seconds), frames_per_patch)]


def _count(modalities: list[str]) -> str:
    images, videos = modalities.count("image"), modalities.count("video")
    return f"{images} image(s) and {videos} video(s)"
