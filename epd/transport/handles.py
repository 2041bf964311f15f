"""What every transport shares: dtype names on the wire, the error types, and the checks a
consumer runs on a handle's header before touching any body.

A ``TensorHandle`` (proto/epd/v1/tensor.proto) names its dtype as a string ("bfloat16"), never a
pickled torch object: the wire is protobuf only.
"""
from __future__ import annotations

import math
import time

import torch

from epd.errors import ErrorCode, UpstreamError
from epd.v1 import tensor_pb2

# Names as torch prints them without the "torch." prefix, so a handle reads like the tensor.
# Only dtypes with a fixed byte width and a plain memory layout travel (no quantized types).
_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
        *(getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
          if hasattr(torch, name)),
    )
}


class TransportError(UpstreamError):
    """A tensor could not be exported, moved or imported; the message says which and why."""


class LeaseExpiredError(TransportError):
    """The producer no longer holds the tensor: its lease expired or was released.

    Ask the producer again (re-run the step that made the handle); retrying the same handle can't work.
    """

    code = ErrorCode.NOT_FOUND  # on the wire: the consumer turns NOT_FOUND back into this error


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES_BY_NAME.get(name) is not dtype:
        raise TransportError(f"dtype {dtype} can't travel in a tensor handle; supported: {sorted(_DTYPES_BY_NAME)}")
    return name


def dtype_from_str(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name.removeprefix("torch.")]
    except KeyError:
        raise TransportError(f"unknown dtype {name!r} in tensor handle; expected one of {sorted(_DTYPES_BY_NAME)}") from None


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def now_unix_ms(clock=time.time) -> int:
    return int(clock() * 1000)


def lease_gone_message(lease_id: str, reason: str, ago_s: float | None) -> str:
    """One wording for every "the producer let go of it" error, so logs grep the same.

    ``reason`` is "expired" or "released"; the message always contains "expired" so callers and
    tests can recognise it whichever way the lease ended.
    """
    when = f" {ago_s:.3f} s ago" if ago_s is not None else ""
    if reason == "released":
        return f"lease {lease_id} was released{when} (a released lease counts as expired); ask the producer again"
    return f"lease {lease_id} expired{when}; ask the producer again"


def check_not_expired(handle: tensor_pb2.TensorHandle, clock=time.time) -> None:
    """``expires_unix_ms == 0`` means the handle carries its bytes and can't expire."""
    if handle.expires_unix_ms and now_unix_ms(clock) >= handle.expires_unix_ms:
        ago_s = (now_unix_ms(clock) - handle.expires_unix_ms) / 1000
        raise LeaseExpiredError(lease_gone_message(handle.lease_id, "expired", ago_s))


def check_header(handle: tensor_pb2.TensorHandle) -> tuple[torch.dtype, tuple[int, ...]]:
    """Validate dtype, shape and nbytes against each other; return (dtype, shape)."""
    dtype = dtype_from_str(handle.dtype)
    shape = tuple(int(d) for d in handle.shape)
    if any(d < 0 for d in shape):
        raise TransportError(f"lease {handle.lease_id}: negative dimension in shape {list(shape)}")
    expected_bytes = tensor_nbytes(dtype, shape)
    if handle.nbytes != expected_bytes:
        raise TransportError(
            f"lease {handle.lease_id}: handle says nbytes={handle.nbytes} but {handle.dtype}{list(shape)} "
            f"needs {expected_bytes} bytes")
    if handle.WhichOneof("body") is None:
        raise TransportError(f"lease {handle.lease_id}: handle has no body (expected one of inline/shm/cuda_ipc/nccl/store)")
    return dtype, shape


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (the tensor must be contiguous and on CPU)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    # via uint8: numpy has no bfloat16/float8
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
