"""What every model family provides (``ModelFamily``), what its input processor produces
(``ProcessedPrompt``: what the router hands a backend) and what the data layer needs to know about
a checkpoint's multimodal tokens (``MultimodalSpec``); families implement these, callers see no more."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from epd.multimodal.geometry import ImageGeometry
from epd.multimodal.layout import PromptLayout
from epd.multimodal.masks import MultimodalEncoderItemMetadata
from epd.multimodal.processor_kwargs import MediaSettings
from epd.multimodal.video import VideoGeometry
from epd.types import MultimodalItemSpan


@dataclass(frozen=True)
class MultimodalSpec:
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    vocab_size: int
    embedding_dim: int  # width of one embedding row as the encoder makes it (the LLM hidden size, x levels)
    # a video's temporal M-RoPE step per second of video (Qwen2.5-VL); 0: one step per temporal patch
    tokens_per_second: float = 0.0
    # vision feature levels packed after the main embedding in each row (Qwen3-VL's deepstack): a
    # row is ``(1 + deepstack_levels) * hidden`` wide and ``embedding_dim`` is that width
    deepstack_levels: int = 0
    # a video's temporal patches stand apart in the prompt, each after its timestamp text
    # ("<1.5 seconds>"), as Qwen3-VL's processor writes them
    video_timestamps: bool = False

    @classmethod
    def from_config(cls, hf: dict, **fields) -> "MultimodalSpec":
        """The placeholder and marker token ids and the merge size a checkpoint's config.json gives
        (the same keys in every Qwen-VL family), with the family's own ``fields``."""
        return cls(image_token_id=hf["image_token_id"], video_token_id=hf["video_token_id"],
                   vision_start_token_id=hf["vision_start_token_id"], vision_end_token_id=hf["vision_end_token_id"],
                   spatial_merge_size=hf["vision_config"].get("spatial_merge_size", 2), **fields)

    @property
    def mm_token_ids(self) -> tuple[int, ...]:
        """Placeholder ids whose rows come from the encoder (in the vocabulary: one embedding lookup)."""
        return (self.image_token_id, self.video_token_id)


@dataclass(frozen=True)
class ProcessedItem:
    modality: str
    data: bytes  # encoded media, as the user sent it; the encoder decodes it
    mm_hash: str
    offset: int  # first placeholder position in the prompt
    geometry: ImageGeometry | VideoGeometry
    # the processor kwargs it was made with, where they differ from the checkpoint's (None: its
    # own); the encoder preprocesses (a video: samples) with them, so its rows match ``geometry``
    processor_kwargs: dict[str, Any] | None = None
    segment_offsets: tuple[int, ...] = ()  # a video split by timestamps (Qwen3-VL): each temporal patch's start

    @property
    def num_rows(self) -> int:
        return self.geometry.num_embedding_rows

    @property
    def second_per_grid_t(self) -> float:
        return getattr(self.geometry, "second_per_grid_t", 0.0)

    @property
    def span(self) -> MultimodalItemSpan:
        return MultimodalItemSpan(self.offset, self.num_rows, self.mm_hash, tuple(self.geometry.grid_thw),
                                  self.second_per_grid_t, self.segment_offsets)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for a backend: ids with every placeholder span expanded, and its items."""

    prompt_token_ids: list[int]
    items: list[ProcessedItem]
    item_metadata: MultimodalEncoderItemMetadata

    @property
    def num_embedding_rows(self) -> int:
        return sum(item.num_rows for item in self.items)


class ModelFamily(Protocol):
    name: str

    def load_llm(self, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tp=None) -> torch.nn.Module:
        """The language model on our engine, weights loaded straight onto ``device`` in ``dtype``;
        with ``tp`` (an ``epd.models.parallel.TensorParallel``, families that support it), this
        rank's part of it only."""

    def load_vision(self, model_dir: Path, *, dtype: torch.dtype, device: str):
        """The vision encoder (an ``epd.encoder.runner.EncoderModel``)."""

    def mm_spec(self, model_dir: Path) -> MultimodalSpec: ...

    def media_settings(self, model_dir: Path) -> MediaSettings:
        """The checkpoint's own image geometry and video sampling (what mm_processor_kwargs change)."""

    def input_processor(self, model_dir: Path, tokenizer):
        """The router's preprocessing: chat template, ids, item geometry and hashes -> ProcessedPrompt."""

    def prompt_layout(self, spec: MultimodalSpec, token_ids: Sequence[int],
                      items: Sequence[MultimodalItemSpan]) -> PromptLayout:
        """Masks, embed-mask cumsum and positions of a prompt, where its sequence is built."""
