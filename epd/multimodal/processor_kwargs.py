"""``mm_processor_kwargs`` (vLLM's name): how a request's images are resized and its videos sampled
and resized, checked against the checkpoint once, in one place, by the router and by the encoder.

``min_pixels`` / ``max_pixels`` apply to images and video frames alike (each within its own
checkpoint bound); ``fps`` / ``min_frames`` / ``max_frames`` to videos."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd.multimodal.geometry import PIXEL_KWARGS, VisionGeometryConfig, check_kwarg_names, max_tokens_per_item
from epd.multimodal.video import SAMPLING_KWARGS, VideoSampling

PROCESSOR_KWARGS = PIXEL_KWARGS + SAMPLING_KWARGS


@dataclass(frozen=True)
class MediaSettings:
    """The image geometry and the video sampling one request's items are made with."""

    image: VisionGeometryConfig
    video: VideoSampling

    def with_kwargs(self, overrides: Mapping[str, Any] | None) -> MediaSettings:
        """These settings with ``overrides`` applied; ``ValueError`` naming what is wrong."""
        if not overrides:
            return self
        check_kwarg_names(overrides, PROCESSOR_KWARGS)
        image = self.image.with_pixel_kwargs({k: v for k, v in overrides.items() if k in PIXEL_KWARGS})
        try:
            video = self.video.with_kwargs(overrides, ceiling=self.video)
        except ValueError as err:
            raise ValueError(f"for videos: {err}") from None
        return MediaSettings(image, video)

    @property
    def max_item_encoder_tokens(self) -> int:
        """The largest atomic item's encoder tokens, image or video (what the encoder's token
        budget is raised to, so every legal item stays schedulable)."""
        return max(max_tokens_per_item(self.image), self.video.max_encoder_tokens)

    def item_kwargs(self, modality: str, base: MediaSettings) -> dict[str, Any] | None:
        """What the encoder must be given for an item of ``modality`` made with these settings:
        None when they are ``base``'s (the checkpoint's), so such items share cache entries with
        requests that gave no kwargs."""
        if modality == "video":
            return None if self.video == base.video else self.video.kwargs
        return None if self.image == base.image else self.image.pixel_kwargs
