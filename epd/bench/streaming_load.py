"""Closed-loop streaming clients for a scenario whose load changes (the online planner's test and
benchmark): each client on a thread of its own sends one chat after another, streamed, until
stopped, and keeps when it sent each, its time to first token and its HTTP status. Bounded: at
most ``max_requests`` a client, every request with a timeout."""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import httpx


class StreamingLoad:
    def __init__(self, base_url: str, make_body: Callable[[int], dict], clients: int, *,
                 max_requests: int = 400, timeout_s: float = 120.0) -> None:
        """``make_body(n)``: the request body of a client's n-th request (distinct across clients)."""
        self.base_url, self.make_body = base_url, make_body
        self.max_requests, self.timeout_s = max_requests, timeout_s
        self.results: list[tuple[float, float, int]] = []  # (sent at, monotonic s; TTFT s; HTTP status)
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._runs = [self._pool.submit(self._client, i) for i in range(clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            for n in range(self.max_requests):
                if self._stop.is_set():
                    return
                body, start, first = self.make_body(index * self.max_requests + n), time.monotonic(), None
                with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as reply:
                    for line in reply.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.monotonic()
                self.results.append((start, (first or time.monotonic()) - start, reply.status_code))

    def stop(self) -> list[tuple[float, float, int]]:
        """Stop after each client's request in flight; -> every request's (sent at, TTFT, status)."""
        self._stop.set()
        for run in self._runs:
            run.result(timeout=self.timeout_s + 60)
        self._pool.shutdown()
        return self.results


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def text_chat(model: str, n: int, max_tokens: int = 48) -> dict:
    """A streamed text chat (distinct by ``n``) that runs its whole length: decode's load."""
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me a story, number {n}."}]}


def image_chat(model: str, n: int, images: int = 3, side: int = 448, max_tokens: int = 2,
               kind: str = "noise") -> dict:
    """A streamed chat with ``images`` distinct images (none seen before: no cache hit) and a short
    answer: the encoders' load. ``kind``: noise (large, incompressible files: the client and the
    router pay for them too) or gradient (small files of the same size in pixels: the encoder's
    work, little else's)."""
    from epd.bench.workload import ImageSpec, data_url, render_image

    parts = [{"type": "image_url", "image_url": {"url": data_url(render_image(ImageSpec(side, side, images * n + i,
                                                                                          kind)))}}
             for i in range(images)]
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}]}
