"""What the cluster's encoder cache store holds, and the few operations a store must offer.

An entry is a header and the rows' bytes: a magic, the dtype, the shape and a CRC-32 of the bytes.
A reader checks all of it against what it expects (``decode_entry``): an entry of another dtype or
shape (a key collision, a bad writer), a truncated one or one whose bytes fail their checksum is
``CorruptEntry``, and its rows are never used. Encoders write and read entries
(``epd.encoder.shared_store``), prefill workers read them (``store`` handles,
``epd.transport.store``): both sides of one format, so it lives here.
"""
from __future__ import annotations

import struct
import zlib
from collections import Counter
from typing import Protocol

import torch

_MAGIC = b"EPDE"
ENTRY_VERSION = 1
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = struct.Struct("<4sBBBxII")  # magic, version, dtype code, ndim, pad, crc32, payload bytes
_DIM = struct.Struct("<Q")


class StoreBackend(Protocol):
    """The few operations the shared cache needs of a key-value store (``put`` inserts or replaces;
    ``put_first`` writes only a key nobody wrote, and returns what the key holds after it: the
    value given when this call wrote it). Each may raise on an outage."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def put_first(self, key: str, value: bytes) -> bytes | None: ...

    def remove(self, key: str) -> None: ...

    def close(self) -> None: ...


class CorruptEntry(ValueError):
    """A stored entry that is not what its reader expects (dtype, shape), or whose bytes are damaged."""


def encode_entry(tensor: torch.Tensor) -> bytes:
    """A tensor's header and bytes, as stored."""
    rows = tensor.detach().to("cpu").contiguous()
    payload = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
    header = _HEADER.pack(_MAGIC, ENTRY_VERSION, _DTYPES.index(rows.dtype), rows.dim(), zlib.crc32(payload), len(payload))
    return header + b"".join(_DIM.pack(d) for d in rows.shape) + payload


def decode_entry(blob: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of a stored entry, checked against what its reader expects (``CorruptEntry``
    otherwise). The result owns its memory."""
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"{len(blob)} bytes, shorter than an entry's header")
    magic, version, code, ndim, crc, nbytes = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != ENTRY_VERSION or code >= len(_DTYPES):
        raise CorruptEntry(f"not an entry of this version (magic {magic!r}, version {version}, dtype code {code})")
    dims_end = _HEADER.size + ndim * _DIM.size  # the header's own bytes are not in the checksum: check its sizes
    if ndim != len(shape) or len(blob) < dims_end:
        raise CorruptEntry(f"{ndim} dimensions in {len(blob)} bytes, expected {len(shape)}")
    found_shape = tuple(_DIM.unpack_from(blob, _HEADER.size + i * _DIM.size)[0] for i in range(ndim))
    if _DTYPES[code] != dtype or found_shape != tuple(shape):
        raise CorruptEntry(f"{_DTYPES[code]} {found_shape}, expected {dtype} {tuple(shape)}")
    payload = memoryview(blob)[dims_end:]
    if len(payload) != nbytes or nbytes != dtype.itemsize * _numel(shape):
        raise CorruptEntry(f"{len(payload)} payload bytes, the header says {nbytes}, the shape needs "
                           f"{dtype.itemsize * _numel(shape)}")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("payload checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class MemoryBackend:
    """A store in this process's memory: the shared cache's logic without a store service (unit
    tests, and ``epd.LLM`` which has one encoder anyway). ``fail``: make every call raise."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}
        self.calls: Counter[str] = Counter()
        self.fail = False

    def _check(self, what: str) -> None:
        self.calls[what] += 1
        if self.fail:
            raise ConnectionError("store down")

    def get(self, key: str) -> bytes | None:
        self._check("get")
        return self.entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._check("put")
        self.entries[key] = value  # insert or replace, as the Mooncake backend does

    def put_first(self, key: str, value: bytes) -> bytes | None:
        self._check("put_first")
        return self.entries.setdefault(key, value)

    def remove(self, key: str) -> None:
        self._check("remove")
        self.entries.pop(key, None)

    def close(self) -> None:
        pass
