"""Encoder cache and routing: repeat ratio 0 -> 0.9, hash-affinity vs round-robin encoder routing.

Starts a cluster with 2 encoders per policy and drives it with ``epd bench`` (HTTP, streaming);
reports how many images were actually encoded (the rest were cache hits) and TTFT, per ratio.

    python benchmarks/sweep_repeat_ratio.py [--model tiny-qwen2-vl] [--num-prompts 24] [--rate 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401  (puts the checkout on sys.path)

from epd.server.local import LocalCluster  # noqa: E402


def bench(url: str, ratio: float, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "epd", "bench", "--base-url", url, "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.rate), "--repeat-ratio", str(ratio), "--image-size", "448x448",
           "--output-len", "16", "--seed", str(int(ratio * 100)), "--out", str(out), "--no-plots", "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    run = json.loads((out / "summary.json").read_text())["runs"][0]
    return {"sent": run["client"]["images_sent"], "encoded": run["server"]["encoder_encoded_items"],
            "ttft_p50_ms": run["client"]["ttft_ms"]["p50"], "ttft_p90_ms": run["client"]["ttft_ms"]["p90"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--ratios", default="0,0.5,0.9")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("hash_affinity", "round_robin"):
            config = Path(tmp) / f"{policy}.yaml"
            config.write_text(f"encoder_policy: {policy}\n")
            with LocalCluster(args.model, num_encoders=2) as cluster:
                url = cluster.start_router(extra_args=["--config", str(config)]).ready_fields[0]
                for ratio in map(float, args.ratios.split(",")):
                    rows.append((policy, ratio, bench(url, ratio, args, Path(tmp) / f"{policy}-{ratio}")))
    print(f"model={args.model} prompts={args.num_prompts} rate={args.rate}/s, one 448x448 image each, 2 encoders")
    print("| encoder routing | repeat ratio | images sent | encoded | saved | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|")
    for policy, ratio, r in rows:
        saved = 1 - r["encoded"] / r["sent"] if r["sent"] else 0.0
        print(f"| {policy} | {ratio:.1f} | {r['sent']} | {r['encoded']:.0f} | {saved:.0%} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |")


if __name__ == "__main__":
    main()
