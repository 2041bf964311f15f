"""Router CPU per streamed token: one long streamed request through a real cluster (tier processes,
the router process, HTTP), the router process's own CPU time (utime + stime from /proc) divided by
the tokens it streamed. The router detokenizes, applies stop strings and writes SSE for every
token, on its event loop; this says what that costs.

For comparison, the same run times the method the router used before (decode the whole output
again for every new token) on the same token ids in this process.

    python benchmarks/router_cpu.py [--model tiny-qwen2-vl] [--tokens 4000]

Only loopback; every process started is stopped. Runs against any checkout whose ``epd.launch``
has ``LocalCluster.start_router`` (set PYTHONPATH to the checkout to measure another one).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import httpx
from common import BENCH_DIR  # noqa: F401  (also puts the checkout on sys.path)

from epd.launch import LocalCluster  # noqa: E402
from epd.models.presets import resolve_model  # noqa: E402
from epd.models.tokenizer_loading import load_tokenizer  # noqa: E402

_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S  # utime, stime


def stream_tokens(url: str, max_tokens: int) -> list[int]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a very long story."}],
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


def redecode_s_per_token(tokenizer, token_ids: list[int]) -> float:
    """What decoding the whole output again for every new token costs per token (the old method)."""
    start = time.process_time()
    for n in range(1, len(token_ids) + 1):
        tokenizer.decode(token_ids[:n], skip_special_tokens=True)
    return (time.process_time() - start) / len(token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    with LocalCluster(str(model_dir)) as cluster:
        router = cluster.start_router()
        url = router.ready_fields[0]
        stream_tokens(url, 8)  # warm up every process
        before = process_cpu_s(router.proc.pid)
        start = time.perf_counter()
        token_ids = stream_tokens(url, args.tokens)
        wall_s = time.perf_counter() - start
        router_cpu_s = process_cpu_s(router.proc.pid) - before
    per_token_ms = 1e3 * router_cpu_s / len(token_ids)
    redecode_ms = 1e3 * redecode_s_per_token(load_tokenizer(model_dir), token_ids)
    print(f"model={args.model} tokens streamed={len(token_ids)} in {wall_s:.1f} s (one HTTP stream, 1E1P1D)")
    print("| measure | ms per token |")
    print("|---|---|")
    print(f"| router process CPU (utime + stime) | {per_token_ms:.4f} |")
    print(f"| re-decoding the whole output per token (the old method, this process) | {redecode_ms:.4f} |")
    print(f"router CPU per token: {per_token_ms:.4f} ms (target <= 0.05); "
          f"re-decode / router = {redecode_ms / per_token_ms:.1f}x")


if __name__ == "__main__":
    main()
