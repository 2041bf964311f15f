"""Shared by the benchmark scripts: run from a checkout without installing, synthetic images."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.bench.local_server import LocalServer  # noqa: E402 - after the checkout is on the path


def noise_png(size_px: int, seed: int) -> bytes:
    """A distinct PNG per seed: noise, so every patch differs and no two images share a cache entry."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size_px, size_px, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# ---- servers and epd bench, for the sweeps ----------------------------------------------------

BENCH_DIR = Path(__file__).resolve().parent


class Server(LocalServer):
    """``epd serve`` (EPD tiers or ``--aggregated``) or ``hf_server.py`` as a process tree on
    loopback; ``with Server("epd", model) as s: s.url``. Always stopped, bounded waits."""

    def __init__(self, system: str, model: str, *extra: str, timeout_s: float = 300.0) -> None:
        serve = [sys.executable, "-m", "epd", "serve", "--model", model, "--port", "0", "--grpc-port", "0"]
        commands = {"epd": serve, "aggregated": [*serve, "--aggregated"],
                    "transformers": [sys.executable, str(BENCH_DIR / "hf_server.py"), "--model", model]}
        super().__init__([*commands[system], *extra], name=f"{system} server", timeout_s=timeout_s)
        self.system = system


def run_bench(url: str, out_dir: Path, *args: str, timeout_s: float = 1800.0) -> list[dict]:
    """``epd bench`` against ``url`` (no plots, no progress); -> the runs of its summary.json."""
    cmd = [sys.executable, "-m", "epd", "bench", "--base-url", url, "--out", str(out_dir), "--no-plots",
           "--no-progress", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"epd bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out_dir / "summary.json").read_text())["runs"]
