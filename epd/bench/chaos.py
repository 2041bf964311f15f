"""Chaos under load: streaming clients that loop over a fixed set of chats against a running server,
every answer checked token for token against the same chat's fault-free answer, taken first; and
what it takes to kill a worker of an ``epd serve`` tree and watch it come back. Used by the chaos
tests and by ``benchmarks/chaos.py``.

The chats cover what a move between workers could break: images interleaved with text, one image
twice, an image in an earlier turn, text only, greedy and seeded sampling, logprobs, a stop string
and usage counts. EOS is ignored so every answer has a known length.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import httpx

from epd.bench.local_server import banner_processes
from epd.bench.metrics import metric_by_label, parse_prometheus
from epd.bench.workload import ImageSpec, data_url, render_image


@dataclass(frozen=True)
class Chat:
    name: str
    body: dict  # the request body without model and stream

    def with_stop(self, stop: str) -> "Chat":
        return Chat(f"{self.name}+stop", {**self.body, "stop": [stop]})


def chats(max_tokens: int = 48, seed: int = 0) -> list[Chat]:
    """The chats the clients cycle through (each a function of ``seed``)."""
    img = [{"type": "image_url", "image_url": {
        "url": data_url(render_image(ImageSpec(64 + 16 * i, 48, seed * 100 + i, "noise")))}} for i in range(4)]

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
              "stream_options": {"include_usage": True}}
    seeded = {**greedy, "temperature": 0.9, "top_p": 0.95, "seed": 1234 + seed}
    return [
        Chat("one-image", {**greedy, "messages": [{"role": "user", "content": [img[0], text("What is it?")]}]}),
        Chat("interleaved", {**greedy, "logprobs": True, "top_logprobs": 2, "messages": [{"role": "user", "content": [
            text("Compare"), img[1], text("with"), img[2], text("please.")]}]}),
        Chat("same-image-twice", {**seeded, "messages": [{"role": "user", "content": [
            img[3], text("and again"), img[3], text("same?")]}]}),
        Chat("earlier-turn", {**greedy, "messages": [
            {"role": "user", "content": [img[0], text("Remember this.")]},
            {"role": "assistant", "content": "I will."},
            {"role": "user", "content": [text("Now this one:"), img[2]]}]}),
        Chat("text-only", {**seeded, "logprobs": True, "messages": [{"role": "user", "content": "Tell a story."}]}),
    ]


@dataclass
class Outcome:
    chat: str
    start_s: float  # on the run's clock (time.monotonic() - t0)
    end_s: float = 0.0
    ttft_s: float | None = None
    status: int | str = "pending"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    num_logprobs: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None


def stream_chat(http: httpx.Client, base_url: str, model: str, chat: Chat, t0: float) -> Outcome:
    """One streaming chat completion; every failure becomes the outcome's ``error``."""
    out = Outcome(chat.name, time.monotonic() - t0)
    body = {**chat.body, "model": model, "stream": True}
    try:
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = response.read().decode(errors="replace")[:300]
                return out
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take_chunk(out, json.loads(line[6:]), t0)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out.error = repr(err)
    finally:
        out.end_s = time.monotonic() - t0
    if out.error is None and out.finish_reason is None:
        out.error = "the stream ended without a finish_reason"
    return out


def _take_chunk(out: Outcome, chunk: dict, t0: float) -> None:
    if chunk.get("error"):
        out.error = json.dumps(chunk["error"])[:300]
    if chunk.get("usage"):
        out.completion_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        if ids and out.ttft_s is None:
            out.ttft_s = time.monotonic() - t0 - out.start_s
        out.token_ids += ids
        out.text += choice.get("delta", {}).get("content") or ""
        out.num_logprobs += len((choice.get("logprobs") or {}).get("content") or [])
        out.finish_reason = choice.get("finish_reason") or out.finish_reason


def references(base_url: str, model: str, chat_list: list[Chat], timeout_s: float = 120.0) -> dict[str, Outcome]:
    """Each chat once, one at a time, before any fault: what every later answer must equal. A chat
    whose answer can hold a stop string gets a ``+stop`` twin, cut inside its answer."""
    refs: dict[str, Outcome] = {}
    with httpx.Client(timeout=timeout_s) as http:
        for chat in chat_list:
            refs[chat.name] = ref = stream_chat(http, base_url, model, chat, time.monotonic())
            if not ref.ok:
                raise RuntimeError(f"reference for {chat.name} failed: {ref.status} {ref.error}")
    return refs


def stop_twin(chat: Chat, ref: Outcome) -> Chat | None:
    """``chat`` with a stop string taken from its reference text at about two thirds of the way,
    or None when the text has no usable piece (the stop must cut the answer, not miss it)."""
    start = len(ref.text) * 2 // 3
    piece = ref.text[start:start + 4]
    if len(piece.strip()) < 3 or ref.text.find(piece) != start:
        return None
    return chat.with_stop(piece)


def mismatches(outcomes: list[Outcome], refs: dict[str, Outcome]) -> list[str]:
    """Every successful answer that differs from its reference: tokens, text, finish reason, usage
    (the completion tokens streamed) and one logprobs entry per token when they were asked for."""
    problems = []
    for o in outcomes:
        if not o.ok:
            continue
        ref = refs[o.chat]
        why = []
        if o.token_ids != ref.token_ids:
            first = next((i for i, (a, b) in enumerate(zip(o.token_ids, ref.token_ids)) if a != b),
                         min(len(o.token_ids), len(ref.token_ids)))
            why.append(f"tokens differ from index {first} ({len(o.token_ids)} vs {len(ref.token_ids)})")
        if o.text != ref.text:
            why.append("text differs")
        if o.finish_reason != ref.finish_reason:
            why.append(f"finish {o.finish_reason} vs {ref.finish_reason}")
        if o.completion_tokens != ref.completion_tokens:
            why.append(f"usage {o.completion_tokens} vs {ref.completion_tokens}")
        if o.num_logprobs != ref.num_logprobs:
            why.append(f"{o.num_logprobs} logprobs vs {ref.num_logprobs}")
        if why:
            problems.append(f"{o.chat} at {o.start_s:.1f} s: " + "; ".join(why))
    return problems


class LoopingClients:
    """``num_clients`` threads, each streaming the chats in turn until stopped; every outcome kept."""

    def __init__(self, base_url: str, model: str, chat_list: list[Chat], num_clients: int,
                 timeout_s: float = 120.0) -> None:
        self.base_url, self.model, self.chats, self.timeout_s = base_url, model, chat_list, timeout_s
        self.t0, self.stop = time.monotonic(), threading.Event()
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_clients)]

    def __enter__(self) -> "LoopingClients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 10)

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    def _loop(self, client: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as http:
            for n in range(1_000_000):
                if self.stop.is_set():
                    return
                outcome = stream_chat(http, self.base_url, self.model, self.chats[(client + n) % len(self.chats)],
                                      self.t0)
                with self._lock:
                    self.outcomes.append(outcome)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    @property
    def num_ok(self) -> int:
        return sum(o.ok for o in self.snapshot())

    def failures(self) -> list[Outcome]:
        return [o for o in self.snapshot() if not o.ok]


def window_stats(outcomes: list[Outcome], start_s: float, end_s: float) -> dict:
    """Requests that started in [start_s, end_s): count, failures, p50/p99 TTFT (ms)."""
    inside = [o for o in outcomes if start_s <= o.start_s < end_s]
    ttfts = sorted(o.ttft_s * 1000 for o in inside if o.ttft_s is not None)
    return {"requests": len(inside), "failed": sum(not o.ok for o in inside),
            "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], 1) if ttfts else None}


# ---- the epd serve tree -------------------------------------------------------------------------
def worker_pids(lines: list[str]) -> dict[str, list[tuple[str, int]]]:
    """From ``epd serve``'s ready banner: tier (and "router") -> [(address, pid)]."""
    pids: dict[str, list[tuple[str, int]]] = {}
    for p in banner_processes(lines):
        pids.setdefault(p.tier, []).append((p.address, p.pid))
    return pids


def restarted_pid(lines: list[str], tier: str, address: str, after: int = 0) -> int | None:
    """The pid of the newest restart of ``tier`` ``address`` reported in ``lines[after:]``."""
    found = None
    for line in lines[after:]:
        if m := re.search(rf"{tier} {re.escape(address)} restarted \(pid (\d+)\)", line):
            found = int(m.group(1))
    return found


def segments_of(pid: int) -> list[str]:
    """Shared-memory segments a process made (their names start with its pid)."""
    try:
        return [name for name in os.listdir("/dev/shm") if name.startswith(f"epd_{pid}_")]
    except FileNotFoundError:
        return []


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503 while degraded: the body still says who is down
        return json.loads(err.read())


def in_rotation(base_url: str, tier: str, address: str) -> bool:
    workers = get_json(f"{base_url}/health").get("workers", {}).get(tier, [])
    return any(w["address"] == address and w["healthy"] for w in workers)


def moves(base_url: str) -> dict[str, float]:
    """The router's ``epd_request_moves_total`` by stage."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return metric_by_label(parse_prometheus(text), "epd_request_moves_total", "stage")
