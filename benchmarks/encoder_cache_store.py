"""The cluster's encoder cache store against per-encoder caches: 2 routers x 2 encoders, repeat ratio
0 / 0.5 / 0.9, then the last run replayed after both encoders restarted (their own caches empty).

For each setup, in one run: ``epd serve --routers 2 --encoders 2`` with per-encoder caches and hash
affinity (the baseline), the same with ``--encoder-cache-store mooncake`` (a master and a segment
server on 127.0.0.1), and with the store and ``--prefill-store-reads always`` (prefill reads every
item the store has itself; on one host ``auto`` leaves repeats to the encoders, whose pushes are
shared memory). Driven by ``epd bench`` (HTTP, streaming, one 448x448 image a request). Printed per
point: images sent, vision items encoded (the rest came from a cache or the store), items prefill
read from the store, prefill's mean ms per item to get its rows (a store read; importing an
encoder's shm push), TTFT p50 / p90. Ratio 0 is the no-cache case: every image is new, so each is
encoded once whatever the setup.

    python benchmarks/encoder_cache_store.py [--model tiny-qwen2-vl] [--num-prompts 32] [--rate 4]

Only loopback; every process started is stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import Server, run_bench  # noqa: F401  (also puts the checkout on sys.path)

from epd.bench.local_server import banner_processes  # noqa: E402

_STORE = ("--encoder-cache-store", "mooncake")
_SETUPS = {"per-encoder caches": (), "cluster store": _STORE,
           "cluster store, prefill reads": (*_STORE, "--prefill-store-reads", "always")}


def point(server: Server, ratio: float, seed: int, args: argparse.Namespace, out: Path) -> dict:
    before = _prefill_counts(server)
    (run,) = run_bench(server.url, out, "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                       "--repeat-ratio", str(ratio), "--image-size", "448x448", "--output-len", "16",
                       "--seed", str(seed))
    grew = {k: v - before[k] for k, v in _prefill_counts(server).items()}
    return {"sent": run["client"]["images_sent"], "encoded": run["server"]["encoder_encoded_items"],
            "read": grew["read"], **{f"{t}_ms": 1000 * grew[f"{t}_s"] / grew[f"{t}_n"] if grew[f"{t}_n"] else None
                                     for t in ("store", "shm")},
            "ttft_p50_ms": run["client"]["ttft_ms"]["p50"], "ttft_p90_ms": run["client"]["ttft_ms"]["p90"]}


def _prefill_counts(server: Server) -> dict[str, float]:
    """The prefill worker's own counts: items read from the store, and the time its imports took
    (store reads; shm imports of encoders' pushes)."""
    from epd.bench.metrics import metric_sum, parse_prometheus

    (url,) = [p.metrics_url for p in banner_processes(server.lines) if p.tier == "prefill"]
    parsed = parse_prometheus(urllib.request.urlopen(url, timeout=10).read().decode())

    def get(name: str, **labels: str) -> float:
        return metric_sum(parsed, name, **labels) or 0.0
    out = {"read": get("epd_prefill_store_reads_total", outcome="read")}
    for transport in ("store", "shm"):
        out[f"{transport}_s"] = get("epd_transfer_seconds_sum", transport=transport, direction="import")
        out[f"{transport}_n"] = get("epd_transfer_seconds_count", transport=transport, direction="import")
    return out


def restart_encoders(server: Server, timeout_s: float = 120.0) -> None:
    """SIGKILL each encoder; back once epd serve restarted them and the router has them healthy."""
    encoders = [(p.address, p.pid) for p in banner_processes(server.lines) if p.tier == "encoder"]
    seen = len(server.lines)
    for _, pid in encoders:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for address, _ in encoders:
        while not any(f"encoder {address} restarted" in line for line in server.lines[seen:]):
            if time.monotonic() > deadline:
                raise RuntimeError("encoders not restarted:\n" + "\n".join(server.lines[-20:]))
            time.sleep(0.2)
    while not _all_healthy(server.url):
        if time.monotonic() > deadline:
            raise RuntimeError("encoders not back in rotation")
        time.sleep(0.2)
    time.sleep(2.0)  # each router's view of the new processes' counts


def _all_healthy(url: str) -> bool:
    health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    return all(w["healthy"] for workers in health.get("workers", {}).values() for w in workers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--ratios", default="0,0.5,0.9")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setup, flags in _SETUPS.items():
            with Server("epd", args.model, "--routers", "2", "--encoders", "2", "--no-standby", *flags,
                        timeout_s=300) as server:
                ratios = [float(r) for r in args.ratios.split(",")]
                for ratio in ratios:
                    out = Path(tmp) / f"{len(rows)}"
                    rows.append((setup, f"{ratio:.1f}", point(server, ratio, int(ratio * 100), args, out)))
                restart_encoders(server)
                out = Path(tmp) / f"{len(rows)}"
                rows.append((setup, f"{ratios[-1]:.1f}, replayed after an encoder restart",
                             point(server, ratios[-1], int(ratios[-1] * 100), args, out)))
    print(f"model={args.model} prompts={args.num_prompts} rate={args.rate}/s, one 448x448 image each, "
          "2 routers x 2 encoders")
    print("| setup | repeat ratio | images sent | encoded | saved | read by prefill | prefill ms per item: store read "
          "/ shm import | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for setup, ratio, r in rows:
        saved = 1 - r["encoded"] / r["sent"] if r["sent"] else 0.0
        per_item = " / ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in ("store_ms", "shm_ms"))
        print(f"| {setup} | {ratio} | {r['sent']} | {r['encoded']:.0f} | {saved:.0%} | {r['read']:.0f} | "
              f"{per_item} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
