"""A Mooncake Store for the encoder cache on this host: its master and one segment server.

``epd serve --encoder-cache-store mooncake`` without ``--mooncake-master`` starts both on
127.0.0.1 (or ``--host``) and stops them at exit; a cluster points its encoders at its own master
instead. The master keeps the keys; the segment server (``mooncake_client``) holds the bytes, so an
encoder that restarts finds the cluster's work still there. Neither needs a metadata service: the
peers exchange it (``P2PHANDSHAKE``). Both are Mooncake's own binaries from its wheel; they are
ended with this process however it ends (``reap_with_me``).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from epd.server.local import port_outside_ephemeral_range
from epd.server.parent import reap_with_me

log = logging.getLogger("epd.server")

DEFAULT_SEGMENT_BYTES = 1024 * 1024 * 1024


class MooncakeStartError(RuntimeError):
    """The store's processes could not start (the message says which and why)."""


def binary(name: str) -> str:
    """A Mooncake binary: beside this Python (its wheel installs them there), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise MooncakeStartError(f"{name} not found: the encoder cache store needs Mooncake's wheel (pip install "
                                 "mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine on CUDA hosts)")
    return found


class MooncakeStore:
    """``with MooncakeStore(segment_bytes=...) as store: store.master`` (HOST:PORT)."""

    def __init__(self, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES, host: str = "127.0.0.1") -> None:
        self.host, self.segment_bytes = host, segment_bytes
        self.master: str | None = None
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 30.0) -> "MooncakeStore":
        try:
            master_port, metrics_port, segment_port = (self._free_port() for _ in range(3))
            self._spawn("mooncake_master", [f"-rpc_address={self.host}", f"-rpc_port={master_port}",
                                            f"-metrics_host={self.host}", f"-metrics_port={metrics_port}",
                                            "-enable_http_metadata_server=false"], master_port, timeout_s)
            self.master = f"{self.host}:{master_port}"
            self._spawn("mooncake_client", [f"-host={self.host}", f"-port={segment_port}",
                                            f"-global_segment_size={self.segment_bytes}",
                                            f"-master_server_address={self.master}",
                                            "-metadata_server=P2PHANDSHAKE"], segment_port, timeout_s)
        except BaseException:
            self.stop()
            raise
        reap_with_me([p.pid for p in self.procs])
        log.info("encoder cache store: Mooncake master %s, segment server of %.0f MiB", self.master,
                 self.segment_bytes / 2**20)
        return self

    def _free_port(self) -> int:
        port = port_outside_ephemeral_range(self.host)
        if port == 0:
            with socket.socket() as probe:  # no room below the ephemeral range: any free one
                probe.bind((self.host, 0))
                port = probe.getsockname()[1]
        return port

    def _spawn(self, name: str, args: list[str], port: int, timeout_s: float) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": self.host, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL",
                                                                                               "WARNING")}
        proc = subprocess.Popen([binary(name), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                output = proc.stdout.read().decode(errors="replace")[-2000:] if proc.stdout else ""
                raise MooncakeStartError(f"{name} exited with {proc.returncode} at start:\n{output}")
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex((self.host, port)) == 0:
                    _drain(proc)
                    return
            time.sleep(0.05)
        raise MooncakeStartError(f"{name} did not listen on {self.host}:{port} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in reversed(self.procs):  # the segment server first, then its master
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        self.procs = []

    def __enter__(self) -> "MooncakeStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _drain(proc: subprocess.Popen) -> None:
    """Read the process's output on a thread of its own (its pipe must not fill), logged at DEBUG."""
    import threading

    def run() -> None:
        for line in proc.stdout:
            log.debug("mooncake (pid %d): %s", proc.pid, line.decode(errors="replace").rstrip())

    threading.Thread(target=run, name=f"mooncake-{proc.pid}", daemon=True).start()
