"""The multimodal state one sequence carries through the engine.

Bookkeeping (positions, cumsum) stays on CPU: it is read by index in Python every step, and a
CUDA tensor there would force a device->host sync per read (seed §2.1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceMultimodal:
    embeddings: torch.Tensor | None  # [rows, hidden] all items' rows in prompt order; None once stripped
    embed_positions: torch.Tensor | None  # [rows] int64 CPU: prompt position of each embedding row
    embed_mask_cumsum: torch.Tensor | None  # [prompt_len] int64 CPU
    mrope_positions: torch.Tensor | None  # [3, prompt_len] int64 CPU
    mrope_delta: int  # decode position = token index + mrope_delta

    def __post_init__(self) -> None:
        for name in ("embed_positions", "embed_mask_cumsum", "mrope_positions"):
            t = getattr(self, name)
            assert t is None or t.device.type == "cpu", f"{name} must stay on CPU, got {t.device}"

    def strip_for_generation(self) -> None:
        """After prefill only the mrope delta is needed (seed §6.7)."""
        self.embeddings = self.embed_positions = self.embed_mask_cumsum = self.mrope_positions = None

    @property
    def is_stripped(self) -> bool:
        return self.embeddings is None and self.mrope_positions is None


def positions_for_range(mm: SequenceMultimodal | None, start: int, end: int, prompt_len: int) -> torch.Tensor:
    """[3, end - start] int64 M-RoPE positions of tokens ``start..end``; past the prompt every
    component is ``index + mrope_delta``."""
    delta = mm.mrope_delta if mm is not None else 0
    if mm is None or mm.mrope_positions is None or start >= prompt_len:
        return (torch.arange(start, end, dtype=torch.long) + delta).expand(3, -1)
    head = mm.mrope_positions[:, start:min(end, prompt_len)]
    if end <= prompt_len:
        return head
    tail = (torch.arange(prompt_len, end, dtype=torch.long) + delta).expand(3, -1)
    return torch.cat([head, tail], dim=1)
