"""The online planner end to end: ``epd serve --autoscale-budget 4`` with 1 encoder, 1 prefill and
2 decodes. Text chats keep the decodes busy and nothing moves; then the load turns to images with
short answers, requests queue at the encoder, and the planner moves a decode worker to the encoders
(the budget is spent; or, the decodes idle first, gives one back and grows the encoders with it):
``epd serve`` drains and stops a decode worker and starts and registers an encoder. No request fails, the decision is logged with its reason, TTFT p90 under the same load is
lower after the move than while the encoder queue grew, and at the end nothing of the run is left
running or in /dev/shm."""
from __future__ import annotations

import base64
import concurrent.futures
import threading
import time

import httpx
import pytest

from epd.bench.chaos import segments_of
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.procs import descendants, gone

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen2-vl"


def _image(seed: int) -> dict:
    data = make_image_bytes(448, 448, seed=seed)
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _counts(server) -> dict[str, int]:
    workers = httpx.get(f"{server.base_url}/health", timeout=10).json()["workers"]
    return {tier: sum(w["healthy"] and not w["draining"] for w in workers[tier]) for tier in workers}


class Load:
    """Clients on threads, each sending one request after another until stopped: -> (sent at,
    TTFT s, status) per request."""

    def __init__(self, server, make_body, clients: int) -> None:
        self.server, self.make_body = server, make_body
        self.results: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._runs = [self._pool.submit(self._client, i) for i in range(clients)]

    def _client(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set() and n < 400:  # bounded
                body = self.make_body(index * 1000 + n)
                start = time.monotonic()
                status, first = 0, None
                with client.stream("POST", f"{self.server.base_url}/v1/chat/completions", json=body) as reply:
                    status = reply.status_code
                    for line in reply.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.monotonic()
                self.results.append((start, (first or time.monotonic()) - start, status))
                n += 1

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        for run in self._runs:
            run.result(timeout=180)
        self._pool.shutdown()
        return self.results


def _text(n: int) -> dict:
    return {"model": MODEL, "stream": True, "max_tokens": 48, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me a story, number {n}."}]}


def _images(n: int) -> dict:
    return {"model": MODEL, "stream": True, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [_image(3 * n), _image(3 * n + 1), _image(3 * n + 2),
                                                      {"type": "text", "text": "Compare them."}]}]}


def _p90(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.9 * (len(values) - 1))]


def test_images_after_text_move_a_decode_worker_to_the_encoders_and_no_request_fails():
    server = ServeProcess(MODEL, "--encoders", "1", "--prefills", "1", "--decodes", "2", "--autoscale-budget", "4",
                          "--autoscale-cooldown-s", "5", "--no-standby")
    started = descendants(server.proc.pid)
    try:
        assert _counts(server) == {"encoder": 1, "prefill": 1, "decode": 2}
        text = Load(server, _text, clients=8)
        time.sleep(5)
        assert _counts(server) == {"encoder": 1, "prefill": 1, "decode": 2}  # decode busy, the encoder idle: no move
        done = text.stop()
        images = Load(server, _images, clients=12)
        moved = wait_until(lambda: _counts(server) == {"encoder": 2, "prefill": 1, "decode": 1}, 90, period_s=0.5)
        moved_at = time.monotonic()
        time.sleep(9)  # the same load on the new split
        done += images.stop()
        assert moved, ("no move within 90 s", _counts(server), server.lines[-30:])
        assert [status for _, _, status in done if status != 200] == []
        # a decode worker moves to the encoders; or, the decodes idle first, one goes back to the
        # budget and the hot encoders get it: the same split either way, each step with its reason
        decisions = [line for line in server.lines if "epd.router: planner:" in line]
        assert any("encoder hot for" in line and ("a decode worker moves to encoder" in line or
                                                  "one more encoder worker (budget 4 of 4)" in line)
                   for line in decisions), decisions
        assert any("autoscale: draining decode" in line for line in server.lines)
        assert any("autoscale: encoder" in line and "in rotation" in line for line in server.lines)
        overloaded = [ttft for at, ttft, _ in images.results if at < moved_at]
        after = [ttft for at, ttft, _ in images.results if at > moved_at + 3]
        assert len(after) >= 10, len(after)
        print(f"image TTFT p90: {_p90(overloaded):.2f} s while the encoder queue grew ({len(overloaded)} requests), "
              f"{_p90(after):.2f} s after the move ({len(after)})")
        assert _p90(after) < _p90(overloaded), (_p90(after), _p90(overloaded))
    finally:
        started |= descendants(server.proc.pid)
        assert server.stop() == 0, "\n".join(server.lines[-30:])
        assert wait_until(lambda: all(gone(p) for p in started), 20), [p for p in started if not gone(p)]
        assert not [name for p in started for name in segments_of(p)]
