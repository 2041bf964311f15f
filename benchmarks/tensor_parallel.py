"""Tensor parallelism on this machine: the in-process engine at TP 1 and TP N, the same requests.

Printed per configuration: the prefill of one long prompt (ms per chunk of --prefill-tokens), the
decode step of a batch (ms per step), the weights rank 0 holds (MB), the KV hand-off of that prompt
(export as the prefill tier does it, every KV head gathered on rank 0; import as the decode tier
does it, each rank given its heads), and each against TP 1 with the same threads per rank. On a 2-core CPU, TP 2 gives each rank one core: the comparison that says
what cutting the model costs or saves is TP 2 (1 thread per rank) against TP 1 with 1 thread and
with 2.

    python benchmarks/tensor_parallel.py [--model small-qwen2-vl] [--tp 2] [--prefill-tokens 1024]
        [--batch 8] [--decode-steps 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epd.config import EngineConfig  # noqa: E402
from epd.llm import LLM  # noqa: E402
from epd.types import SamplingParams  # noqa: E402


def _weights_mb(llm: LLM) -> float:
    params = {id(p): p for p in llm.engine.runner.model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) / 1e6


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start


def measure(model: str, tp: int, threads: int, prefill_tokens: int, batch: int, steps: int) -> dict:
    config = EngineConfig(tensor_parallel_size=tp, num_threads=threads, max_num_batched_tokens=prefill_tokens,
                          max_num_seqs=batch, max_model_len=prefill_tokens + steps + 64,
                          enable_prefix_caching=False)
    with LLM(model, engine_config=config) as llm:
        long_prompt = [[1000 + i % 5000 for i in range(prefill_tokens)]]
        short = [[2000 + 7 * b + i for i in range(16)] for b in range(batch)]
        _timed(llm, short, 4)  # warm
        prefill_s = min(_timed(llm, long_prompt, 1) for _ in range(3))
        first_s = _timed(llm, short, 1)
        decode_s = (_timed(llm, short, steps + 1) - first_s) / steps
        export_s, import_s = _kv_handoff_s(llm, long_prompt[0])
        return {"tp": tp, "threads": threads, "prefill_ms": 1000 * prefill_s, "decode_ms": 1000 * decode_s,
                "weights_mb": _weights_mb(llm), "export_ms": 1000 * export_s, "import_ms": 1000 * import_s}


def _kv_handoff_s(llm: LLM, prompt: list[int], repeats: int = 5) -> tuple[float, float]:
    """The best of ``repeats``: the prompt's KV read out of the cache (every head, into one tensor)
    and written back into its pages."""
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while not seq.num_output_tokens:
        llm.engine.step()
    runner, table, n = llm.engine.runner, seq.block_table, len(prompt)
    export_s = import_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kv = runner.read_kv(table, n)
        export_s = min(export_s, time.perf_counter() - start)
        start = time.perf_counter()
        runner.write_kv(table, kv)
        import_s = min(import_s, time.perf_counter() - start)
    llm.engine.run_until_done([seq])
    return export_s, import_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-qwen2-vl")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()
    runs = [(1, 1), (1, args.tp), (args.tp, 1)]  # (tp, threads per rank)
    base = None
    print(f"{'tp':>3}{'threads/rank':>14}{'prefill ms':>12}{'decode ms/step':>16}{'rank-0 weights MB':>19}"
          f"{'KV export ms':>14}{'KV import ms':>14}{'prefill vs tp1x1':>18}{'decode vs tp1x1':>17}", flush=True)
    for tp, threads in runs:
        r = measure(args.model, tp, threads, args.prefill_tokens, args.batch, args.decode_steps)
        base = base or r
        print(f"{tp:>3}{threads:>14}{r['prefill_ms']:>12.1f}{r['decode_ms']:>16.2f}{r['weights_mb']:>19.1f}"
              f"{r['export_ms']:>14.2f}{r['import_ms']:>14.2f}"
              f"{r['prefill_ms'] / base['prefill_ms']:>18.2f}{r['decode_ms'] / base['decode_ms']:>17.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
