"""The Qwen2-VL / Qwen2.5-VL vision tower split for CUDA-graph capture.

transformers' tower forward is not capturable as is: its attention splits the packed tokens with
``cu_seqlens.tolist()`` (a device-to-host sync, and shapes that change with every image), and the
positions and windows are built with Python loops over ``grid_thw``. So the forward is cut in three:

- ``prelude`` (eager): patch embedding, rotary cos/sin, Qwen2.5-VL's window permutation, and the
  per-token window ids; everything that depends on the image geometry.
- ``block_loop`` (captured): the block stack over fixed-size static buffers. Attention runs over the
  whole bucket with a boolean mask built *inside* the graph from per-token ids (same context or
  same window), so no lengths ever leave the device and the shapes depend only on the bucket.
- ``postlude`` (eager): the patch merger and, for Qwen2.5-VL, the inverse window permutation.

Run eager end to end this equals transformers' tower (tests/models/test_vision_blocks.py); the
encoder tier's graph runner captures ``block_loop`` per bucket. Padding tokens are zero rows: their
context ids come from the runner's dummy contexts and their window id is 0, which no real token has,
so a padding token never attends to a real one. Cost of the dense mask: T x T booleans per mask
(16 MiB at 4096 tokens) and attention over the bucket rather than per image.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Names of the static inputs of the block loop, their non-token shape and dtype come from the tower.
HIDDEN, COS, SIN, WINDOW_IDS = "hidden_states", "cos", "sin", "window_ids"


@dataclass
class VisionPrelude:
    """What the eager prelude made for one batch of items, in the block loop's token order."""

    inputs: dict[str, torch.Tensor]  # token-axis tensors, [T, ...]
    seq_lengths: list[int]  # tokens per attention context (one per image, one per video frame)
    window_index: torch.Tensor | None  # Qwen2.5-VL: merged-row permutation applied by the prelude


@dataclass
class VisionAttentionMetadata:
    segment_ids: torch.Tensor  # int32 [T]: the attention context of each token (full-attention layers)


class VisionMetadataProvider:
    """Per-token context ids, refilled in place before each replay (``graph_critical_attrs``)."""

    graph_critical_attrs = ("segment_ids",)

    def create(self, key, device: torch.device) -> VisionAttentionMetadata:
        return VisionAttentionMetadata(segment_ids=torch.zeros(key.total_tokens, dtype=torch.int32, device=device))

    def prepare(self, metadata: VisionAttentionMetadata, seq_lengths: Sequence[int]) -> None:
        ids = _ids_from_lengths(seq_lengths, first_id=0)
        if ids.numel() != metadata.segment_ids.numel():
            raise ValueError(f"context lengths cover {ids.numel()} tokens, the metadata holds "
                             f"{metadata.segment_ids.numel()}")
        metadata.segment_ids.copy_(ids)  # in place: the captured kernels read this address


class QwenVisionBlockLoop:
    """The three pieces of one loaded transformers Qwen vision tower (its modules, its weights)."""

    def __init__(self, tower: torch.nn.Module, model_type: str) -> None:
        self.tower = tower
        self.config = tower.config
        self.is_windowed = model_type == "qwen2_5_vl"
        self.full_attention_blocks = frozenset(getattr(tower, "fullatt_block_indexes", ()) or ())
        self.metadata_provider = VisionMetadataProvider()
        self._rotary = _rotary_function(model_type)

    # ---- what the graph runner needs -----------------------------------------------------------
    def input_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (non-token shape, dtype) of each static input."""
        width = self.tower.patch_embed.proj.weight.shape[0]
        head_dim = width // self.config.num_heads
        dtype = self.tower.patch_embed.proj.weight.dtype
        specs = {HIDDEN: ((width,), dtype), COS: ((head_dim,), torch.float32), SIN: ((head_dim,), torch.float32)}
        if self.is_windowed:
            specs[WINDOW_IDS] = ((), torch.int32)
        return specs

    output_specs = {HIDDEN: 0}  # output name -> token axis

    @staticmethod
    def seq_lengths(grid_thw: torch.Tensor) -> list[int]:
        """Tokens per attention context: one per image, one per video frame (from the grid alone)."""
        return [int(h * w) for t, h, w in grid_thw.tolist() for _ in range(int(t))]

    # ---- the three pieces ------------------------------------------------------------------------
    @torch.inference_mode()
    def prelude(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionPrelude:
        from transformers.vision_utils import get_vision_position_ids

        tower = self.tower
        grid_cpu = grid_thw.cpu()
        hidden = tower.patch_embed(pixel_values)
        position_ids = get_vision_position_ids(grid_cpu, tower.spatial_merge_size).to(hidden.device)
        cos, sin = tower.rotary_pos_emb(hidden, position_ids)
        # transformers' rotary math runs in float32 on whatever dtype these come in
        cos, sin = cos.float(), sin.float()
        seq_lengths = self.seq_lengths(grid_cpu)
        inputs = {HIDDEN: hidden, COS: cos, SIN: sin}
        window_index = None
        if self.is_windowed:
            from transformers.vision_utils import get_vision_window_index
            window_index, cu_windows = get_vision_window_index(
                grid_cpu, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
                patch_size=tower.patch_size)
            inputs = {name: self._permute(t, window_index.to(t.device)) for name, t in inputs.items()}
            # windows numbered from 1: the runner zero-fills padding rows, so 0 marks padding only
            inputs[WINDOW_IDS] = _ids_from_lengths(cu_windows.diff().tolist(), first_id=1).to(hidden.device)
        return VisionPrelude(inputs, seq_lengths, window_index)

    def block_loop(self, inputs: Mapping[str, torch.Tensor], metadata: VisionAttentionMetadata) -> dict[str, torch.Tensor]:
        """The captured part: every shape here is the bucket's, no host syncs."""
        hidden, cos, sin = inputs[HIDDEN], inputs[COS], inputs[SIN]
        full_mask = _same_id_mask(metadata.segment_ids)
        window_mask = _same_id_mask(inputs[WINDOW_IDS]) if self.is_windowed else full_mask
        for index, block in enumerate(self.tower.blocks):
            full = not self.is_windowed or index in self.full_attention_blocks
            hidden = self._block(block, hidden, cos, sin, full_mask if full else window_mask)
        return {HIDDEN: hidden}

    @torch.inference_mode()
    def postlude(self, hidden: torch.Tensor, prelude: VisionPrelude) -> torch.Tensor:
        """-> merged rows [sum rows, out_hidden] in the items' own order."""
        merged = self.tower.merger(hidden)
        if prelude.window_index is not None:
            merged = merged[torch.argsort(prelude.window_index.to(merged.device))]
        return merged

    @torch.inference_mode()
    def run_eager(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """All three pieces without a graph (the CPU path, and the reference for the graph)."""
        prelude = self.prelude(pixel_values, grid_thw)
        hidden = prelude.inputs[HIDDEN]
        metadata = self.metadata_provider.create(_Key(hidden.shape[0]), hidden.device)
        self.metadata_provider.prepare(metadata, prelude.seq_lengths)
        return self.postlude(self.block_loop(prelude.inputs, metadata)[HIDDEN], prelude)

    # ---- helpers -------------------------------------------------------------------------------
    def _permute(self, tensor: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """Reorder token rows by merged-row windows (Qwen2.5-VL keeps each merge unit together)."""
        unit = self.tower.spatial_merge_unit
        grouped = tensor.reshape(tensor.shape[0] // unit, unit, *tensor.shape[1:])
        return grouped[window_index].reshape(tensor.shape)

    def _block(self, block, hidden, cos, sin, mask):
        attn = block.attn
        x = block.norm1(hidden)
        num_tokens = x.shape[0]
        q, k, v = attn.qkv(x).reshape(num_tokens, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = self._rotary(q, k, cos, sin)
        # [T, H, D] -> [1, H, T, D]: one "batch" holding every context; the mask keeps them apart
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        hidden = hidden + attn.proj(out.squeeze(0).transpose(0, 1).reshape(num_tokens, -1))
        return hidden + block.mlp(block.norm2(hidden))


@dataclass(frozen=True)
class _Key:
    total_tokens: int  # what VisionMetadataProvider.create reads of an EncoderGraphKey


def _same_id_mask(ids: torch.Tensor) -> torch.Tensor:
    """[T] ids -> [1, 1, T, T] bool: token i may attend to token j iff they share an id."""
    return (ids.unsqueeze(1) == ids.unsqueeze(0)).unsqueeze(0).unsqueeze(0)


def _ids_from_lengths(lengths: Sequence[int], *, first_id: int) -> torch.Tensor:
    """[3, 2] -> [f, f, f, f+1, f+1] (int32), built on CPU."""
    counts = torch.tensor([int(n) for n in lengths], dtype=torch.long)
    ids = torch.arange(first_id, first_id + len(counts), dtype=torch.int32)
    return torch.repeat_interleave(ids, counts)


def _rotary_function(model_type: str):
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision
    return apply_rotary_pos_emb_vision
