"""Errors of the encoder tier (plain Python: the scheduler and cache raise them too)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from epd.errors import InvalidRequest, UpstreamError


class _PerRequest:
    """An error that fails several requests, each of which may be told only its own part of it
    (``messages``: request id -> what concerns that request; others get the whole message)."""

    def __init__(self, message: str, *, request_ids: Iterable[str], messages: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.request_ids: frozenset[str] = frozenset(request_ids)
        self.messages = dict(messages or {})

    def for_request(self, request_id: str):
        """The error as ``request_id`` should hear it."""
        if request_id not in self.messages:
            return self
        return type(self)(self.messages[request_id], request_ids=(request_id,))


class MultimodalEncoderRequestError(_PerRequest, UpstreamError):
    """An encoder failure that belongs to specific requests, named in ``request_ids``.

    The encoder keeps serving everyone else: only these requests are failed.
    """


class MultimodalEncoderInputError(_PerRequest, InvalidRequest):
    """Items whose media can never be encoded (they do not decode): every request using them fails
    with a bad-request error naming the item; the rest of their batch is encoded as usual."""


class MultimodalEncoderAdmissionError(InvalidRequest):
    """A request that can never be encoded under the configured budgets; rejected on arrival."""


class EncoderCacheFullError(UpstreamError):
    """Room for an output could not be made: every resident entry is pinned by a consumer."""
