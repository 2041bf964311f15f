"""A scripted RouterCore and a real grpc.aio router server around it, on 127.0.0.1 in a thread.
The fake resolves media with the router's real ``MediaFetcher`` (as the pipeline does first), so
SDK tests see what the backend would get; the rest (events, errors) is scripted."""
from __future__ import annotations

import asyncio
import threading

import grpc

from epd.router.grpc_api import add_router_grpc, public_server_options
from epd.router.media_fetch import MediaFetcher
from epd.types import ChatRequest, StreamEvent, TokenLogprobs
from epd.wire.rpc import SERVER_OPTIONS as GRPC_OPTIONS


def default_events() -> list[StreamEvent]:
    return [
        StreamEvent([10], "Hel", [TokenLogprobs(10, -0.5, {10: -0.5, 99: -1.5})], prompt_token_ids=[1, 2, 3],
                    num_cached_tokens=2),
        StreamEvent([11, 12], "lo wor", [TokenLogprobs(11, -0.25, {}), TokenLogprobs(12, -0.125, {})]),
        StreamEvent([13], "ld", [TokenLogprobs(13, -1.0, {})], finish_reason="length"),
    ]


class FakeCore:
    """Plays ``events``; raises ``error`` before event number ``error_after`` (len(events): after the
    last); with ``is_hanging`` never ends after the events. Records each ChatRequest and whether its
    iterator was closed before the end (``closed``) or ran out (``finished``)."""

    model_name = "fake-vl"
    served_model_names = ("fake-vl",)

    def __init__(self, media: MediaFetcher | None = None) -> None:
        self.media = media or MediaFetcher()
        self.reset()

    def reset(self) -> None:
        self.events = default_events()
        self.error: Exception | None = None
        self.error_after = 0
        self.is_hanging = False
        self.requests: list[ChatRequest] = []
        self.closed, self.finished = threading.Event(), threading.Event()
        self.refusals: list[Exception] = []  # raised, one per request, before any other work

    def generate(self, request: ChatRequest):
        return self._play(request)

    async def _play(self, request: ChatRequest):
        if self.refusals:
            raise self.refusals.pop(0)
        request.messages = await self.media.resolve(request.messages)  # refused media: not recorded
        self.requests.append(request)
        try:
            for i, event in enumerate(self.events):
                if self.error is not None and i == self.error_after:
                    raise self.error
                yield event
            if self.error is not None:
                raise self.error
            if self.is_hanging:
                await asyncio.sleep(3600)
            self.finished.set()
        except (GeneratorExit, asyncio.CancelledError):
            self.closed.set()
            raise

    def health(self) -> dict:
        return {"status": "degraded", "workers": {
            "encoder": [{"address": "127.0.0.1:1", "healthy": True, "num_running": 3}],
            "decode": [{"address": "127.0.0.1:2", "healthy": False}]}}

    def metrics_text(self) -> bytes:
        return b""


class RouterServerThread:
    """The public Router service over ``core`` on a free 127.0.0.1 port, in a thread with its own loop."""

    def __init__(self, core, interceptors=(), limits=None, generation=None) -> None:
        """``limits``: a ``BodyLimits`` the server applies as the router does (message size included);
        ``generation``: the sampling defaults (a pipeline's ``generation``), OpenAI's when None."""
        self.core, self.interceptors, self.limits = core, list(interceptors), limits
        self.generation = generation
        self.address = ""

    def __enter__(self) -> RouterServerThread:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-grpc-test", daemon=True)
        self._thread.start()
        self.address = self._run(self._start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._run(self._server.stop(grace=None))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def _run(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _start(self) -> str:
        options = GRPC_OPTIONS if self.limits is None else public_server_options(self.limits)
        self._server = grpc.aio.server(options=options, interceptors=self.interceptors)
        add_router_grpc(self._server, self.core, **({} if self.limits is None else {"limits": self.limits}),
                        **({} if self.generation is None else {"generation": self.generation}))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return f"127.0.0.1:{port}"
