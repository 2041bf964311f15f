"""Shared by the transport tests and the producer process they start."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from epd.v1 import tensor_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
SPAWNED_PIDS: set[int] = set()  # conftest's leak check also covers segments these processes made


class FakeClock:
    """Unix seconds that move only when a test says so (starts at the real time, so handles that
    cross into a real-clock process are not born expired)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same tensor in every process, for every dtype we ship (ints and bools included)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 100
    return values.to(getattr(torch, dtype))


def shm_names(prefix: str = "epd_") -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def handle_from_hex(text: str) -> tensor_pb2.TensorHandle:
    return tensor_pb2.TensorHandle.FromString(bytes.fromhex(text))


class ChildProcess:
    """A python child on 127.0.0.1 work, talked to by lines; every wait has a deadline."""

    def __init__(self, args: list[str], timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        # the repository first, then what the caller's path had (a GPU check's wheels live there)
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env, text=True, bufsize=1,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        SPAWNED_PIDS.add(self.proc.pid)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, tag: str) -> str:
        """The rest of the next line starting with ``tag``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"child {self.proc.pid} printed no {tag!r} line within {self.timeout_s} s") from None
            if line is None:
                raise RuntimeError(f"child {self.proc.pid} exited ({self.proc.wait()}) before printing {tag!r}")
            if line.startswith(tag + " ") or line == tag:
                return line[len(tag):].strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class ProducerProcess(ChildProcess):
    """``tests/transport/producer_proc.py`` in a child: a TensorStore served on 127.0.0.1."""

    def __init__(self) -> None:
        super().__init__(["-m", "tests.transport.producer_proc"])
        self.address = self.expect("ADDRESS")

    def export(self, transport: str, dtype: str, shape: tuple[int, ...], seed: int = 0,
               ttl_s: float = 60.0, device: str = "cpu") -> tensor_pb2.TensorHandle:
        self.send(f"export {transport} {dtype} {','.join(map(str, shape))} {seed} {ttl_s} {device}")
        return handle_from_hex(self.expect("HANDLE"))

    def stats(self) -> tuple[int, int]:
        self.send("stats")
        num_open_leases, open_bytes = self.expect("STATS").split()
        return int(num_open_leases), int(open_bytes)

    def cuda_memory(self) -> int:
        """Bytes torch has allocated on the producer's GPU (0 without one)."""
        self.send("cuda_memory")
        return int(self.expect("CUDA_MEMORY"))
