"""The contract between the router's pipeline and a backend: one ``Job`` in, ``BackendOutput``s
out. The pipeline has done admission, media, preprocessing and limits; the backend runs the
model and owns where the request is; the pipeline detokenizes and applies stop strings."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from epd.models.spec import ProcessedPrompt
from epd.types import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: ProcessedPrompt
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    deadline_s: float  # on the time.monotonic() clock
    # tokens the request already streamed when it moved off a lost worker: this attempt resumes
    # after them (prefilled like the prompt, counted as output)
    output_token_ids: tuple[int, ...] = ()

    def remaining_s(self) -> float:
        return max(0.0, self.deadline_s - time.monotonic())


@dataclass
class BackendOutput:
    """New tokens of a job; the last one has ``finish_reason``."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # first output only: prompt tokens served from the prefix cache


class Backend(Protocol):
    embedding_row_bytes: int  # bytes of one embedding row as the encoders produce it (admission)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def run(self, job: Job) -> AsyncIterator[BackendOutput]:
        """Stream the job's tokens. Closing the iterator before the last output cancels the job
        wherever it is. Raises ``epd.errors.EPDError`` naming the tier and cause on failure."""

    def health(self) -> dict:
        """{"status": "ok" | "degraded", ...} plus what the backend can say of its workers."""

    def refresh_metrics(self, metrics) -> None:
        """Write the backend's own view (workers, queues) into the router's metrics."""
