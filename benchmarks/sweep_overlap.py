"""Encode/prefill overlap on vs off: a 1E1P1D cluster whose prefill computes the text before an
image while the encoder works (the default), against one that waits for every embedding row first
(``epd prefill --no-overlap``). Text of 0 .. N tokens ahead of one 448x448 image, one request at a
time, TTFT p50 from ``epd bench`` (OpenAI API, ``--text-first``).

    python benchmarks/sweep_overlap.py [--model small-qwen2-vl] [--text-lens 0,512,1024,1536] [--num-prompts 8]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import run_bench

from epd.server.local import LocalCluster  # noqa: E402


def ttft_p50(url: str, out: Path, text_len: int, args: argparse.Namespace) -> float:
    order = ["--text-first"] if text_len else []
    runs = run_bench(url, out, "--num-prompts", str(args.num_prompts), "--request-rate", "inf",
                     "--max-concurrency", "1", "--image-size", "448x448", "--input-len", str(max(text_len, 8)),
                     "--output-len", "4", "--seed", str(text_len), "--warmup-requests", "2", *order)
    return runs[0]["client"]["ttft_ms"]["p50"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--text-lens", default="0,512,1024,1536")
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    lens = [int(n) for n in args.text_lens.split(",")]
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, tier_args in (("overlap", {}), ("no overlap", {"prefill": ["--no-overlap"]})):
            with LocalCluster(args.model, tier_args=tier_args) as cluster:
                url = cluster.start_router().ready_fields[0]
                results[mode] = {n: ttft_p50(url, Path(tmp) / f"{mode}-{n}".replace(" ", "_"), n, args)
                                 for n in lens}
    print(f"model={args.model}, one 448x448 image after ~N text tokens, one request at a time, "
          f"{args.num_prompts} requests per point")
    print("| text before the image | TTFT p50 overlap ms | TTFT p50 no overlap ms | overlap / no overlap |")
    print("|---|---|---|---|")
    for n in lens:
        on, off = results["overlap"][n], results["no overlap"][n]
        print(f"| ~{n} tokens | {on:.0f} | {off:.0f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
