"""OpenAI-style chat messages -> (messages with media markers, encoded media in order).

Images are parts of type ``image`` / ``image_url`` / ``input_image``, videos ``video`` /
``video_url`` (vLLM's name); the k-th media part of a conversation, whatever its modality, is
item k of the request."""
from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from epd.multimodal.media import DEFAULT_LIMITS, MediaInput, MediaLimits, load_media_bytes
from epd.multimodal.video import DEFAULT_FPS, DEFAULT_VIDEO_LIMITS, frames_to_video, hash_video_frames

# a video file is read whole before its header is checked: its own byte limit, not an image's
VIDEO_FILE_LIMITS = MediaLimits(max_bytes=DEFAULT_VIDEO_LIMITS.max_bytes)

# part type -> modality
MEDIA_PART_TYPES = {"image": "image", "image_url": "image", "input_image": "image",
                    "video": "video", "video_url": "video"}
IMAGE_PART_TYPES = tuple(t for t, m in MEDIA_PART_TYPES.items() if m == "image")


def modality_of(part: dict) -> str | None:
    """``image``, ``video``, or None for a part that carries no media."""
    return MEDIA_PART_TYPES.get(part.get("type")) if isinstance(part, dict) else None


def media_parts(messages: list[dict]) -> list[tuple[int, int, dict]]:
    """Every media part as (message index, part index, part), in prompt order: the k-th is item k."""
    return [(i, j, part) for i, message in enumerate(messages)
            if isinstance(content := message.get("content"), list)
            for j, part in enumerate(content) if modality_of(part)]


def part_location(message_index: int, part_index: int) -> str:
    return f"messages[{message_index}].content[{part_index}]"


def media_source(part: dict):
    """What a media part points at: bytes, a URL or path (``{"url": ...}`` unwrapped), a PIL image."""
    modality = modality_of(part)
    source = part.get(modality) if part.get(modality) is not None else part.get(f"{modality}_url")
    return source.get("url") if isinstance(source, dict) else source


def extract_media(messages: list[dict], *, allowed_local_root: str | os.PathLike | None = None
                  ) -> tuple[list[dict], list[MediaInput]]:
    """Pull media parts out as encoded bytes and leave ``{"type": "image"}`` / ``{"type": "video"}``
    markers, which the chat template renders as one placeholder each. Parts may carry bytes, a PIL
    image, a ``data:`` URL or a local path (only under ``allowed_local_root``)."""
    media, out = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            modality = modality_of(part)
            if modality is None:
                parts.append(part)
                continue
            media.append(_media_input(part, modality, allowed_local_root))
            parts.append({"type": modality})
        out.append({**message, "content": parts})
    return out, media


def _media_input(part: dict, modality: str, allowed_local_root) -> MediaInput:
    source = media_source(part)
    if modality == "video" and isinstance(source, (list, tuple)):  # frames built by hand
        fps = float(part.get("fps") or DEFAULT_FPS)  # the frames' own rate: how far apart they are in time
        if not 0 < fps <= 60:
            raise ValueError(f"a video of frames takes an 'fps' in (0, 60], got {fps}")
        return MediaInput(frames_to_video(source, fps), "video",
                          content_hash=hash_video_frames([np.asarray(f) for f in source],
                                                         processor_kwargs={"fps": fps}, model_id=""))
    return MediaInput(_media_bytes(part, modality, allowed_local_root), modality)


def _media_bytes(part: dict, modality: str, allowed_local_root) -> bytes:
    source = media_source(part)
    if isinstance(source, Image.Image) and modality == "image":
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    if source is None:
        raise ValueError(f"{modality} part has no {modality} data; expected '{modality}' or '{modality}_url', got "
                         f"keys {sorted(part)}")
    return load_media_bytes(source, allowed_local_root=allowed_local_root, modality=modality,
                            limits=VIDEO_FILE_LIMITS if modality == "video" else DEFAULT_LIMITS)
