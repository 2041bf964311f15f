"""A fake EPD router for the bench tests: a scripted ``RouterCore`` with fixed delays (first token
after ``first_delay_s``, then one token every ``itl_s``) behind the real OpenAI HTTP app (uvicorn)
and the real public gRPC service, both on 127.0.0.1 in threads. It resolves images with the
router's real ``MediaFetcher`` (as the pipeline does), its ``/metrics`` counts requests, and it
"encodes" (counts) each distinct image once, as an encoder cache would."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import uvicorn

from epd.errors import Overloaded
from epd.router.grpc_api import add_router_grpc
from epd.router.media_fetch import MediaFetcher
from epd.router.openai.app import build_app
from epd.types import ChatRequest, StreamEvent


class DelayCore:
    model_name = "fake-bench-vl"
    served_model_names = ("fake-bench-vl",)

    def __init__(self, *, first_delay_s: float = 0.05, itl_s: float = 0.005, fail_every: int = 0,
                 prompt_len: int = 40) -> None:
        self.first_delay_s, self.itl_s, self.fail_every, self.prompt_len = first_delay_s, itl_s, fail_every, prompt_len
        self._lock = threading.Lock()
        self.requests: list[ChatRequest] = []
        self.images_seen: set[str] = set()
        self.num_images = 0
        self.outcomes: dict[str, int] = {}
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.active = 0
        self.cancelled = 0

    async def generate(self, request: ChatRequest):
        request.messages = await MediaFetcher().resolve(request.messages)
        with self._lock:
            self.requests.append(request)
            number = len(self.requests)
            for message in request.messages:
                for part in message.get("content") if isinstance(message.get("content"), list) else ():
                    if isinstance(part, dict) and part.get("type") == "image":
                        self.images_seen.add(hashlib.sha256(part["image"]).hexdigest())
                        self.num_images += 1
        if self.fail_every and number % self.fail_every == 0:
            with self._lock:
                self.outcomes["error_429"] = self.outcomes.get("error_429", 0) + 1
            raise Overloaded("saturated (fake)", retry_after_s=1)
        async for event in self._play(request):
            yield event

    async def _play(self, request: ChatRequest):
        n = request.sampling.max_tokens
        t0 = time.monotonic()
        with self._lock:
            self.active += 1
        try:
            await asyncio.sleep(self.first_delay_s)
            with self._lock:
                self.ttft_sum += time.monotonic() - t0
                self.ttft_count += 1
            for i in range(n):
                if i:
                    await asyncio.sleep(self.itl_s)
                last = i == n - 1
                yield StreamEvent([1000 + i], f" w{i}", finish_reason="length" if last else None,
                                  prompt_token_ids=list(range(self.prompt_len)) if i == 0 else None,
                                  num_cached_tokens=4 if i == 0 else 0)
            with self._lock:
                self.outcomes["ok"] = self.outcomes.get("ok", 0) + 1
        except (asyncio.CancelledError, GeneratorExit):
            with self._lock:
                self.cancelled += 1
            raise
        finally:
            with self._lock:
                self.active -= 1

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "workers": {}}

    def metrics_text(self) -> bytes:
        with self._lock:
            lines = ["# HELP epd_requests_total Requests finished, by outcome", "# TYPE epd_requests_total counter"]
            lines += [f'epd_requests_total{{outcome="{k}"}} {float(v)}' for k, v in sorted(self.outcomes.items())]
            lines += ["# TYPE epd_ttft_seconds histogram",
                      f"epd_ttft_seconds_sum {self.ttft_sum}", f"epd_ttft_seconds_count {float(self.ttft_count)}",
                      "# TYPE epd_router_queue_depth gauge", "epd_router_queue_depth 0.0",
                      "# TYPE epd_router_in_flight gauge", f"epd_router_in_flight {float(self.active)}",
                      "# TYPE epd_encoder_encoded_items counter",
                      'epd_encoder_encoded_items_total{tier="encoder",worker="127.0.0.1:1"} '
                      f"{float(len(self.images_seen))}",
                      "# TYPE epd_worker_queue_depth gauge",
                      'epd_worker_queue_depth{tier="encoder",worker="127.0.0.1:1"} 0.0',
                      f'epd_worker_queue_depth{{tier="decode",worker="127.0.0.1:3"}} {float(self.active)}',
                      "# TYPE epd_worker_running gauge",
                      f'epd_worker_running{{tier="decode",worker="127.0.0.1:3"}} {float(self.active)}',
                      "# TYPE epd_prompt_tokens counter",
                      f"epd_prompt_tokens_total {float(self.prompt_len * self.ttft_count)}",
                      "# TYPE epd_prompt_cached_tokens counter",
                      f"epd_prompt_cached_tokens_total {float(4 * self.ttft_count)}"]
        return ("\n".join(lines) + "\n").encode()


@contextlib.contextmanager
def serve_fake(core: DelayCore) -> Iterator[tuple[str, str]]:
    """The HTTP app (uvicorn) and the gRPC Router service over ``core`` on 127.0.0.1; yields
    (base URL, gRPC address) and stops both on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(core), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    http_thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-fake-http",
                                   daemon=True)
    loop = asyncio.new_event_loop()
    grpc_thread = threading.Thread(target=loop.run_forever, name="bench-fake-grpc", daemon=True)
    grpc_server = None

    async def start_grpc() -> str:
        nonlocal grpc_server
        grpc_server = grpc.aio.server()
        add_router_grpc(grpc_server, core)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return f"127.0.0.1:{grpc_port}"

    http_thread.start()
    grpc_thread.start()
    try:
        address = asyncio.run_coroutine_threadsafe(start_grpc(), loop).result(10)
        deadline = time.monotonic() + 10
        while not server.started:
            if not http_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake HTTP server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", address
    finally:
        server.should_exit = True
        if grpc_server is not None:
            asyncio.run_coroutine_threadsafe(grpc_server.stop(grace=None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        grpc_thread.join(10)
        http_thread.join(10)
        loop.close()
        sock.close()
        assert not http_thread.is_alive(), "the fake HTTP server did not stop"
