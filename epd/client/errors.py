"""Typed errors of the SDK, one per gRPC status a caller can act on."""
from __future__ import annotations

import grpc

RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds, as a decimal


class EPDError(Exception):
    """Any failure of a call to the router. ``code`` is the gRPC status (None: raised locally)."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.code is not None else self.message


class InvalidRequest(EPDError, ValueError):
    """The request can never be served as sent (bad message, image or sampling value): fix it."""


class Overloaded(EPDError):
    """The cluster is saturated; retry after ``retry_after_s`` seconds (None: the router said no)."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class Unavailable(EPDError, ConnectionError):
    """The router is unreachable, or has no healthy workers for the request."""


class DeadlineExceeded(EPDError, TimeoutError):
    """The request's timeout passed before it finished."""


_ERRORS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def error_from_rpc(err: grpc.RpcError, address: str) -> EPDError:
    """The typed error for a failed call (sync or grpc.aio)."""
    code = err.code()
    message = err.details() or f"call to {address} failed"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after_s = _retry_after_s(err)
        if retry_after_s is None and "larger than max" in message:
            return InvalidRequest(message, code=code)  # a message over gRPC's size limit, not load
        return Overloaded(message, code=code, retry_after_s=retry_after_s)
    return _ERRORS_BY_CODE.get(code, EPDError)(message, code=code)


def _retry_after_s(err: grpc.RpcError) -> float | None:
    for key, value in err.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return float(value)
            except ValueError:
                return None
    return None
