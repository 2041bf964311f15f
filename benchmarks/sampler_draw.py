"""The sampler's draw alone: one token per row by inverse-CDF sampling, with a cumulative sum along
the whole row (the narrow-row path, and what every row used before) against the two-level draw
(``epd.engine.sampler.draw``: the block of 64 columns, then the column in it), each after its
softmax, in one run on one thread, alternated over several rounds (this machine's speed drifts
within a run). Printed: the median ms per call of each and the ratio.

    python benchmarks/sampler_draw.py [--shapes 256x2048,64x151936,256x151936] [--repeats 20] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from epd.engine.sampler import _draw_from_cdf, draw  # noqa: E402


def ms_per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x2048,64x151936,256x151936", help="ROWSxCOLUMNS, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="calls timed together")
    parser.add_argument("--rounds", type=int, default=7, help="alternations of the two")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'shape':<14}{'whole-row cumsum ms':>21}{'two-level ms':>14}{'ratio':>8}")
    for shape in args.shapes.split(","):
        rows, columns = (int(x) for x in shape.split("x"))
        logits = torch.randn(rows, columns)
        times: dict[str, list[float]] = {"whole": [], "blocks": []}
        for _ in range(args.rounds):
            times["whole"].append(ms_per_call(
                lambda: _draw_from_cdf(torch.softmax(logits, dim=-1).cumsum_(dim=-1)), args.repeats))
            times["blocks"].append(ms_per_call(lambda: draw(torch.softmax(logits, dim=-1)), args.repeats))
        whole, blocks = statistics.median(times["whole"]), statistics.median(times["blocks"])
        print(f"{shape:<14}{whole:>21.3f}{blocks:>14.3f}{blocks / whole:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
