"""M-RoPE positions for a Qwen2-VL prompt, computed on CPU from the item spans (no pixels).

Text tokens get (p, p, p). An image of merged grid (t, h, w) placed at text position p gets
(p + ti, p + hi, p + wi), and the text after it resumes at p + max(h, w) (merged grid), as in
transformers' ``get_rope_index``. ``delta = max position + 1 - prompt length`` is all decode needs.
"""
from __future__ import annotations

import torch


def vision_positions(start: int, grid_thw: tuple[int, int, int], spatial_merge_size: int) -> torch.Tensor:
    """[3, t*h*w] positions of one item's merged tokens, offset by ``start``."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def compute_mrope_positions(prompt_len: int, items: list[tuple[int, tuple[int, int, int]]],
                            spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """items: (placeholder offset, grid_thw) in prompt order -> (positions [3, L] int64, delta)."""
    pieces, cursor, next_pos = [], 0, 0
    for offset, grid in sorted(items):
        if offset < cursor:
            raise ValueError(f"multimodal items overlap: one starts at {offset}, the previous ends at {cursor}")
        pieces.append(torch.arange(offset - cursor).expand(3, -1) + next_pos)
        next_pos += offset - cursor
        vis = vision_positions(next_pos, grid, spatial_merge_size)
        pieces.append(vis)
        cursor = offset + vis.shape[1]
        next_pos += max(grid[1], grid[2]) // spatial_merge_size
    if cursor > prompt_len:
        raise ValueError(f"multimodal items end at {cursor}, past the prompt length {prompt_len}")
    pieces.append(torch.arange(prompt_len - cursor).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1).long()
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta
