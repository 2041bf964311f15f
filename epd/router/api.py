"""What the front ends (HTTP, public gRPC) need from the router: ``RequestPipeline`` is the one
implementation; tests give the front ends a scripted one."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from epd.types import ChatRequest, StreamEvent


class RouterCore(Protocol):
    model_name: str  # the first served name: what a response carries when its request named none
    served_model_names: tuple[str, ...]  # what a request's ``model`` may be (/v1/models lists them)
    request_timeout_s: float  # the deadline of a request that sets none

    def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        """Stream a request's events. Raises ``epd.errors.EPDError`` before the first event for what
        admission refuses (400 never fits, 429 saturated with ``retry_after_s``, 503 no healthy
        workers) and during the stream for failures (502/504). Closing the iterator early (client
        gone) cancels the request on every tier."""

    async def prompt_of(self, request: ChatRequest, *, add_generation_prompt: bool = True):
        """The ``ProcessedPrompt`` ``request`` would run with (for /tokenize): its token ids count
        what generation counts (images expanded to their rows)."""

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids (for /detokenize); ids outside the vocabulary are a 400."""

    def health(self) -> dict:
        """{"status": "ok" | "degraded", "model": ..., "workers": {tier: [{"address", "healthy", ...}]}}"""

    def metrics_text(self) -> bytes:
        """Prometheus exposition of the router's own metrics plus the cluster view."""
