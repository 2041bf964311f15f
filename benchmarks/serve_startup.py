"""How long ``epd serve`` takes from its start to its banner (every worker and the router ready),
and to stop, alternating this checkout with others in one run (their code on PYTHONPATH, this
checkout's virtual environment), so the ratio is measured on the same machine at the same time.

    .venv/bin/python benchmarks/serve_startup.py                          # this checkout alone
    .venv/bin/python benchmarks/serve_startup.py --baseline /tmp/wt_base --rounds 5
    .venv/bin/python benchmarks/serve_startup.py --serve-args="--encoders 2 --prefills 2 --decodes 2"

Prints each round, then the median per checkout and the ratio to the first baseline. CPU is the
whole tree's (epd serve, the zygote, every worker and router: each reaps its children, so their
time adds up in this process's children's usage).
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANNER_END = "(Ctrl-C stops everything)"


def one_start(code_dir: Path, model: str, serve_args: list[str], timeout_s: float) -> tuple[float, float, float]:
    """-> (seconds to the banner, seconds to stop, CPU seconds of the whole run) of one
    ``epd serve`` run from ``code_dir``."""
    env = {**os.environ, "PYTHONPATH": str(code_dir)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "epd", "serve", "--model", model, "--port", "0", "--grpc-port", "0",
                             *serve_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, env=env, cwd=code_dir)
    ready_s = None
    try:
        for line in proc.stdout:
            if BANNER_END in line:
                ready_s = time.monotonic() - start
                break
            if time.monotonic() - start > timeout_s:
                break
        if ready_s is None:
            raise RuntimeError(f"epd serve from {code_dir} did not become ready in {timeout_s:.0f} s")
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        stop_s = time.monotonic() - stopping
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ready_s, stop_s, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="append", default=[], help="another checkout to compare (repeatable)")
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--serve-args", default="", help="more epd serve flags, one string (--no-standby: cold starts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240.0)
    args = parser.parse_args()
    checkouts = [ROOT, *(Path(b).resolve() for b in args.baseline)]
    serve_args = shlex.split(args.serve_args)
    one_start(ROOT, args.model, serve_args, args.timeout_s)  # the preset written, the disk cache warm
    ready: dict[Path, list[float]] = {c: [] for c in checkouts}
    stop: dict[Path, list[float]] = {c: [] for c in checkouts}
    cpu: dict[Path, list[float]] = {c: [] for c in checkouts}
    for round_index in range(args.rounds):
        for checkout in checkouts if round_index % 2 == 0 else checkouts[::-1]:  # alternated: drift hits both
            ready_s, stop_s, cpu_s = one_start(checkout, args.model, serve_args, args.timeout_s)
            ready[checkout].append(ready_s)
            stop[checkout].append(stop_s)
            cpu[checkout].append(cpu_s)
            print(f"round {round_index + 1}  {checkout}: ready {ready_s:.2f} s, stopped {stop_s:.2f} s, "
                  f"{cpu_s:.1f} s of CPU", flush=True)
    base = statistics.median(ready[checkouts[1]]) if len(checkouts) > 1 else None
    base_cpu = statistics.median(cpu[checkouts[1]]) if len(checkouts) > 1 else None
    for checkout in checkouts:
        median, median_cpu = statistics.median(ready[checkout]), statistics.median(cpu[checkout])
        ratio = f", {median / base:.2f}x the first baseline" if base else ""
        cpu_ratio = f" ({median_cpu / base_cpu:.2f}x)" if base_cpu else ""
        print(f"{checkout}: ready {median:.2f} s median (range {min(ready[checkout]):.2f}-{max(ready[checkout]):.2f})"
              f"{ratio}; stop {statistics.median(stop[checkout]):.2f} s; CPU {median_cpu:.1f} s{cpu_ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
