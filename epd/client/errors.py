"""What a failed call raises in the SDK: the project's own error classes (``epd.errors``), chosen by
the gRPC status through the one table there."""
from __future__ import annotations

import grpc

from epd.errors import (
    RETRY_AFTER_KEY,
    DeadlineExceeded,
    EPDError,
    InternalError,
    InvalidRequest,
    Overloaded,
    Unauthenticated,
    Unavailable,
    UpstreamError,
    from_grpc,
)
from epd.wire.rpc import retry_after_s

__all__ = ["DeadlineExceeded", "EPDError", "InternalError", "InvalidRequest", "Overloaded", "RETRY_AFTER_KEY",
           "Unauthenticated", "Unavailable", "UpstreamError", "error_from_rpc"]


def error_from_rpc(err: grpc.RpcError, address: str) -> EPDError:
    """The typed error for a failed call (sync or grpc.aio)."""
    code, message = err.code(), err.details() or f"call to {address} failed"
    hint_s = retry_after_s(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and hint_s is None:
        # the router always says when to retry; without it, gRPC itself refused the message (too large)
        return InvalidRequest(message)
    return from_grpc(code, message, retry_after_s=hint_s)
