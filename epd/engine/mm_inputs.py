"""The multimodal state one sequence carries through the engine.

Bookkeeping (positions, cumsum) stays on CPU: it is read by index in Python every step, and a
CUDA tensor there would force a device->host sync per read. Embedding rows live per
item in ``ItemRows``; on a prefill worker they arrive later, pushed by encoders, and the scheduler
only computes as far as the rows that have arrived.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from epd.errors import UpstreamError
from epd.multimodal.layout import PromptLayout
from epd.multimodal.runtime import join_embeddings


class EmbeddingError(UpstreamError):
    """An item's embedding does not fit its placeholders."""


class ItemRows:
    """Per-item embedding tensors ``[rows_i, hidden]`` in prompt order, possibly still arriving
    (set from another thread: one list slot per item, assigned whole)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self._tensors: list[torch.Tensor | None] = [None] * len(lengths)

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> "ItemRows":
        rows = cls([t.shape[0] for t in tensors])
        for i, t in enumerate(tensors):
            rows.set_item(i, t)
        return rows

    @property
    def total_rows(self) -> int:
        return sum(self.lengths)

    def set_item(self, index: int, tensor: torch.Tensor) -> None:
        if tensor.dim() != 2 or tensor.shape[0] != self.lengths[index]:
            raise EmbeddingError(f"item {index}: expected {self.lengths[index]} embedding rows, "
                                 f"got a tensor of shape {tuple(tensor.shape)}")
        self._tensors[index] = tensor

    def _ready_prefix(self) -> list[torch.Tensor]:
        """The items that have arrived contiguously from item 0 (later ones may arrive first)."""
        ready = []
        for tensor in self._tensors:
            if tensor is None:
                break
            ready.append(tensor)
        return ready

    def num_ready_rows(self) -> int:
        return sum(t.shape[0] for t in self._ready_prefix())

    def is_complete(self) -> bool:
        return all(t is not None for t in self._tensors)

    def rows(self, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` across items: sliced before joining, so one item stays a view."""
        if last > self.num_ready_rows():
            raise EmbeddingError(f"rows [{first}, {last}) requested but only {self.num_ready_rows()} have arrived")
        return join_embeddings(self._ready_prefix(), first, last)


@dataclass
class SequenceMultimodal:
    embeddings: ItemRows | None  # None once stripped
    embed_positions: torch.Tensor | None  # [rows] int64 CPU: prompt position of each embedding row
    embed_mask_cumsum: torch.Tensor | None  # [prompt_len] int64 CPU
    mrope_positions: torch.Tensor | None  # [3, prompt_len] int64 CPU
    mrope_delta: int  # decode position = token index + mrope_delta
    # makes the stripped inputs again (the in-process engine re-encodes) when a preempted
    # sequence must recompute its prompt; None: this sequence can never need them again
    rebuild: Callable[[], "SequenceMultimodal"] | None = None

    def __post_init__(self) -> None:
        for name in ("embed_positions", "embed_mask_cumsum", "mrope_positions"):
            t = getattr(self, name)
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"{name} must stay on CPU, got {t.device}")

    @classmethod
    def from_layout(cls, layout: PromptLayout, rows: ItemRows | None,
                    rebuild: Callable[[], "SequenceMultimodal"] | None = None) -> "SequenceMultimodal":
        return cls(rows, layout.embed_positions, layout.embed_mask_cumsum, layout.mrope_positions,
                   layout.mrope_delta, rebuild)

    @classmethod
    def delta_only(cls, mrope_delta: int) -> "SequenceMultimodal":
        """What a decode worker holds: nothing multimodal but the position delta."""
        return cls(None, None, None, None, mrope_delta)

    def strip_for_generation(self) -> None:
        """After prefill only the mrope delta is needed: every later token's position is its
        index plus the delta, and the embeddings already live in the KV cache."""
        self.embeddings = self.embed_positions = self.embed_mask_cumsum = self.mrope_positions = None

    def restore_for_recompute(self) -> None:
        """Bring back what ``strip_for_generation`` dropped, before the prompt is computed again."""
        if not self.is_stripped:
            return
        if self.rebuild is None:
            raise RuntimeError("a stripped multimodal sequence must recompute its prompt, but nothing can "
                               "rebuild its embeddings (it was prefilled on another worker)")
        fresh = self.rebuild()
        self.embeddings, self.embed_positions = fresh.embeddings, fresh.embed_positions
        self.embed_mask_cumsum, self.mrope_positions = fresh.embed_mask_cumsum, fresh.mrope_positions

    @property
    def is_stripped(self) -> bool:
        return self.embeddings is None and self.mrope_positions is None

    def inputs_ready_until(self) -> int | None:
        """Prompt position up to which every embedding row has arrived (None: all have)."""
        if self.embeddings is None or self.embed_positions is None:
            return None
        ready = self.embeddings.num_ready_rows()
        if ready >= self.embeddings.total_rows:
            return None
        return int(self.embed_positions[ready])


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
