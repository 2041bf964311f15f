"""Blocking access to the router's real pipeline, for scripts, tests and benchmarks that want
``chat(...)`` without a server: the same admission, preprocessing, routing policies, backend and
detokenizer as ``epd router``, on an event loop thread of its own.

    with SyncRouter.over_workers(model_dir, encoders=[...], prefills=[...], decodes=[...]) as router:
        out = router.chat(messages, SamplingParams(max_tokens=32))
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from epd import loops
from epd.config import RouterConfig
from epd.router.pipeline import RequestPipeline
from epd.types import ChatRequest, RequestOutput, SamplingParams, StreamEvent

_CALL_TIMEOUT_S = 600.0  # no call into the loop waits longer than this (a request's own deadline is shorter)


class SyncRouter:
    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-router", daemon=True)
        self._thread.start()
        try:
            self.run(pipeline.start())
        except BaseException:
            # a half-started backend (health tasks, channels) and this loop's thread would outlive us
            with contextlib.suppress(Exception):
                self.close()
            raise

    @classmethod
    def over_workers(cls, model_dir: str | Path, *, encoders: list[str], prefills: list[str], decodes: list[str],
                     **config) -> SyncRouter:
        """The disaggregated backend over running workers; ``config``: more ``RouterConfig`` fields."""
        from epd.router.backends.disaggregated import DisaggregatedBackend

        model_dir = Path(model_dir)
        router_config = RouterConfig(model=str(model_dir), encoders=encoders, prefills=prefills, decodes=decodes,
                                     **config)
        return cls(RequestPipeline(model_dir, router_config,
                                   DisaggregatedBackend(router_config, model_dir)))

    def chat(self, messages: list[dict], params: SamplingParams, request_id: str | None = None, *,
             stop: list[str] | None = None, timeout_s: float | None = None) -> RequestOutput:
        events = list(self.stream(messages, params, request_id, stop=stop, timeout_s=timeout_s))
        head = events[0]
        return RequestOutput(request_id=request_id or "", prompt_token_ids=head.prompt_token_ids or [],
                             token_ids=[t for e in events for t in e.token_ids], text="".join(e.text for e in events),
                             finish_reason=events[-1].finish_reason, logprobs=[lp for e in events for lp in e.logprobs],
                             num_cached_tokens=head.num_cached_tokens)

    def stream(self, messages: list[dict], params: SamplingParams, request_id: str | None = None, *,
               stop: list[str] | None = None, timeout_s: float | None = None) -> Iterator[StreamEvent]:
        """Events as the pipeline yields them; stopping early cancels the request everywhere."""
        request = ChatRequest(messages=messages, sampling=params, request_id=request_id or uuid.uuid4().hex,
                              stop_strings=list(stop or []), timeout_s=timeout_s)
        events = self.pipeline.generate(request)
        try:
            while True:
                try:
                    yield self.run(events.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(events.aclose())

    def health(self) -> dict:
        return self.pipeline.health()

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self.run(self.pipeline.close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> SyncRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, coro):
        """Run a coroutine on the router's loop (the pipeline lives there) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CALL_TIMEOUT_S)
