"""Tensor handoff cost: shm handle vs a plain memcpy vs inline gRPC, measured in one run.

    python benchmarks/transfer.py [--max-mib 256] [--skip-inline]

Each timed handoff is what a consumer waits for: export + import (map the segment) + a first full
read of the tensor (``.sum()``). ``zero-copy`` is what the encoder does: its rows are made in the
store's shared memory (``TensorStore.shared_empty``), so the export is a lease and copies nothing;
``shm`` exports an ordinary tensor, which costs the producer one copy into a segment. Releasing the
lease is not timed: it is a small RPC off the data path. ``memcpy`` is ``dst.copy_(src)`` into a preallocated
tensor, the floor for moving the bytes once. ``shm cold`` disables the segment pool and the
consumer's mapping cache, so every handoff creates, faults in and unlinks a fresh segment.
``inline`` streams the bytes through a real TensorStore gRPC server on 127.0.0.1 in this process.

The last line is the headline: ``zero-copy shm/memcpy bandwidth ratio at 64 MiB: <ratio>``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from epd.transport import TensorStore, close_all, import_tensor, serve_tensor_store  # noqa: E402
from epd.transport.shm import clear_mapping_cache  # noqa: E402

KiB, MiB = 1024, 1024 * 1024


def interleaved_medians_s(methods: dict[str, tuple[Callable[[], None], Callable[[], None], int]]) -> dict[str, float]:
    """Median seconds of each method's step. Rounds alternate the methods, so a noisy neighbour on a
    shared machine slows all of them alike and the ratios stay meaningful. ``after`` (untimed)
    releases what a step holds."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for step, after, _ in methods.values():  # warm-up: first-touch page faults, pool fill, channel connect
        step()
        after()
    for round_index in range(max(reps for _, _, reps in methods.values())):
        for name, (step, after, reps) in methods.items():
            if round_index < reps:
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
                after()
    return {name: statistics.median(samples) for name, samples in times.items()}


def handoff(store: TensorStore, src: torch.Tensor, transport: str, held: list,
            channel_factory: Callable | None = None) -> Callable[[], None]:
    def step() -> None:
        imported = import_tensor(store.export(src, transport=transport, ttl_s=60), channel_factory=channel_factory)
        imported.tensor.sum()  # the first full read of what the consumer got
        held.append(imported)
    return step


def release_all(held: list, cold: bool = False) -> Callable[[], None]:
    def after() -> None:
        while held:
            imported = held.pop()
            imported.release()
            if cold:  # so the next cold handoff maps (and faults) afresh
                clear_mapping_cache(imported.handle.shm.segment_name)
    return after


def reps_for(nbytes: int) -> int:
    return 40 if nbytes <= MiB else 10 if nbytes <= 16 * MiB else 7


def fmt(seconds: float | None, nbytes: int) -> str:
    if seconds is None:
        return f"{'-':>9} {'-':>7}"
    return f"{seconds * 1e3:9.3f} {nbytes / seconds / 1e9:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-mib", type=int, default=256, help="largest tensor, MiB (sizes go up by 4x from 64 KiB)")
    parser.add_argument("--skip-inline", action="store_true", help="leave out the gRPC column")
    args = parser.parse_args()
    sizes = [64 * KiB * 4 ** i for i in range(12) if 64 * KiB * 4 ** i <= args.max_mib * MiB]

    warm = TensorStore(shm_pool_bytes=2048 * MiB)  # pool big enough to keep a 256 MiB segment
    cold = TensorStore(shm_pool_bytes=0)
    servers = [serve_tensor_store(warm), serve_tensor_store(cold)]  # releases go over gRPC
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; float32 tensors; times are medians")
    header = (f"{'size':>9} | {'memcpy ms':>9} {'GB/s':>7} | {'0-copy ms':>9} {'GB/s':>7} | {'shm ms':>9} {'GB/s':>7} "
              f"| {'cold ms':>9} {'GB/s':>7} | {'inline ms':>9} {'GB/s':>7} | {'0-copy/memcpy':>13} {'shm/memcpy':>10} "
              f"{'inline/memcpy':>13}")
    print(header)
    print("-" * len(header))
    ratio_64_mib = None
    try:
        for nbytes in sizes:
            src = torch.rand(nbytes // 4)
            dst = torch.empty_like(src)
            made = warm.shared_empty(tuple(src.shape), src.dtype)  # rows the producer wrote in shared memory
            made.copy_(src)
            reps = reps_for(nbytes)
            held: list = []
            methods = {
                "memcpy": (lambda: dst.copy_(src), lambda: None, reps),
                "zero-copy": (handoff(warm, made, "shm", held), release_all(held), reps),
                "shm": (handoff(warm, src, "shm", held), release_all(held), reps),
                "cold": (handoff(cold, src, "shm", held), release_all(held, cold=True), max(3, reps // 4)),
            }
            if not args.skip_inline:
                methods["inline"] = (handoff(warm, src, "inline", held), release_all(held), max(3, reps // 4))
            medians_s = interleaved_medians_s(methods)
            memcpy_s, zero_s, shm_s, cold_s, inline_s = (
                medians_s.get(name) for name in ("memcpy", "zero-copy", "shm", "cold", "inline"))
            inline_ratio = f"{memcpy_s / inline_s:13.3f}" if inline_s else f"{'-':>13}"
            print(f"{_size(nbytes):>9} | {fmt(memcpy_s, nbytes)} | {fmt(zero_s, nbytes)} | {fmt(shm_s, nbytes)} "
                  f"| {fmt(cold_s, nbytes)} | {fmt(inline_s, nbytes)} | {memcpy_s / zero_s:13.3f} "
                  f"{memcpy_s / shm_s:10.3f} {inline_ratio}")
            del made
            if nbytes == 64 * MiB:
                ratio_64_mib = memcpy_s / zero_s
    finally:
        for server in servers:
            server.stop(0)
        warm.close()
        cold.close()
        close_all()
    if ratio_64_mib is not None:
        print(f"zero-copy shm/memcpy bandwidth ratio at 64 MiB: {ratio_64_mib:.3f}")


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


if __name__ == "__main__":
    main()
