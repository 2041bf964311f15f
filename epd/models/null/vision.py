"""The zero-cost vision encoder: each image's or video's geometry from its header (as the router
computes it), rows of the configured width for it, no pixels decoded and no tower run. The encoder
tier around it is real: the item scheduler and its budgets, the cache keyed by content hash, the
rows' shared memory and their handles to prefill."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from epd.multimodal.geometry import image_geometry_from_bytes
from epd.multimodal.media import MediaInput
from epd.multimodal.processor_kwargs import MediaSettings
from epd.multimodal.video import video_geometry_from_bytes


class NullVisionEncoder:
    """An ``epd.encoder.runner.EncoderModel`` whose rows are zeros."""

    block_loop = None  # nothing to capture in a CUDA graph

    def __init__(self, settings: MediaSettings, embedding_dim: int, merge_size: int, *, dtype: torch.dtype,
                 device: str) -> None:
        self.settings, self.embedding_dim, self.merge_size = settings, embedding_dim, merge_size
        self.embedding_dtype, self.device = dtype, torch.device(device)

    def preprocess(self, inputs: Sequence[MediaInput | bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (an empty pixel tensor: nothing to compute from, grid_thw [N, 3] from the headers)."""
        grids = [self._grid(MediaInput.of(x)) for x in inputs]
        return torch.empty(0, 1), torch.tensor(grids, dtype=torch.long).reshape(-1, 3)

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        rows = (grid_thw.prod(-1) // self.merge_size ** 2).tolist()
        return [torch.zeros(n, self.embedding_dim, dtype=self.embedding_dtype, device=self.device) for n in rows]

    def encode_images(self, inputs: Sequence[MediaInput | bytes]) -> list[torch.Tensor]:
        """``epd.LLM``'s call: preprocess and encode in one."""
        return self.encode(*self.preprocess(inputs))

    def _grid(self, item: MediaInput) -> list[int]:
        settings = self.settings.with_kwargs(item.processor_kwargs or None)
        if item.modality == "video":
            return list(video_geometry_from_bytes(item.data, settings.video).grid_thw)
        return list(image_geometry_from_bytes(item.data, settings.image).grid_thw)
