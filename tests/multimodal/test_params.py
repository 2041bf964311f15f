import pytest
import torch

from epd.multimodal.masks import MultimodalEncoderItemMetadata
from epd.multimodal.params import (
    CPU_ONLY_MULTIMODAL_DATA_KEYS,
    MM_METADATA_ONLY_KEYS,
    MULTIMODAL_ENCODER_ITEM_METADATA_KEY,
    MultimodalParams,
    has_mm_payload_keys,
    strip_mm_data_for_generation,
    strip_mm_encoder_inputs,
)


def _payload():
    return {
        "image": {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])},
        "multimodal_embedding": [torch.zeros(2, 8), torch.zeros(3, 8)],
        "mrope_config": {"mrope_position_deltas": torch.tensor([[-3]])},
        "multimodal_embed_mask_cumsum": torch.tensor([0, 1, 2, 2]),
        "multimodal_embedding_lengths": [2, 3],
        MULTIMODAL_ENCODER_ITEM_METADATA_KEY: MultimodalEncoderItemMetadata(
            item_refs=[("image", 0)], encoder_token_lengths=[8], output_embedding_lengths=[2]
        ),
        "special_token_offsets": [0],
    }


def test_key_sets_match_the_contract():
    assert CPU_ONLY_MULTIMODAL_DATA_KEYS == {
        "multimodal_embed_mask_cumsum",
        "multimodal_embedding_lengths",
        "multimodal_encoder_item_metadata",
    }
    assert MM_METADATA_ONLY_KEYS == CPU_ONLY_MULTIMODAL_DATA_KEYS | {
        "mrope_config",
        "special_token_offsets",
        "layout_metadata",
    }


@pytest.mark.parametrize(
    "mm_data, expected",
    [
        (None, False),
        ({}, False),
        ({"mrope_config": {}, "special_token_offsets": [1]}, False),
        ({"multimodal_embed_mask_cumsum": torch.zeros(1)}, False),
        ({"mrope_config": {}, "image": {}}, True),
        ({"multimodal_embedding": torch.zeros(1, 2)}, True),
    ],
)
def test_has_mm_payload_keys(mm_data, expected):
    assert has_mm_payload_keys(mm_data) is expected
    assert MultimodalParams(multimodal_data=mm_data or {}).has_content() is expected


def test_to_device_moves_all_tensors_except_cpu_only_keys():
    original = _payload()
    params = MultimodalParams(multimodal_data=original)
    params.to_device("multimodal_data", "meta")
    data = params.multimodal_data
    assert data["image"]["pixel_values"].device.type == "meta"
    assert data["image"]["image_grid_thw"].device.type == "meta"
    assert [embed.device.type for embed in data["multimodal_embedding"]] == ["meta", "meta"]
    assert data["mrope_config"]["mrope_position_deltas"].device.type == "meta"
    assert data["multimodal_embed_mask_cumsum"].device.type == "cpu"
    assert data["multimodal_embedding_lengths"] == [2, 3]
    assert type(data[MULTIMODAL_ENCODER_ITEM_METADATA_KEY]) is MultimodalEncoderItemMetadata
    assert data["special_token_offsets"] == [0]
    # The caller's dict keeps its CPU payload (item scheduling relies on it).
    assert original["image"]["pixel_values"].device.type == "cpu"


def test_to_device_target_keywords_select_dotted_paths():
    params = MultimodalParams(multimodal_data=_payload())
    params.to_device(
        "multimodal_data",
        torch.device("meta"),
        target_keywords=[
            "image.pixel_values",
            "multimodal_embedding",
            "multimodal_embed_mask_cumsum",
        ],
    )
    data = params.multimodal_data
    assert data["image"]["pixel_values"].device.type == "meta"
    assert data["image"]["image_grid_thw"].device.type == "cpu"
    assert all(embed.device.type == "meta" for embed in data["multimodal_embedding"])
    assert data["mrope_config"]["mrope_position_deltas"].device.type == "cpu"
    # Named as a target, but CPU-only keys never move.
    assert data["multimodal_embed_mask_cumsum"].device.type == "cpu"


def test_to_device_keyword_names_a_whole_subtree():
    params = MultimodalParams(multimodal_data=_payload())
    params.to_device("multimodal_data", "meta", target_keywords=["image"])
    image = params.multimodal_data["image"]
    assert image["pixel_values"].device.type == image["image_grid_thw"].device.type == "meta"
    assert params.multimodal_data["multimodal_embedding"][0].device.type == "cpu"


def test_to_device_rejects_cpu_only_key_already_off_cpu():
    cumsum = torch.zeros(3, device="meta")
    params = MultimodalParams(multimodal_data={"multimodal_embed_mask_cumsum": cumsum})
    with pytest.raises(ValueError, match="multimodal_embed_mask_cumsum.*must stay on CPU.*meta"):
        params.to_device("multimodal_data", "meta")


def test_to_device_rejects_non_dict_element():
    with pytest.raises(ValueError, match="multimodal_hashes to be a dict, got NoneType"):
        MultimodalParams().to_device("multimodal_hashes", "meta")


def test_strip_mm_data_for_generation_keeps_only_mrope_deltas():
    data = _payload()
    deltas = data["mrope_config"]["mrope_position_deltas"]
    data["mrope_config"]["mrope_rotary_cos_sin"] = torch.zeros(2)
    strip_mm_data_for_generation(data)
    assert list(data) == ["mrope_config"]
    assert list(data["mrope_config"]) == ["mrope_position_deltas"]
    assert data["mrope_config"]["mrope_position_deltas"] is deltas

    no_mrope = {"image": {}, "multimodal_embedding": torch.zeros(1)}
    strip_mm_data_for_generation(no_mrope)
    assert no_mrope == {}


def test_strip_mm_encoder_inputs_drops_only_raw_modalities():
    data = _payload()
    data["video"] = {"pixel_values_videos": torch.zeros(1)}
    data["audio"] = {}
    strip_mm_encoder_inputs(data)
    assert not {"image", "video", "audio"} & data.keys()
    assert {"multimodal_embedding", "multimodal_embed_mask_cumsum", "mrope_config"} <= data.keys()
