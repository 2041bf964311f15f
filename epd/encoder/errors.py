"""Errors of the encoder tier (plain Python: the scheduler and cache raise them too)."""
from __future__ import annotations

from collections.abc import Iterable

from epd.errors import InvalidRequest, UpstreamError


class MultimodalEncoderRequestError(UpstreamError):
    """An encoder failure that belongs to specific requests, named in ``request_ids``.

    The encoder keeps serving everyone else: only these requests are failed.
    """

    def __init__(self, message: str, *, request_ids: Iterable[str]) -> None:
        super().__init__(message)
        self.request_ids: frozenset[str] = frozenset(request_ids)


class MultimodalEncoderInputError(InvalidRequest):
    """Items whose media can never be encoded (they do not decode): every request using them fails
    with a bad-request error naming the item; the rest of their batch is encoded as usual."""

    def __init__(self, message: str, *, request_ids: Iterable[str]) -> None:
        super().__init__(message)
        self.request_ids: frozenset[str] = frozenset(request_ids)


class MultimodalEncoderAdmissionError(InvalidRequest):
    """A request that can never be encoded under the configured budgets; rejected on arrival."""


class EncoderCacheFullError(UpstreamError):
    """Room for an output could not be made: every resident entry is pinned by a consumer."""
