"""A KV hand-off into a tensor-parallel decode engine: each rank reading its heads from the handle's
shared memory itself, against rank 0 scattering them over the process group, on this machine (gloo
on 127.0.0.1). Both in one run, alternated; wall ms per import of a KV of T tokens.

    python benchmarks/tp_kv_import.py [--tp 2] [--tokens 4096,32768] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", default="4096,32768")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.transport import TensorStore, import_tensor, serve_tensor_store

    sizes = [int(t) for t in args.tokens.split(",")]
    block = 16
    config = EngineConfig(tensor_parallel_size=args.tp, block_size=block, num_kv_blocks=max(sizes) // block + 1)
    store = TensorStore()
    server = serve_tensor_store(store)
    print(f"{'tokens':>8}{'MB':>8}{'in place ms':>14}{'scatter ms':>12}{'ratio':>8}", flush=True)
    try:
        with LLM(args.model, engine_config=config) as llm:
            runner = llm.engine.runner
            cfg = runner.model.config
            for tokens in sizes:
                kv = torch.randn(cfg.num_hidden_layers, 2, tokens, runner.num_kv_heads_total,
                                 runner.kv_cache.k[0].shape[2])
                imported = import_tensor(store.export(kv, transport="shm", ttl_s=300))
                table = list(range(tokens // block))
                times = {"in place": [], "scatter": []}
                for _ in range(args.repeats):
                    for name, source in (("in place", imported.handle), ("scatter", None)):
                        start = time.perf_counter()
                        runner.write_kv(table, imported.tensor, source)
                        times[name].append(1000 * (time.perf_counter() - start))
                imported.release()
                shared, scatter = statistics.median(times["in place"]), statistics.median(times["scatter"])
                print(f"{tokens:>8}{kv.nbytes / 1e6:>8.1f}{shared:>14.2f}{scatter:>12.2f}{shared / scatter:>8.2f}",
                      flush=True)
            print(f"imports read in place by the ranks: {runner.ranks.num_kv_writes_shared}")
    finally:
        server.stop(0)
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
