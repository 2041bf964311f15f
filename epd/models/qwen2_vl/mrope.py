"""M-RoPE positions for a Qwen2-VL / Qwen2.5-VL prompt, computed on CPU from the item spans (no
pixels), as transformers' ``get_rope_index``.

Text tokens get (p, p, p). An item of merged grid (t, h, w) placed at text position p gets
(p + floor(ti * interval), p + hi, p + wi): ``interval`` is 1 for images and for Qwen2-VL's videos,
and ``tokens_per_second * second_per_grid_t`` for Qwen2.5-VL's videos (temporal positions follow
seconds of video, not frames). The text after an item resumes at p + max(h, w) (merged grid)
whatever its temporal extent. ``delta = max position + 1 - prompt length`` is all decode needs.
"""
from __future__ import annotations

import torch

Item = tuple  # (placeholder offset, grid_thw) or (placeholder offset, grid_thw, temporal interval)


def vision_positions(start: int, grid_thw: tuple[int, int, int], spatial_merge_size: int,
                     interval: float = 1.0) -> torch.Tensor:
    """[3, t*h*w] positions of one item's merged tokens, offset by ``start``."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    temporal = (torch.arange(t) * interval).long()  # truncated after scaling, as transformers does
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def compute_mrope_positions(prompt_len: int, items: list[Item], spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """items: (placeholder offset, grid_thw[, temporal interval]) in prompt order -> (positions
    [3, L] int64, delta)."""
    pieces, cursor, next_pos = [], 0, 0
    for offset, grid, *rest in sorted(items, key=lambda item: item[0]):
        if offset < cursor:
            raise ValueError(f"multimodal items overlap: one starts at {offset}, the previous ends at {cursor}")
        pieces.append(torch.arange(offset - cursor).expand(3, -1) + next_pos)
        next_pos += offset - cursor
        vis = vision_positions(next_pos, grid, spatial_merge_size, rest[0] if rest else 1.0)
        pieces.append(vis)
        cursor = offset + vis.shape[1]
        next_pos += max(grid[1], grid[2]) // spatial_merge_size
    if cursor > prompt_len:
        raise ValueError(f"multimodal items end at {cursor}, past the prompt length {prompt_len}")
    pieces.append(torch.arange(prompt_len - cursor).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1).long()
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta
