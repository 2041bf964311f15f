"""Our CPU M-RoPE positions vs transformers' get_rope_index on the same prompts."""
import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from epd.models.qwen2_vl.mrope import compute_mrope_positions

IMAGE = 151655


def reference(ids: list[int], grids: list[tuple[int, int, int]]):
    cfg = Qwen2VLConfig(vision_config={"spatial_merge_size": 2})
    ids_t = torch.tensor([ids])
    # get_rope_index reads only the config; no weights are needed
    fake = type("M", (), {"config": cfg, "get_vision_position_ids": Qwen2VLModel.get_vision_position_ids})()
    pos, delta = Qwen2VLModel.get_rope_index(fake, ids_t, (ids_t == IMAGE).int(),
                                             image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0], int(delta)


def prompt(text_lens: list[int], grids: list[tuple[int, int, int]]):
    ids, items = [], []
    for i, n in enumerate(text_lens):
        ids += [7] * n
        if i < len(grids):
            items.append((len(ids), grids[i]))
            ids += [IMAGE] * (grids[i][0] * grids[i][1] * grids[i][2] // 4)
    return ids, items


@pytest.mark.parametrize("text_lens,grids", [
    ([5], []),
    ([3, 4], [(1, 4, 6)]),
    ([1, 2, 3, 9], [(1, 2, 2), (1, 8, 4), (1, 6, 10)]),
    ([0, 1, 5], [(1, 4, 4), (1, 2, 6)]),  # image first; real prompts separate images by vision_end/start
])
def test_positions_and_delta_match_transformers(text_lens, grids):
    ids, items = prompt(text_lens, grids)
    ours, delta = compute_mrope_positions(len(ids), items, spatial_merge_size=2)
    ref, ref_delta = reference(ids, grids)
    assert torch.equal(ours, ref)
    assert delta == ref_delta


def test_overlapping_items_are_rejected():
    with pytest.raises(ValueError, match="overlap"):
        compute_mrope_positions(20, [(0, (1, 4, 4)), (2, (1, 4, 4))], spatial_merge_size=2)
