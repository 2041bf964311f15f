"""Content hashes for multimodal cache keys.

A cache key must describe what the model sees, not how the bytes happen to be
laid out. ``serialize_item`` is therefore canonical and self-describing: every
value is ``[1-byte type tag][typed metadata][length-prefixed payload]`` with all
multi-byte integers big-endian. Shapes and dtypes live in the metadata, so a
W x H image and its H x W transpose, or a reshaped array with the same raw bytes,
never share a key.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import singledispatch

import numpy as np
import torch
from blake3 import blake3
from PIL import Image

Write = Callable[[bytes | bytearray | memoryview], object]

# One byte per value kind. Never renumber: persisted or cross-process keys
# depend on these exact bytes.
_TAG_NONE = b"N"
_TAG_BOOL = b"B"
_TAG_INT = b"I"
_TAG_FLOAT = b"F"
_TAG_STR = b"S"
_TAG_BYTES = b"Y"
_TAG_SEQUENCE = b"L"
_TAG_MAPPING = b"D"
_TAG_ARRAY = b"A"
_TAG_IMAGE = b"P"

_HEX_DIGEST_CHARS = 64
_INT32_WORDS = 8
_HEX_CHARS_PER_WORD = 8
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


def serialize_item(value: object) -> bytes:
    """Canonical byte encoding of ``value`` (see module docstring)."""
    out = bytearray()
    _encode(value, out.extend)
    return bytes(out)


def hash_item(value: object) -> str:
    """BLAKE3 hexdigest (64 lowercase hex chars) of ``serialize_item(value)``."""
    # Stream into the hasher so large pixel arrays are not copied into one buffer.
    hasher = blake3()
    _encode(value, hasher.update)
    return hasher.hexdigest()


def hash_processor_kwargs(kwargs: dict | None) -> str:
    """Hash of the preprocessing settings; ``None`` and ``{}`` mean the same."""
    return hash_item(_checked_kwargs(kwargs))


def hash_encoded_media(
    data: bytes, *, modality: str, processor_kwargs: dict | None, model_id: str
) -> str:
    """Key for raw encoded media (PNG/JPEG/...) as one model will see it.

    The same file resized differently, or fed to another model, yields different
    embeddings, so the processor kwargs and the model id are part of the key.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"hash_encoded_media expects encoded bytes, got {type(data).__name__}")
    return hash_item(
        {
            "kind": "encoded_media",
            "modality": modality,
            "model_id": model_id,
            "processor_kwargs": _checked_kwargs(processor_kwargs),
            "data": bytes(data),
        }
    )


def hexdigest_to_int32(hexdigest: str) -> list[int]:
    """Split a 64-char hexdigest into 8 signed int32 words (big-endian words).

    Schedulers and KV-cache managers compare hashes as plain integer keys.
    """
    if not isinstance(hexdigest, str) or len(hexdigest) != _HEX_DIGEST_CHARS:
        raise ValueError(
            f"expected a {_HEX_DIGEST_CHARS}-char hexdigest, got {hexdigest!r} "
            f"(length {len(hexdigest) if isinstance(hexdigest, str) else 'n/a'})"
        )
    try:
        raw = bytes.fromhex(hexdigest)
    except ValueError as error:
        raise ValueError(f"hexdigest contains non-hex characters: {hexdigest!r}") from error
    return list(struct.unpack(f">{_INT32_WORDS}i", raw))


def int32_to_hexdigest(values) -> str:
    """Inverse of ``hexdigest_to_int32``: 8 signed int32 words -> 64 hex chars."""
    words = [int(value) for value in values]
    if len(words) != _INT32_WORDS:
        raise ValueError(f"expected {_INT32_WORDS} int32 words, got {len(words)}: {words}")
    out_of_range = [word for word in words if not _INT32_MIN <= word <= _INT32_MAX]
    if out_of_range:
        raise ValueError(f"values outside the int32 range: {out_of_range}")
    return struct.pack(f">{_INT32_WORDS}i", *words).hex()


def _checked_kwargs(kwargs: dict | None) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"processor kwargs must be a dict or None, got {type(kwargs).__name__}")
    return kwargs


# --- Encoding --------------------------------------------------------------------------------


def _length_prefixed(payload: bytes | memoryview, write: Write) -> None:
    write(struct.pack(">Q", len(payload)))
    write(payload)


def _write_text(text: str, write: Write) -> None:
    _length_prefixed(text.encode("utf-8"), write)


@singledispatch
def _encode(value: object, write: Write) -> None:
    raise TypeError(
        f"cannot hash a value of type {type(value).__module__}.{type(value).__qualname__}; "
        "supported: None, bool, int, float, str, bytes, list/tuple, dict, "
        "numpy.ndarray, torch.Tensor, PIL.Image.Image"
    )


@_encode.register(type(None))
def _(value: None, write: Write) -> None:
    write(_TAG_NONE)


@_encode.register(bool)
def _(value: bool, write: Write) -> None:
    # Registered separately from int so True and 1 never share a key.
    write(_TAG_BOOL + (b"\x01" if value else b"\x00"))


@_encode.register(int)
def _(value: int, write: Write) -> None:
    # Arbitrary precision: minimal signed big-endian two's complement.
    write(_TAG_INT)
    _length_prefixed(value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True), write)


@_encode.register(float)
def _(value: float, write: Write) -> None:
    write(_TAG_FLOAT)
    _length_prefixed(struct.pack(">d", value), write)


@_encode.register(str)
def _(value: str, write: Write) -> None:
    write(_TAG_STR)
    _write_text(value, write)


@_encode.register(bytes)
@_encode.register(bytearray)
@_encode.register(memoryview)
def _(value: bytes, write: Write) -> None:
    write(_TAG_BYTES)
    _length_prefixed(bytes(value), write)


@_encode.register(list)
@_encode.register(tuple)
def _(value: list | tuple, write: Write) -> None:
    # list and tuple share a tag: wire formats (JSON, msgpack) turn tuples into
    # lists, and the same kwargs must keep the same key on both sides.
    write(_TAG_SEQUENCE + struct.pack(">Q", len(value)))
    for element in value:
        _encode(element, write)


@_encode.register(dict)
def _(value: dict, write: Write) -> None:
    # Sort by the encoded key so mixed key types still have one canonical order.
    entries = sorted(
        ((serialize_item(key), item) for key, item in value.items()), key=lambda entry: entry[0]
    )
    write(_TAG_MAPPING + struct.pack(">Q", len(entries)))
    for encoded_key, item in entries:
        write(encoded_key)
        _encode(item, write)


@_encode.register(np.generic)
def _(value: np.generic, write: Write) -> None:
    # numpy scalars (np.int64(3), np.float32(0.5)) hash like the Python scalar.
    _encode(value.item(), write)


@_encode.register(np.ndarray)
def _(value: np.ndarray, write: Write) -> None:
    array = _canonical_array(value)
    _encode_array(array, array.dtype.str, write)


@_encode.register(torch.Tensor)
def _(value: torch.Tensor, write: Write) -> None:
    array, dtype_name = _tensor_as_array(value)
    _encode_array(array, dtype_name, write)


@_encode.register(Image.Image)
def _(value: Image.Image, write: Write) -> None:
    width, height = value.size
    # Palette images store indices; the palette itself decides the colours.
    palette = bytes(value.getpalette() or []) if value.mode in ("P", "PA") else b""
    write(_TAG_IMAGE)
    _write_text(value.mode, write)
    write(struct.pack(">QQ", width, height))
    _length_prefixed(palette, write)
    _length_prefixed(value.tobytes(), write)


def _encode_array(array: np.ndarray, dtype_name: str, write: Write) -> None:
    """``array`` is C-contiguous little-endian; ``dtype_name`` labels its elements."""
    write(_TAG_ARRAY)
    _write_text(dtype_name, write)
    write(struct.pack(">I", array.ndim))
    write(struct.pack(f">{array.ndim}Q", *array.shape))
    # A flat uint8 view is zero-copy and, unlike memoryview.cast, accepts empty arrays.
    _length_prefixed(array.reshape(-1).view(np.uint8).data, write)


def _canonical_array(array: np.ndarray) -> np.ndarray:
    if array.dtype.hasobject:
        raise TypeError("cannot hash a numpy array of Python objects (dtype=object)")
    if array.dtype.byteorder == ">":
        # Same values, same key, whatever the source byte order.
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it promotes 0-d arrays to shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


def _tensor_as_array(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """CPU, C-contiguous numpy view of ``tensor`` plus its dtype label.

    The label is numpy's dtype string, so a tensor and an ndarray with equal
    content hash equal. dtypes numpy lacks (bfloat16, float8) are reinterpreted
    as same-width unsigned ints and labelled with the torch name instead.
    """
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot hash a {tensor.layout} tensor; convert it to dense first")
    tensor = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
    try:
        array = _canonical_array(tensor.numpy())
        return array, array.dtype.str
    except TypeError:
        bits = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
        raw = tensor.view(bits[tensor.element_size()]).numpy()
        return _canonical_array(raw), str(tensor.dtype)
