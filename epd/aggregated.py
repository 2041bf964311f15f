"""The aggregated (not disaggregated) server: the whole model in one process, behind the router's
own OpenAI and gRPC front ends. It is the baseline the EPD tiers are measured against
(``benchmarks/sweep_serving.py``), and a fair choice on one small machine.

Like an aggregated vLLM engine, images are encoded on the engine thread between steps, so a long
encode stalls the decode of every running request: the interference EPD removes. Admission,
preprocessing, detokenization and metrics are the router's.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

from epd.config import EngineConfig, RouterConfig
from epd.engine.engine_loop import EngineLoop, TokenUpdate
from epd.engine.sequence import Sequence
from epd.router.admission import AdmissionGate, RequestLimits
from epd.router.core import count_images, preprocess_chat
from epd.router.detok import IncrementalDetokenizer
from epd.router.metrics import RouterMetrics
from epd.router.types import ChatRequest, RouterError, StreamEvent

class AggregatedCore:
    """A ``RouterCore`` over one in-process ``epd.LLM`` (vision tower + engine)."""

    def __init__(self, model_dir: str | Path, config: RouterConfig, engine_config: EngineConfig | None = None) -> None:
        from epd.llm import LLM

        self.config = config
        self.model_name = config.model
        built: dict[str, LLM] = {}

        def build():  # on the loop thread: one thread runs every torch op (see epd.engine.engine_loop)
            built["llm"] = LLM(str(model_dir), engine_config=engine_config, allowed_local_media_path=None)
            return built["llm"].engine

        self.loop = EngineLoop(build, name="aggregated-loop").start()
        self.llm = built["llm"]
        self.tokenizer = self.llm.tokenizer
        row_bytes = self.llm.mm_spec.embedding_dim * self.llm.engine_config.torch_dtype.itemsize
        self.limits = RequestLimits.from_config(config, row_bytes)
        self.gate = AdmissionGate(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        self.metrics = RouterMetrics()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.loop.stop()

    # ---- RouterCore ---------------------------------------------------------------------------
    def health(self) -> dict:
        sched = self.llm.engine.scheduler  # lengths only: a snapshot is enough for a health answer
        return {"status": "ok", "model": self.model_name, "mode": "aggregated", "workers": {},
                "num_running": len(sched.running), "num_waiting": len(sched.waiting)}

    def metrics_text(self) -> bytes:
        self.metrics.queue_depth.set(self.gate.num_queued)
        self.metrics.in_flight.set(self.gate.num_active)
        return self.metrics.render()

    async def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        self.limits.check_num_items(count_images(request.messages))
        async with self.gate.slot():
            async for event in self._run(request):
                yield event

    # ---- the request path ---------------------------------------------------------------------
    async def _run(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        start = time.monotonic()
        prompt = await asyncio.to_thread(preprocess_chat, self.llm.processor, request)
        self.limits.check_item_tokens([item.geometry.num_patches for item in prompt.items])
        self.limits.check_prompt(len(prompt.prompt_token_ids), sum(i.num_rows for i in prompt.items),
                                 request.sampling)
        updates: asyncio.Queue[TokenUpdate] = asyncio.Queue()
        bridge = _ThreadSafePut(asyncio.get_running_loop(), updates)
        # the encode happens there, on the engine thread
        added = self.loop.watch(lambda engine: self.llm.add_processed(prompt, request.sampling, request.request_id),
                                bridge)
        try:
            seq = await asyncio.wrap_future(added)
        except ValueError as err:
            raise RouterError(400, str(err), param="messages") from None
        except asyncio.CancelledError:  # the client left while its images were encoding
            added.add_done_callback(self._abort_when_added)
            raise
        timeout_s = request.timeout_s or self.config.request_timeout_s
        detok = IncrementalDetokenizer(self.tokenizer)
        first_at, num_tokens, finished = None, 0, False
        try:
            while not finished:
                update = await self._next(updates, start + timeout_s, seq)
                finished = update.is_last
                text = detok.add(update.token_ids) + (detok.flush() if finished else "")
                is_first = first_at is None
                if is_first:
                    first_at = time.monotonic()
                    self.metrics.observe_first_token(first_at - start, len(prompt.prompt_token_ids),
                                                     seq.num_cached_tokens)
                num_tokens += len(update.token_ids)
                yield StreamEvent(update.token_ids, text, update.logprobs, update.finish_reason,
                                  prompt.prompt_token_ids if is_first else None, seq.num_cached_tokens)
        finally:
            if not finished:
                self.loop.abort(seq, reason="cancelled")
        self.metrics.observe_done(start, first_at, num_tokens)

    def _abort_when_added(self, added) -> None:
        if not added.cancelled() and added.exception() is None and added.result() is not None:
            self.loop.abort(added.result(), reason="cancelled")

    @staticmethod
    async def _next(updates: asyncio.Queue, deadline: float, seq: Sequence) -> TokenUpdate:
        try:
            update = await asyncio.wait_for(updates.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RouterError(504, f"request {seq.request_id} timed out", error_type="timeout") from None
        if update.error:
            raise RouterError(502, f"request failed: {update.error}", error_type="server_error")
        return update


class _ThreadSafePut:
    """``put`` from the engine thread into an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: asyncio.Queue) -> None:
        self.loop, self.target = loop, target

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.target.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
