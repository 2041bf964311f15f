"""Test helpers for the router's front ends: a scripted ``RouterCore`` and a uvicorn server in a
background thread on 127.0.0.1 that is always stopped."""
from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn

from epd.errors import UpstreamError
from epd.types import ChatRequest, StreamEvent, TokenLogprobs

PROMPT_TOKEN_IDS = [11, 12, 13, 14]
FIRST_TOKEN_ID = 100


def make_events(pieces: list[str], *, finish_reason: str | None = "stop", num_cached_tokens: int = 0,
                with_logprobs: bool = False) -> list[StreamEvent]:
    """One token per text piece (ids 100, 101, ...); the first event carries the prompt. Logprobs:
    the chosen token at -0.5 and two alternatives (ids 7, 8) at -1.5 and -2.5, unsorted."""
    events = []
    for i, piece in enumerate(pieces):
        token_id = FIRST_TOKEN_ID + i
        logprobs = [TokenLogprobs(token_id, -0.5, {8: -2.5, token_id: -0.5, 7: -1.5})] if with_logprobs else []
        events.append(StreamEvent(token_ids=[token_id], text=piece, logprobs=logprobs,
                                  prompt_token_ids=list(PROMPT_TOKEN_IDS) if i == 0 else None,
                                  num_cached_tokens=num_cached_tokens if i == 0 else 0))
    if events:
        events[-1].finish_reason = finish_reason
    return events


class FakeTokenizer:
    def decode(self, token_ids: list[int], **_) -> str:
        return "".join(f"<t{t}é>" for t in token_ids)  # non-ASCII: bytes must be UTF-8


class FakeRouterCore:
    """Plays scripted events. ``hang_after=k``: after k events, wait until cancelled.
    ``fail_after=k``: after k events, raise a 502. ``admission_error``: raised before any event.
    Records every request, and (thread-safely) every stream closed before it ended."""

    def __init__(self, events: list[StreamEvent] | Callable[[ChatRequest], list[StreamEvent]] | None = None, *,
                 model_name: str = "fake-qwen2-vl", admission_error: Exception | None = None,
                 hang_after: int | None = None, fail_after: int | None = None, delay_s: float = 0.0,
                 health_status: str = "ok") -> None:
        self.model_name, self.served_model_names = model_name, (model_name,)
        self.request_timeout_s = 300.0
        self._events = events if events is not None else make_events(["Hello", ",", " world", "!"])
        self.admission_error, self.hang_after, self.fail_after = admission_error, hang_after, fail_after
        self.delay_s, self.health_status = delay_s, health_status
        self.requests: list[ChatRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self._cancelled_event = threading.Event()

    async def generate(self, request: ChatRequest):
        self.requests.append(request)
        if self.admission_error is not None:
            raise self.admission_error
        events = self._events(request) if callable(self._events) else self._events
        try:
            for i, event in enumerate(events):
                if i == self.hang_after:
                    await asyncio.Event().wait()
                if i == self.fail_after:
                    raise UpstreamError("decode worker 127.0.0.1:1 failed")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield event
            self.completed.append(request.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            self._cancelled_event.set()
            raise

    def wait_cancelled(self, timeout_s: float = 5.0) -> bool:
        return self._cancelled_event.wait(timeout_s)

    def health(self) -> dict:
        return {"status": self.health_status, "workers": {"encoder": [{"address": "127.0.0.1:1", "healthy": True}]}}

    def metrics_text(self) -> bytes:
        return b"# HELP epd_router_requests_total Requests.\n# TYPE epd_router_requests_total counter\n" \
               b"epd_router_requests_total 3.0\n"


@contextlib.contextmanager
def serve_app(app, *, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free 127.0.0.1 port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on 127.0.0.1:{port} within {start_timeout_s} s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive(), "uvicorn test server did not stop within 10 s"


@contextlib.contextmanager
def serve_files(routes: dict[str, Callable[[http.server.BaseHTTPRequestHandler], None]]) -> Iterator[str]:
    """A tiny threading HTTP server on 127.0.0.1; ``routes`` maps a path to a handler that writes
    the whole response. Yields the base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self.send_error(404)
            else:
                route(self)

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address) -> None:  # a client that hung up on purpose
            pass

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def send_bytes(data: bytes, *, content_type: str = "image/png", status: int = 200,
               declare_length: bool = True) -> Callable:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        if declare_length:
            handler.send_header("Content-Length", str(len(data)))
        else:
            handler.send_header("Connection", "close")  # the body ends when the connection does
        handler.end_headers()
        handler.wfile.write(data)
    return route


def redirect_to(location: str, status: int = 302) -> Callable:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return route


def slow(delay_s: float, then: Callable) -> Callable:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(delay_s)
        then(handler)
    return route
