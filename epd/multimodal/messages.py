"""OpenAI-style chat messages -> (messages with image markers, encoded images in order)."""
from __future__ import annotations

import io
import os

from PIL import Image

from epd.multimodal.media import load_media_bytes

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def media_parts(messages: list[dict]) -> list[tuple[int, int, dict]]:
    """Every image part as (message index, part index, part), in prompt order: the k-th is item k."""
    return [(i, j, part) for i, message in enumerate(messages)
            if isinstance(content := message.get("content"), list)
            for j, part in enumerate(content) if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES]


def part_location(message_index: int, part_index: int) -> str:
    return f"messages[{message_index}].content[{part_index}]"


def extract_images(messages: list[dict], *, allowed_local_root: str | os.PathLike | None = None
                   ) -> tuple[list[dict], list[bytes]]:
    """Pull image parts out as encoded bytes and leave ``{"type": "image"}`` markers, which the
    chat template renders as one placeholder each. Parts may carry bytes, a PIL image, a
    ``data:`` URL or a local path (only under ``allowed_local_root``)."""
    images, out = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") in IMAGE_PART_TYPES:
                images.append(_image_bytes(part, allowed_local_root))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _image_bytes(part: dict, allowed_local_root) -> bytes:
    source = part.get("image") or part.get("image_url")
    if isinstance(source, dict):
        source = source.get("url")
    if isinstance(source, Image.Image):
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    if source is None:
        raise ValueError(f"image part has no image data; expected 'image' or 'image_url', got keys {sorted(part)}")
    return load_media_bytes(source, allowed_local_root=allowed_local_root)
