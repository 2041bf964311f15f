"""The in-process backend: the whole model (vision tower + engine, ``epd.LLM``) in the router's own
process, behind the same pipeline and front ends as the tiers. It is the baseline the EPD tiers
are measured against, and a fair choice on one small machine.

Like an aggregated vLLM engine, images are encoded on the engine thread between steps, so a long
encode stalls the decode of every running request: the interference EPD removes.

The router's event loop shares this process's cores with the engine thread, so the engine's
intra-op threads leave one core to it (``epd.engine.threads``): with torch's default team on 2 cores,
TTFT p50 was 499 ms instead of 35 ms.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from epd.config import EngineConfig
from epd.engine.async_updates import AsyncUpdates, UpdateBatch, queue_batch
from epd.engine.engine_loop import EngineLoop
from epd.engine.threads import ThreadPolicy
from epd.errors import EPDError, InvalidRequest, UpstreamError
from epd.router.backends.base import BackendOutput, Job

log = logging.getLogger("epd.router")
_CLOSE_RANKS_S = 120.0  # a step in flight (a long CPU prefill) finishes first
_BUSY_THREADS = 1  # the router's asyncio event loop (HTTP, gRPC, detokenizing): busy under load


class InProcessBackend:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig | None = None, *,
                 stream_interval: int = 1) -> None:
        """``stream_interval``: each request's tokens after its first come in groups of that many
        (the engine loop holds them: its event loop wakes once a group, not once a step)."""
        from epd.llm import LLM

        engine_config = engine_config or EngineConfig()
        built: dict[str, LLM] = {}

        def build():  # on the loop thread: one thread runs every torch op (see epd.engine.engine_loop)
            built["llm"] = LLM(str(model_dir), engine_config=engine_config, allowed_local_media_path=None,
                               set_threads=False)  # the loop applied the policy, counting the event loop
            return built["llm"].engine

        threads = ThreadPolicy("aggregated engine", busy_threads=_BUSY_THREADS, override=engine_config.num_threads)
        self.loop = EngineLoop(build, name="in-process-loop", threads=threads).start()
        self.llm = built["llm"]
        self.embedding_row_bytes = self.llm.mm_spec.embedding_dim * self.llm.engine_config.torch_dtype.itemsize
        self._batch: UpdateBatch | None = None  # made by start(), on the event loop that reads
        self._stream_interval = stream_interval

    async def start(self) -> None:
        self._batch = queue_batch(asyncio.get_running_loop())  # a step's updates cross in one call

    async def close(self) -> None:
        if self.llm.engine.runner.ranks is not None:  # tensor parallel: stopped between two steps, on the engine thread
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.loop.call(lambda _engine: self.llm.close())),
                                       _CLOSE_RANKS_S)
            except (asyncio.TimeoutError, RuntimeError) as err:
                log.warning("aggregated engine: its tensor-parallel ranks did not stop between steps (%s)", err)
        self.loop.stop()
        self.llm.close()  # a no-op once closed above

    def engine_max_model_len(self) -> int:
        return self.llm.engine_config.max_model_len

    def health(self) -> dict:
        sched = self.llm.engine.scheduler  # lengths only: a snapshot is enough for a health answer
        return {"status": "ok" if self.llm.healthy else "error", "mode": "aggregated", "workers": {},
                "num_running": len(sched.running), "num_waiting": len(sched.waiting)}


    def refresh_metrics(self, metrics) -> None:
        pass

    async def run(self, job: Job) -> AsyncIterator[BackendOutput]:
        updates = AsyncUpdates(self._batch, self._stream_interval)
        # the images are encoded there, on the engine thread
        added = self.loop.watch(lambda engine: self.llm.add_processed(job.prompt, job.sampling, job.request_id),
                                updates)
        try:
            seq = await asyncio.wrap_future(added)
        except EPDError:
            raise
        except ValueError as err:  # the prompt can never fit this engine's cache
            raise InvalidRequest(f"request {job.request_id}: {err}") from None
        except asyncio.CancelledError:  # the client left while its images were encoding
            added.add_done_callback(self._abort_when_added)
            raise
        is_first, is_finished = True, False
        try:
            while not is_finished:
                update = await updates.get()  # the pipeline holds the request's deadline (one timer)
                if update.error:
                    raise UpstreamError(f"request {job.request_id} failed: {update.error}")
                is_finished = update.is_last
                yield BackendOutput(update.token_ids, update.logprobs, update.finish_reason,
                                    seq.num_cached_tokens if is_first else 0)
                is_first = False
        finally:
            if not is_finished:
                self.loop.abort(seq, reason="cancelled")

    def _abort_when_added(self, added) -> None:
        if not added.cancelled() and added.exception() is None and added.result() is not None:
            self.loop.abort(added.result(), reason="cancelled")
