"""A scripted ``Backend`` for the router's real pipeline: plays token ids per job, records every job
and every job closed before its end (the pipeline's cancel)."""
from __future__ import annotations

import asyncio
import threading

from epd.errors import EPDError
from epd.router.backends.base import BackendOutput, Job
from epd.types import TokenLogprobs


class ScriptedBackend:
    def __init__(self, outputs: list[list[int]], *, finish_reason: str | None = "stop", hang_after: int | None = None,
                 fail_after: int | None = None, error: EPDError | None = None, num_cached_tokens: int = 0,
                 embedding_row_bytes: int = 4 * 64) -> None:
        self.outputs, self.finish_reason = outputs, finish_reason
        self.hang_after, self.fail_after, self.error = hang_after, fail_after, error
        self.num_cached_tokens = num_cached_tokens
        self.embedding_row_bytes = embedding_row_bytes
        self.jobs: list[Job] = []
        self.cancelled: list[str] = []
        self._cancelled = threading.Event()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def run(self, job: Job):
        self.jobs.append(job)
        try:
            for i, token_ids in enumerate(self.outputs):
                if i == self.hang_after:
                    await asyncio.Event().wait()
                if i == self.fail_after:
                    raise self.error
                is_last = i == len(self.outputs) - 1
                # when asked: each token at -0.5, and the next id as its one alternative at -1.5
                logprobs = [TokenLogprobs(t, -0.5, {t: -0.5, t + 1: -1.5}) for t in token_ids] \
                    if job.sampling.logprobs is not None else []
                yield BackendOutput(token_ids, logprobs=logprobs, finish_reason=self.finish_reason if is_last else None,
                                    num_cached_tokens=self.num_cached_tokens if i == 0 else 0)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(job.request_id)
            self._cancelled.set()
            raise

    def wait_cancelled(self, timeout_s: float = 5.0) -> bool:
        return self._cancelled.wait(timeout_s)

    def health(self) -> dict:
        return {"status": "ok", "workers": {}}

    def refresh_metrics(self, metrics) -> None:
        pass
