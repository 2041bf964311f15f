"""One error hierarchy for every layer. Each error carries a code; this module alone maps a code to
an HTTP status, an OpenAI error type and a gRPC status, and a gRPC status back to an error, so
servicers, the HTTP app and the SDK never keep their own tables or read error text.

Raise the class that says what the caller can do: ``InvalidRequest`` (change the request),
``Overloaded`` (retry after ``retry_after_s``), ``Unavailable`` (no worker can take it now),
``DeadlineExceeded``, ``UpstreamError`` (a tier failed the request), ``InternalError`` (a bug).
"""
from __future__ import annotations

import enum
from typing import ClassVar

RETRY_AFTER_KEY = "retry-after"  # gRPC trailing metadata with an Overloaded error: seconds, as a decimal


# how an encoder names an item that does not decode: "image (content hash <hex>): <cause>"; the
# router, which knows where each hash sits in its request, turns it into messages[i].content[j]
UNDECODABLE_MARKER = "image (content hash"
# how prefill names an item whose pushed tensor it could not import: "import failed for item <i>: ...";
# the router, which knows which encoder it sent item i to, steers the request's next attempt away
IMPORT_FAILED_MARKER = "import failed for item"

class ErrorCode(enum.Enum):
    # value: (HTTP status, gRPC status name, OpenAI error type)
    INVALID_ARGUMENT = (400, "INVALID_ARGUMENT", "invalid_request_error")
    UNAUTHENTICATED = (401, "UNAUTHENTICATED", "authentication_error")
    PAYLOAD_TOO_LARGE = (413, "INVALID_ARGUMENT", "invalid_request_error")  # on gRPC: a bad request
    NOT_FOUND = (404, "NOT_FOUND", "not_found_error")
    RESOURCE_EXHAUSTED = (429, "RESOURCE_EXHAUSTED", "rate_limit_error")
    CANCELLED = (499, "CANCELLED", "cancelled")
    INTERNAL = (500, "INTERNAL", "server_error")
    UPSTREAM = (502, "INTERNAL", "server_error")  # a tier failed: on the public gRPC API, like INTERNAL
    UNAVAILABLE = (503, "UNAVAILABLE", "service_unavailable")
    DEADLINE_EXCEEDED = (504, "DEADLINE_EXCEEDED", "timeout")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def openai_type(self) -> str:
        return self.value[2]

    def grpc_status(self):
        import grpc  # lazily: the engine and the data layer raise these errors without gRPC loaded
        return grpc.StatusCode[self.value[1]]


class EPDError(Exception):
    """Base of every error EPD raises on purpose. ``param`` names the request field at fault;
    ``retry_after_s`` tells an overloaded caller when to come back."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.retry_after_s = message, param, retry_after_s

    @property
    def http_status(self) -> int:
        return self.code.http_status

    def grpc_status(self):
        return self.code.grpc_status()


class InvalidRequest(EPDError, ValueError):
    """The request can never be served as sent (bad message, media, sampling value, limit): fix it."""

    code = ErrorCode.INVALID_ARGUMENT


class PayloadTooLarge(InvalidRequest):
    """The request body is larger than the server reads (HTTP 413)."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class Unauthenticated(EPDError, PermissionError):
    """No valid API key came with the request (never says which keys exist, nor echoes the one sent)."""

    code = ErrorCode.UNAUTHENTICATED


class NotFound(EPDError, LookupError):
    code = ErrorCode.NOT_FOUND


class Overloaded(EPDError):
    """The service is saturated; retry after ``retry_after_s`` seconds."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class Cancelled(EPDError):
    code = ErrorCode.CANCELLED


class InternalError(EPDError):
    code = ErrorCode.INTERNAL


class UpstreamError(EPDError):
    """A worker failed the request (its message says which tier, which worker and why)."""

    code = ErrorCode.UPSTREAM


class Unavailable(EPDError, ConnectionError):
    """Nothing can take the request now: no healthy worker, or the server is unreachable."""

    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(EPDError, TimeoutError):
    code = ErrorCode.DEADLINE_EXCEEDED


_BY_CODE: dict[ErrorCode, type[EPDError]] = {cls.code: cls for cls in (
    InvalidRequest, Unauthenticated, NotFound, Overloaded, Cancelled, InternalError, UpstreamError, Unavailable,
    DeadlineExceeded)}


def error_class(code: ErrorCode) -> type[EPDError]:
    return _BY_CODE[code]


def code_for_grpc(status) -> ErrorCode:
    """The code a gRPC status stands for; statuses we never send (UNKNOWN, ...) read as INTERNAL."""
    for code in ErrorCode:
        if code is not ErrorCode.UPSTREAM and code.value[1] == status.name:
            return code
    return ErrorCode.INTERNAL


def from_grpc(status, details: str, *, retry_after_s: float | None = None) -> EPDError:
    """The error a failed call with this status stands for."""
    return error_class(code_for_grpc(status))(details, retry_after_s=retry_after_s)


def as_epd_error(err: BaseException) -> EPDError:
    """``err`` itself when it is ours; anything else is a bug, reported as an internal error."""
    return err if isinstance(err, EPDError) else InternalError(f"internal error: {type(err).__name__}: {err}")
