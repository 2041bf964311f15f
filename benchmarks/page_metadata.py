"""A decode step's page metadata with and without the CSR page list (``kv_indices``), which only
FlashInfer (and tensor-parallel ranks) read: ``build_page_metadata`` at a full decode batch over a
context, both forms alternated in this process. Printed: ms per step of each and the ratio.

    python benchmarks/page_metadata.py [--batch 256] [--contexts 300,3000,4000] [--steps 2000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epd.engine.attention.metadata import build_page_metadata  # noqa: E402

BLOCK = 16


def ms_per_step(tables: np.ndarray, starts: np.ndarray, rows: np.ndarray, page_list: bool, steps: int) -> float:
    ones = np.ones(len(starts), dtype=np.int64)
    build_page_metadata(tables, starts, ones, BLOCK, rows, page_list=page_list)
    began = time.perf_counter()
    for _ in range(steps):
        build_page_metadata(tables, starts, ones, BLOCK, rows, page_list=page_list)
    return 1000 * (time.perf_counter() - began) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", default="300,3000,4000")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'context':>8}{'with list ms':>14}{'without ms':>12}{'ratio':>8}")
    for context in (int(c) for c in args.contexts.split(",")):
        pages = -(-(context + 1) // BLOCK)
        tables = rng.integers(0, 1 << 20, (args.batch + 16, pages + 8)).astype(np.int32)  # rows, as the mirror's
        starts = np.full(args.batch, context, dtype=np.int64)
        rows = rng.permutation(args.batch + 16)[:args.batch]
        with_list, without = [], []
        for _ in range(args.rounds):  # alternated: the host's drift hits both
            with_list.append(ms_per_step(tables, starts, rows, True, args.steps))
            without.append(ms_per_step(tables, starts, rows, False, args.steps))
        a, b = min(with_list), min(without)
        print(f"{context:>8}{a:>14.4f}{b:>12.4f}{b / a:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
