import struct

import numpy as np
import pytest
import torch
from blake3 import blake3
from PIL import Image

from epd.multimodal.hashing import (
    hash_encoded_media,
    hash_item,
    hash_processor_kwargs,
    hexdigest_to_int32,
    int32_to_hexdigest,
    serialize_item,
)


def test_scalar_encoding_is_tag_then_big_endian_length_prefixed_payload():
    assert serialize_item(None) == b"N"
    assert serialize_item(True) == b"B\x01"
    assert serialize_item(1) == b"I" + struct.pack(">Q", 1) + b"\x01"
    minus_129 = (-129).to_bytes(2, "big", signed=True)
    assert serialize_item(-129) == b"I" + struct.pack(">Q", 2) + minus_129
    assert serialize_item("hé") == b"S" + struct.pack(">Q", 3) + "hé".encode()
    assert serialize_item(b"ab") == b"Y" + struct.pack(">Q", 2) + b"ab"
    assert serialize_item(1.5) == b"F" + struct.pack(">Q", 8) + struct.pack(">d", 1.5)


def test_values_of_different_types_never_collide():
    values = [None, True, 1, 1.0, "1", b"1", [1], {1: 1}, np.array([1]), np.array(1)]
    assert len({serialize_item(value) for value in values}) == len(values)
    assert serialize_item(2**100) != serialize_item(2**100 + 1)


def test_dict_keys_are_sorted_and_sequences_are_ordered():
    assert serialize_item({"b": 1, "a": [1, 2]}) == serialize_item({"a": [1, 2], "b": 1})
    assert serialize_item([1, 2]) != serialize_item([2, 1])
    # Wire formats turn tuples into lists; the key must survive the trip.
    assert serialize_item((1, 2)) == serialize_item([1, 2])


def test_array_metadata_is_dtype_ndim_shape():
    encoded = serialize_item(np.zeros((2, 3), dtype=np.float32))
    expected = (
        b"A" + struct.pack(">Q", 3) + b"<f4"
        + struct.pack(">I", 2) + struct.pack(">2Q", 2, 3)
        + struct.pack(">Q", 24) + bytes(24)
    )
    assert encoded == expected


def test_tensor_and_ndarray_with_same_content_hash_equal():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert serialize_item(torch.from_numpy(array.copy())) == serialize_item(array)
    assert hash_item(torch.arange(6)) == hash_item(np.arange(6, dtype=np.int64))
    as_tensor = {"pixel_values": torch.ones(2, 2)}
    assert hash_item(as_tensor) == hash_item({"pixel_values": np.ones((2, 2), np.float32)})


def test_transposed_and_reshaped_arrays_hash_differently():
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    # Same raw bytes, different geometry.
    assert array.tobytes() == array.reshape(3, 2).tobytes()
    assert hash_item(array) != hash_item(array.reshape(3, 2))
    assert hash_item(array) != hash_item(array.reshape(6))
    assert hash_item(np.zeros((2, 3))) != hash_item(np.zeros((3, 2)))
    assert hash_item(array) != hash_item(array.T)
    assert hash_item(torch.zeros(4, 5)) != hash_item(torch.zeros(5, 4))


def test_layout_does_not_change_content_hash():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert hash_item(array.T) == hash_item(np.ascontiguousarray(array.T))
    transposed = torch.arange(6).reshape(2, 3).t()
    assert hash_item(transposed) == hash_item(transposed.contiguous())
    assert hash_item(np.arange(4, dtype=">i4")) == hash_item(np.arange(4, dtype="<i4"))
    # 0-d arrays keep ndim 0 and do not collide with shape (1,).
    assert hash_item(np.array(3.0)) != hash_item(np.array([3.0]))


def test_dtype_is_part_of_the_key_including_numpy_less_dtypes():
    assert hash_item(np.zeros(4, np.float32)) != hash_item(np.zeros(4, np.int32))
    bits = torch.tensor([0x3F80, 0x4000], dtype=torch.int16)
    assert hash_item(bits.view(torch.bfloat16)) != hash_item(bits.view(torch.float16))
    ones = torch.ones(3, dtype=torch.bfloat16)
    assert hash_item(ones) == hash_item(ones.clone())


def test_pil_images_hash_mode_size_and_palette():
    assert hash_item(Image.new("RGB", (2, 3))) != hash_item(Image.new("RGB", (3, 2)))
    assert hash_item(Image.new("L", (4, 1))) != hash_item(Image.new("P", (4, 1)))
    red, blue = Image.new("P", (2, 2)), Image.new("P", (2, 2))
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    assert hash_item(red) != hash_item(blue)
    colour = (1, 2, 3)
    same = [hash_item(Image.new("RGB", (2, 2), colour)) for _ in range(2)]
    assert same[0] == same[1]


def test_unsupported_type_raises_type_error_naming_it():
    with pytest.raises(TypeError, match="set"):
        serialize_item({1, 2})
    with pytest.raises(TypeError, match="object"):
        hash_item([object()])


def test_hash_item_is_blake3_of_serialized_bytes():
    value = {"image": np.ones((2, 2), np.uint8), "n": 3}
    digest = hash_item(value)
    assert digest == blake3(serialize_item(value)).hexdigest()
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_encoded_media_key_covers_bytes_kwargs_model_and_modality():
    base = dict(modality="image", processor_kwargs={"max_pixels": 1024}, model_id="qwen")
    key = hash_encoded_media(b"\x89PNG...", **base)
    assert key == hash_encoded_media(b"\x89PNG...", **base)
    assert key != hash_encoded_media(b"\x89PNG..!", **base)
    resized = {**base, "processor_kwargs": {"max_pixels": 2048}}
    assert key != hash_encoded_media(b"\x89PNG...", **resized)
    assert key != hash_encoded_media(b"\x89PNG...", **{**base, "model_id": "llava"})
    assert key != hash_encoded_media(b"\x89PNG...", **{**base, "modality": "video"})
    no_kwargs = {**base, "processor_kwargs": None}
    empty_kwargs = {**base, "processor_kwargs": {}}
    assert hash_encoded_media(b"x", **no_kwargs) == hash_encoded_media(b"x", **empty_kwargs)


def test_processor_kwargs_hash_ignores_order_and_treats_none_as_empty():
    assert hash_processor_kwargs({"a": 1, "b": 2}) == hash_processor_kwargs({"b": 2, "a": 1})
    assert hash_processor_kwargs(None) == hash_processor_kwargs({})
    assert hash_processor_kwargs({"a": 1}) != hash_processor_kwargs({"a": 2})
    with pytest.raises(TypeError, match="list"):
        hash_processor_kwargs([("a", 1)])


def test_hexdigest_int32_round_trip_is_exact_and_signed():
    digest = hash_item("round trip")
    words = hexdigest_to_int32(digest)
    assert len(words) == 8 and all(-(2**31) <= word < 2**31 for word in words)
    assert int32_to_hexdigest(words) == digest
    assert hexdigest_to_int32("ff" * 32) == [-1] * 8
    assert hexdigest_to_int32("80000000" + "00000001" * 7) == [-(2**31)] + [1] * 7
    assert int32_to_hexdigest([-1] * 8) == "f" * 64


def test_hexdigest_int32_reject_bad_input():
    with pytest.raises(ValueError, match="64-char"):
        hexdigest_to_int32("abc")
    with pytest.raises(ValueError, match="non-hex"):
        hexdigest_to_int32("zz" * 32)
    with pytest.raises(ValueError, match="8 int32"):
        int32_to_hexdigest([1, 2, 3])
    with pytest.raises(ValueError, match="int32 range"):
        int32_to_hexdigest([2**31] + [0] * 7)
