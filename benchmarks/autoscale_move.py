"""The online planner moving a worker as the load turns from text to images, and what the move is
worth: ``epd serve --encoders 1 --prefills 1 --decodes 2 --autoscale-budget 4`` on loopback, text
chats first, then chats with three new 448x448 images and short answers until the planner has moved
a decode worker to the encoders, then the same image load on the new split. Printed: when the move
came, TTFT p90 of the image chats while the encoder queue grew and after the move, their ratio (the
baseline is the same run's own split before the move), failed requests, and the decisions' reasons.

    python benchmarks/autoscale_move.py [--after-s 15] [--image-clients 12]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epd.bench.local_server import LocalServer  # noqa: E402
from epd.bench.streaming_load import StreamingLoad, image_chat, p90, text_chat  # noqa: E402

MODEL = "tiny-qwen2-vl"


def _counts(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
        workers = json.loads(reply.read())["workers"]
    return {tier: sum(w["healthy"] and not w["draining"] for w in workers[tier]) for tier in workers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-s", type=float, default=5.0)
    parser.add_argument("--after-s", type=float, default=15.0)
    parser.add_argument("--image-clients", type=int, default=12)
    parser.add_argument("--move-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    command = [sys.executable, "-m", "epd", "serve", MODEL, "--port", "0", "--grpc-port", "0", "--encoders", "1",
               "--prefills", "1", "--decodes", "2", "--autoscale-budget", "4", "--autoscale-cooldown-s", "5",
               "--no-standby"]
    moved_split = {"encoder": 2, "prefill": 1, "decode": 1}
    with LocalServer(command, name="epd serve") as server:
        url = server.url.removesuffix("/v1")
        text = StreamingLoad(url, lambda n: text_chat(MODEL, n), clients=8)
        time.sleep(args.text_s)
        done = text.stop()
        images = StreamingLoad(url, lambda n: image_chat(MODEL, n), clients=args.image_clients)
        started, deadline = time.monotonic(), time.monotonic() + args.move_timeout_s
        while _counts(url) != moved_split and time.monotonic() < deadline:
            time.sleep(0.5)
        moved_at = time.monotonic()
        time.sleep(args.after_s)
        done += images.stop()
        decisions = [line.split("planner: ", 1)[1] for line in server.lines if "epd.router: planner:" in line]
    before = [t for at, t, _ in images.results if at < moved_at]
    after = [t for at, t, _ in images.results if at > moved_at + 3]
    moved = moved_at < deadline
    print(f"move: {'after %.1f s of the image load' % (moved_at - started) if moved else 'none'}; "
          f"failed requests: {sum(status != 200 for _, _, status in done)} of {len(done)}")
    if before and after:
        print(f"image TTFT p90: {p90(before):.2f} s before the move ({len(before)} requests), {p90(after):.2f} s after "
              f"({len(after)}); after / before {p90(after) / p90(before):.2f}")
    for line in decisions:
        print(f"  planner: {line}")
    return 0 if moved else 1


if __name__ == "__main__":
    sys.exit(main())
