from __future__ import annotations

import pytest
import torch

from epd.transport import LeaseExpiredError, TransportError, dtype_from_str, dtype_to_str
from epd.transport.handles import check_header, check_not_expired
from epd.v1 import tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_dtype_names_round_trip(dtype):
    assert dtype_from_str(dtype_to_str(dtype)) is dtype
    assert dtype_from_str(str(dtype)) is dtype  # "torch.bfloat16" is accepted too


def test_unknown_dtype_names_what_is_supported():
    with pytest.raises(TransportError, match="unknown dtype 'float13'.*bfloat16"):
        dtype_from_str("float13")


def _handle(**fields) -> tensor_pb2.TensorHandle:
    handle = tensor_pb2.TensorHandle(dtype="float32", shape=[2, 3], nbytes=24, lease_id="abc", **fields)
    handle.inline.data = bytes(24)
    return handle


def test_header_mismatch_says_expected_and_got():
    handle = _handle()
    handle.nbytes = 20
    with pytest.raises(TransportError, match=r"nbytes=20 but float32\[2, 3\] needs 24 bytes"):
        check_header(handle)


def test_handle_without_body_is_rejected():
    handle = tensor_pb2.TensorHandle(dtype="float32", shape=[1], nbytes=4, lease_id="abc")
    with pytest.raises(TransportError, match="no body"):
        check_header(handle)


def test_expiry_is_checked_against_the_clock(clock):
    handle = _handle(expires_unix_ms=int(clock() * 1000) + 500)
    check_not_expired(handle, clock)
    clock.advance(2.0)
    with pytest.raises(LeaseExpiredError, match=r"lease abc expired 1\.5\d* s ago"):
        check_not_expired(handle, clock)
    check_not_expired(_handle(expires_unix_ms=0), clock)  # 0: bytes in hand, never expires
