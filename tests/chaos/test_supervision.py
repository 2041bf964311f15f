"""A worker's death under load, as a user sees it through ``epd serve``: kill -9 one of two encoders
while 8 streaming clients keep sending one-image chats. No client request fails (the router sends
the dead encoder's items to the other one), the dead worker's shared memory is reclaimed within
10 s, it is restarted on its own port and back in rotation, and after stop nothing of it is left
in /dev/shm or the process table."""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import threading
import time
import urllib.request

import httpx
import pytest

from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until

pytestmark = pytest.mark.slow
NUM_CLIENTS = 8
# a restarted worker imports torch and loads its model on 2 cores busy with 8 clients and the
# other tiers: 30-35 s measured here, of which the restart delay is 1 s
BACK_IN_ROTATION_S = 60


def _worker_pids(serve: ServeProcess) -> dict[str, list[tuple[str, int]]]:
    """From the ready banner: tier -> [(address, pid)]."""
    pids: dict[str, list[tuple[str, int]]] = {}
    for line in serve.lines:
        if m := re.match(r"\s+(encoder|prefill|decode)\s+(\S+) \(pid (\d+)\)$", line):
            pids.setdefault(m.group(1), []).append((m.group(2), int(m.group(3))))
    return pids


def _health(serve: ServeProcess) -> dict:
    try:
        with urllib.request.urlopen(f"{serve.base_url}/health", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503 while degraded: the body still says who is down
        return json.loads(err.read())


def _segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"epd_{pid}_")]


class _Clients:
    """Streaming one-image chats in a loop until stopped; every outcome recorded."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.stop = base_url, threading.Event()
        self.ok, self.failures = 0, []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]

    def __enter__(self) -> "_Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _loop(self, client: int) -> None:
        with httpx.Client(timeout=120) as http:
            for n in range(10_000):
                if self.stop.is_set():
                    return
                self._one(http, client * 10_000 + n)

    def _one(self, http: httpx.Client, seed: int) -> None:
        url = "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()
        body = {"model": "tiny-qwen2-vl", "stream": True, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is it?"}]}]}
        try:
            with http.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
                lines = list(response.iter_lines()) if response.status_code == 200 else [response.read().decode()]
            finished = response.status_code == 200 and any('"finish_reason":"length"' in line.replace(" ", "")
                                                           for line in lines)
            if finished:
                self.ok += 1
            else:
                self.failures.append(f"{response.status_code}: {lines[-3:]}")
        except httpx.HTTPError as err:
            self.failures.append(repr(err))


def test_killing_an_encoder_under_load_fails_no_request_and_it_comes_back():
    serve = ServeProcess("--model", "tiny-qwen2-vl", "--encoders", "2")
    try:
        (address, pid), _ = _worker_pids(serve)["encoder"]
        with _Clients(serve.base_url) as clients:
            assert wait_until(lambda: clients.ok >= 8, 60), clients.failures
            os.kill(pid, signal.SIGKILL)
            killed_at_s = time.monotonic()
            assert wait_until(lambda: not _segments_of(pid), 10), _segments_of(pid)
            assert wait_until(lambda: re.search(rf"encoder {re.escape(address)} restarted \(pid \d+\)",
                                                "\n".join(serve.lines)), 10)
            back = wait_until(lambda: all(w["healthy"] for w in _health(serve)["workers"]["encoder"]),
                              BACK_IN_ROTATION_S - (time.monotonic() - killed_at_s))
            assert back, _health(serve)
            served_before_end = clients.ok
            assert wait_until(lambda: clients.ok >= served_before_end + 8, 60)
        assert not clients.failures, clients.failures[:5]
        new_pid = int(re.search(rf"encoder {re.escape(address)} restarted \(pid (\d+)\)",
                                "\n".join(serve.lines)).group(1))
    finally:
        assert serve.stop() == 0, "\n".join(serve.lines[-30:])
    for p in (pid, new_pid):
        assert not _segments_of(p)
        assert not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z"
