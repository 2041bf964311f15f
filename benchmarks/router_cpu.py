"""Router CPU per streamed token, three ways, for one long stream (4,000 tokens by default):

1. the router's pipeline alone (admission, detokenization, stop strings, events), in this process,
   over a backend that yields the tokens back to back: the router's own per-token work;
2. the same behind the real OpenAI HTTP app (uvicorn, SSE), a client in another process: what the
   router process spends per token when tokens arrive faster than it can send them;
3. a real cluster (tier processes + the router process): the router process's CPU (utime + stime
   from /proc) per token of one HTTP stream, tokens arriving one decode step apart.

For comparison the run also times the method the router used before (decode the whole output
again for every new token) on the same token ids, in this process.

    python benchmarks/router_cpu.py [--model tiny-qwen2-vl] [--tokens 4000] [--only-cluster]

(3) runs against any checkout whose ``LocalCluster`` has ``start_router`` (``epd.server.local``, or
``epd.launch`` before it moved): set PYTHONPATH to the checkout, with ``--only-cluster``, to measure
another one. Only loopback;
every process started is stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx
from common import BENCH_DIR  # noqa: F401  (also puts the checkout on sys.path)

try:
    from epd.server.local import LocalCluster  # noqa: E402
except ImportError:  # a checkout from before epd/server/ (measuring the old router)
    from epd.launch import LocalCluster  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.models.tokenizer_loading import load_tokenizer  # noqa: E402
from epd.server.parent import cpu_seconds  # noqa: E402

_STORY = "Once upon a time, in a land far away, there lived a curious fox named Ada. "
_CLIENT = """
import httpx, json, sys
body = {"model": "bench", "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": int(sys.argv[2]), "temperature": 0, "ignore_eos": True, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/chat/completions", json=body, timeout=600) as response:
    print(sum(line.startswith("data: {") for line in response.iter_lines()))
"""


# ---- 1 and 2: the pipeline in this process ----------------------------------------------------------
def story_tokens(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(_STORY * (n // 10 + 1), add_special_tokens=False)
    return ids[:n]


def make_pipeline(model_dir, token_ids: list[int]):
    from epd.config import RouterConfig
    from epd.router.backends.base import BackendOutput
    from epd.router.pipeline import RequestPipeline

    class BackToBack:
        embedding_row_bytes = 4

        async def start(self) -> None: ...

        async def close(self) -> None: ...

        def health(self) -> dict:
            return {"status": "ok"}

        def refresh_metrics(self, metrics) -> None: ...

        async def run(self, job):
            for i, token_id in enumerate(token_ids):
                yield BackendOutput([token_id], finish_reason="length" if i == len(token_ids) - 1 else None)

    return RequestPipeline(model_dir, RouterConfig(model="bench", max_model_len=len(token_ids) + 64), BackToBack())


def pipeline_ms_per_token(model_dir, token_ids: list[int]) -> float:
    from epd.types import ChatRequest, SamplingParams

    pipeline = make_pipeline(model_dir, token_ids)
    request = ChatRequest([{"role": "user", "content": "Write a long story."}],
                          SamplingParams(max_tokens=len(token_ids)), "bench", stop_strings=["\n\n\n"])

    async def consume() -> int:
        return sum([len(e.token_ids) async for e in pipeline.generate(request)])

    asyncio.run(consume())  # warm up
    start = time.process_time()
    num_tokens = asyncio.run(consume())
    return 1e3 * (time.process_time() - start) / num_tokens


def http_ms_per_token(model_dir, token_ids: list[int]) -> float:
    import socket
    import threading

    import uvicorn

    from epd.router.openai.app import build_app

    pipeline = make_pipeline(model_dir, token_ids)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(pipeline, tokenizer=pipeline.tokenizer), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        subprocess.run([sys.executable, "-c", _CLIENT, url, "16"], check=True, capture_output=True, timeout=120)
        start = time.process_time()
        subprocess.run([sys.executable, "-c", _CLIENT, url, str(len(token_ids))], check=True, capture_output=True,
                       timeout=600)
        return 1e3 * (time.process_time() - start) / len(token_ids)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# ---- 3: a real cluster -----------------------------------------------------------------------------
def stream_tokens(url: str, model: str, max_tokens: int) -> list[int]:
    body = {"model": model, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    token_ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    token_ids += choice.get("token_ids") or []
    return token_ids


def cluster_ms_per_token(model_dir, num_tokens: int) -> tuple[float, list[int], float]:
    with LocalCluster(str(model_dir)) as cluster:
        router = cluster.start_router()
        url = router.ready_fields[0]
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]  # the name it serves
        stream_tokens(url, model, 8)  # warm up every process
        before = cpu_seconds([router.proc.pid])
        start = time.perf_counter()
        token_ids = stream_tokens(url, model, num_tokens)
        wall_s = time.perf_counter() - start
        router_cpu_s = cpu_seconds([router.proc.pid]) - before
    return 1e3 * router_cpu_s / len(token_ids), token_ids, wall_s


def redecode_ms_per_token(tokenizer, token_ids: list[int]) -> float:
    """Decoding the whole output again for every new token (the router's old method)."""
    start = time.process_time()
    for n in range(1, len(token_ids) + 1):
        tokenizer.decode(token_ids[:n], skip_special_tokens=True)
    return 1e3 * (time.process_time() - start) / len(token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--only-cluster", action="store_true", help="skip 1 and 2 (for checkouts without the pipeline)")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    rows = []
    if not args.only_cluster:
        story = story_tokens(tokenizer, args.tokens)
        rows += [("1. pipeline alone, tokens back to back (this process)", pipeline_ms_per_token(model_dir, story)),
                 ("2. pipeline + HTTP/SSE front end, back to back (this process)", http_ms_per_token(model_dir, story))]
    cluster_ms, token_ids, wall_s = cluster_ms_per_token(model_dir, args.tokens)
    rows.append((f"3. router process of a 1E1P1D cluster, one stream ({wall_s:.0f} s)", cluster_ms))
    baseline = redecode_ms_per_token(tokenizer, token_ids)
    print(f"model={args.model} tokens per stream={len(token_ids)}")
    print("| router CPU per streamed token | ms | re-decode baseline / this |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} | {baseline / ms:.1f}x |")
    print(f"| the old method's detokenization alone: re-decode the output per token | {baseline:.4f} | 1.0x |")


if __name__ == "__main__":
    main()
