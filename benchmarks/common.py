"""Shared by the benchmark scripts: run from a checkout without installing, synthetic images."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def noise_png(size_px: int, seed: int) -> bytes:
    """A distinct PNG per seed: noise, so every patch differs and no two images share a cache entry."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size_px, size_px, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# ---- servers and epd bench, for the sweeps ----------------------------------------------------

_URL_LINE = re.compile(r"OpenAI API\s+(http://\S+)/v1|EPD_READY router (http://\S+)")
BENCH_DIR = Path(__file__).resolve().parent


class Server:
    """``epd serve`` (EPD tiers or ``--aggregated``) or ``hf_server.py`` as a process tree on
    loopback; ``with Server("epd", model) as s: s.url``. Always stopped, bounded waits."""

    def __init__(self, system: str, model: str, *extra: str, timeout_s: float = 300.0) -> None:
        serve = [sys.executable, "-m", "epd", "serve", "--model", model, "--port", "0", "--grpc-port", "0"]
        commands = {"epd": serve, "aggregated": [*serve, "--aggregated"],
                    "transformers": [sys.executable, str(BENCH_DIR / "hf_server.py"), "--model", model]}
        self.system, self.timeout_s, self.url = system, timeout_s, None
        self.command = [*commands[system], *extra]
        self.lines: list[str] = []

    def __enter__(self) -> "Server":
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(self.timeout_s) or self.url is None:
            self.__exit__()
            raise RuntimeError(f"{self.system} server did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    def _drain(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if self.url is None and (m := _URL_LINE.search(line)):
                self.url = m.group(1) or m.group(2)
                ready.set()
        ready.set()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def run_bench(url: str, out_dir: Path, *args: str, timeout_s: float = 1800.0) -> list[dict]:
    """``epd bench`` against ``url`` (no plots, no progress); -> the runs of its summary.json."""
    cmd = [sys.executable, "-m", "epd", "bench", "--base-url", url, "--out", str(out_dir), "--no-plots",
           "--no-progress", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"epd bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out_dir / "summary.json").read_text())["runs"]
