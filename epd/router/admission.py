"""Admission by budget: a request that can never fit is refused at once with the
limit it breaks (400); one that fits but finds the cluster saturated waits in a bounded queue
with a deadline, then gets 429 with Retry-After."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from epd.config import RouterConfig
from epd.errors import InvalidRequest, Overloaded
from epd.types import SamplingParams

_DEFAULT_OUTPUT_ROWS = 4096  # the encoder's default output budget: 16384 encoder tokens / merge 2x2


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_items_per_request: int
    encoder_output_budget_bytes: int
    bytes_per_embedding_row: int
    encoder_max_item_tokens: int | None = None
    per_modality: Mapping[str, int] = dataclasses.field(default_factory=dict)  # limit_mm_per_prompt

    @classmethod
    def from_config(cls, cfg: RouterConfig, bytes_per_embedding_row: int) -> "RequestLimits":
        budget = cfg.encoder_output_budget_bytes or _DEFAULT_OUTPUT_ROWS * bytes_per_embedding_row
        return cls(cfg.max_model_len, cfg.max_items_per_request, budget, bytes_per_embedding_row,
                   cfg.encoder_max_item_tokens, dict(cfg.limit_mm_per_prompt))

    def check_num_items(self, counts: Mapping[str, int]) -> None:
        """``counts``: media items by modality."""
        for modality, count in counts.items():
            limit = self.per_modality.get(modality)
            if limit is not None and count > limit:
                raise InvalidRequest(f"request has {count} {modality}(s); the limit is {limit} per request "
                                     f"(limit_mm_per_prompt {modality}={limit})", param="messages")
        num_items = sum(counts.values())
        if num_items > self.max_items_per_request:
            raise InvalidRequest(f"request has {num_items} media items (images and videos); the limit is "
                                 f"{self.max_items_per_request} per request (max_items_per_request)", param="messages")

    def check_item_tokens(self, items: list[tuple[str, int]]) -> None:
        """``items``: (modality, encoder tokens) of each item, in order."""
        limit = self.encoder_max_item_tokens
        for index, (modality, tokens) in enumerate(items):
            if limit is not None and tokens > limit:
                smaller = "a shorter or smaller video (or a lower fps)" if modality == "video" else "a smaller image"
                raise InvalidRequest(f"{modality} {index} needs {tokens} encoder tokens; the limit per item is "
                                     f"{limit} (encoder_max_item_tokens); send {smaller}", param="messages")

    def fill_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """A request without max_tokens may use what the model length leaves after its prompt
        (vLLM's default)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequest(f"the prompt ({num_prompt_tokens} tokens, images included) leaves no room for output "
                                 f"in the model length {self.max_model_len} (max_model_len)", param="messages")
        if params.min_tokens > room:
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) is more than the {room} tokens the model length "
                                 f"{self.max_model_len} leaves after the prompt", param="min_tokens")
        return dataclasses.replace(params, max_tokens=room)

    def check_prompt(self, num_prompt_tokens: int, num_embedding_rows: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(f"prompt ({num_prompt_tokens} tokens, images included) + max_tokens "
                                 f"({params.max_tokens}) = {total} exceeds the model length {self.max_model_len}",
                                 param="max_tokens")
        embedding_bytes = num_embedding_rows * self.bytes_per_embedding_row
        if embedding_bytes > self.encoder_output_budget_bytes:
            raise InvalidRequest(f"the images and videos need {num_embedding_rows} embedding rows ({embedding_bytes} "
                                 f"bytes); the encoder output budget is {self.encoder_output_budget_bytes} bytes "
                                 f"({self.encoder_output_budget_bytes // self.bytes_per_embedding_row} rows); "
                                 f"send fewer or smaller items", param="messages")


class AdmissionGate:
    """At most ``max_concurrent`` requests on the tiers; up to ``max_queued`` more wait (FIFO) for
    at most ``queue_timeout_s``."""

    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float) -> None:
        self._slots = asyncio.Semaphore(max_concurrent)
        self.max_queued, self.queue_timeout_s = max_queued, queue_timeout_s
        self.num_queued = 0
        self.num_active = 0

    @contextlib.asynccontextmanager
    async def slot(self):
        if self._slots.locked():
            await self._queue_for_slot()
        else:  # a free slot is taken at once, without suspending: requests arriving together are
            await self._slots.acquire()  # counted one by one, never all as "a slot is free"
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1
            self._slots.release()

    async def _queue_for_slot(self) -> None:
        if self.num_queued >= self.max_queued:
            raise Overloaded(f"server saturated: {self.num_active} requests running and "
                             f"{self.num_queued} queued (max_queued_requests={self.max_queued})",
                             retry_after_s=self.queue_timeout_s)
        self.num_queued += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise Overloaded(f"server saturated: no slot freed within {self.queue_timeout_s:.0f} s of "
                             f"queueing ({self.num_active} running)", retry_after_s=self.queue_timeout_s) from None
        finally:
            self.num_queued -= 1
