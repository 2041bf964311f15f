"""The router's internal request/response types: what the HTTP and gRPC front ends translate
to and from. The front ends never see proto types of the tiers, the tiers never see these."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from epd.engine.sampling_params import SamplingParams
from epd.engine.sequence import TokenLogprobs


@dataclass
class ChatRequest:
    """One chat completion. ``messages`` are OpenAI-style: content is a string or a list of parts
    ``{"type": "text", "text": ...}`` / ``{"type": "image_url", "image_url": {"url": ...}}`` /
    ``{"type": "image", "image": bytes | PIL.Image | path}``."""

    messages: list[dict]
    sampling: SamplingParams
    request_id: str
    stop_strings: list[str] = field(default_factory=list)  # applied to the detokenized text by the front end
    timeout_s: float | None = None  # per-request deadline; None: the router's default


@dataclass
class StreamEvent:
    """New tokens of one request. The first event also carries the prompt."""

    token_ids: list[int]
    text: str  # the detokenized text of exactly these tokens (incremental, UTF-8 safe)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    prompt_token_ids: list[int] | None = None  # first event only
    num_cached_tokens: int = 0  # first event only: prompt tokens served from the prefix cache


class RouterError(Exception):
    """A request the router refuses or could not finish, with the HTTP status it maps to."""

    def __init__(self, status: int, message: str, *, error_type: str = "invalid_request_error",
                 param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type
        self.param, self.retry_after_s = param, retry_after_s


class RouterCore(Protocol):
    """What the front ends (HTTP, public gRPC) need from the router."""

    model_name: str  # what /v1/models lists and responses echo

    def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        """Stream a request's tokens. Raises RouterError before the first event for admission
        failures (400 never fits, 429 saturated with retry_after_s, 503 no healthy workers) and
        during the stream for failures (502/504). Closing the iterator early (client gone)
        cancels the request on every tier."""

    def health(self) -> dict:
        """{"status": "ok" | "degraded", "workers": {tier: [{"address", "healthy", ...}]}}"""

    def metrics_text(self) -> bytes:
        """Prometheus exposition of the router's own metrics plus the cluster view."""
