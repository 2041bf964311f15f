"""What the engine loop spends each step handing the step's tokens to their watchers: B running
sequences, each watched by one request of the decode tier's stream sink (as a decode worker's
router stream has them), one new token each per step; the loop publishes every watched sequence
and flushes the sink (its delivery to the event loop is a no-op here). The engine and the event
loop are left out: this is the part between them, per step, in this process.

Each checkout runs in a process of its own (``--baseline DIR``: another checkout, run alternately);
printed: ms per step, best of 3 repeats of S steps, per round, then the median per checkout and
its ratio to the first.

    python benchmarks/publish_step.py [--batch 256] [--steps 3000] [--rounds 3] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _measure(batch: int, steps: int) -> float:
    """In a checkout's own process (``ROOT`` first on the path): ms per step, best of 3."""
    import epd.engine.engine_loop as engine_loop
    from epd.decode.step_stream import StepSink
    from epd.engine.sequence import Sequence
    from epd.types import SamplingParams

    class _Loop:  # the sink's event loop: nothing is delivered, only handed over
        def call_soon_threadsafe(self, fn, arg) -> None:
            pass

    sink = StepSink(_Loop(), lambda items: None)
    loop = engine_loop.EngineLoop(engine=type("Engine", (), {"step": None})())
    seqs = [Sequence(list(range(100)), SamplingParams(max_tokens=10**7)) for _ in range(batch)]
    watcher = getattr(engine_loop, "_Watcher", None)  # older checkouts kept (seq, updates, sent) tuples
    for seq in seqs:
        updates = sink.updates_for(seq.request_id)
        loop._watchers[seq.seq_id] = watcher(seq, updates, 0) if watcher else (seq, updates, 0)

    def step() -> None:
        for seq in seqs:
            seq.token_ids.append(7)
        if watcher:
            for w in list(loop._watchers.values()):
                loop._publish_to(w)
        else:
            for seq, _, _ in list(loop._watchers.values()):
                loop._publish(seq)
        loop._flush_batches()

    best = float("inf")
    for _ in range(3):
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - start)
        for seq in seqs:  # the next repeat slices as short a list as this one did
            del seq.token_ids[100:]
        for w in loop._watchers.values():
            if watcher:
                w.sent = 0
        if not watcher:
            loop._watchers.update({s.seq_id: (s, u, 0) for s, u, _ in loop._watchers.values()})
    return 1000 * best / steps


def _run(checkout: Path, batch: int, steps: int) -> float:
    code = (f"import sys; sys.path.insert(0, {str(checkout)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import publish_step; print(publish_step._measure({batch}, {steps}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=checkout)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", action="append", default=[], help="another checkout (repeatable)")
    args = parser.parse_args()
    checkouts = [ROOT, *(Path(b).resolve() for b in args.baseline)]
    results: dict[Path, list[float]] = {c: [] for c in checkouts}
    for n in range(args.rounds):
        for checkout in checkouts:
            ms = _run(checkout, args.batch, args.steps)
            results[checkout].append(ms)
            print(f"round {n + 1}: {checkout}: {ms:.4f} ms per step at {args.batch} sequences", flush=True)
    first = statistics.median(results[checkouts[0]])
    for checkout in checkouts:
        median = statistics.median(results[checkout])
        print(f"{checkout}: median {median:.4f} ms per step ({median / first:.2f}x this checkout's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
