"""``epd serve`` killed hard (SIGKILL: an OOM killer, a container runtime's timeout, a crashed
terminal multiplexer) leaves nothing behind: every process it started dies with it within seconds,
their shared memory goes with them, no config file is left, and a new ``epd serve`` starts on the
same ports (both are free to bind). Its API key never touches a file (the children get their configs through pipes)."""
from __future__ import annotations

import os
import secrets
import signal
import tempfile
import time
from pathlib import Path

import pytest

from epd.bench.chaos import segments_of
from epd.server.local import port_outside_ephemeral_range
from epd.server.ports import check_free
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.procs import descendants, gone

pytestmark = pytest.mark.slow
GONE_WITHIN_S = 5.0


def _files_holding(root: Path, secret: bytes, since_s: float) -> list[str]:
    """Files under ``root`` written since ``since_s`` (unix time) whose bytes hold ``secret``."""
    found = []
    for folder, _, names in os.walk(root, onerror=lambda _: None):
        for name in names:
            path = os.path.join(folder, name)
            try:
                if os.path.islink(path) or os.stat(path).st_mtime < since_s:
                    continue
                with open(path, "rb") as f:
                    if secret in f.read():
                        found.append(path)
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def _config_dirs(root: Path) -> set[str]:
    return {name for name in os.listdir(root) if name.startswith("epd-configs-")}


def test_a_hard_killed_epd_serve_takes_its_whole_tree_with_it_and_frees_its_ports():
    temp = Path(tempfile.gettempdir())
    http_port, grpc_port = port_outside_ephemeral_range(), port_outside_ephemeral_range()
    key = "sk-epd-test-" + secrets.token_hex(16)
    dirs_before, started_s = _config_dirs(temp), time.time()
    serve = ServeProcess("--model", "tiny-qwen2-vl", "--port", str(http_port), "--grpc-port", str(grpc_port),
                         "--api-key", key)
    tree = descendants(serve.proc.pid)
    try:
        assert len(tree) >= 4, tree  # router, encoder, prefill, decode (and the zygote they were forked from)
        assert not _files_holding(temp, key.encode(), started_s), "the API key was written to a file"
        assert _config_dirs(temp) == dirs_before
        os.kill(serve.proc.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        assert wait_until(lambda: all(gone(pid) for pid in tree), GONE_WITHIN_S, period_s=0.05), \
            f"{GONE_WITHIN_S} s after epd serve's SIGKILL, still running: {sorted(p for p in tree if not gone(p))}"
        print(f"the whole tree was gone {time.monotonic() - killed_s:.1f} s after the kill")
        left = [name for pid in tree for name in segments_of(pid)]
        assert not left, f"shared memory of the dead tree: {left}"
        assert _config_dirs(temp) == dirs_before
    finally:
        for pid in tree:  # whatever the assertions found still running: by pid, never by name
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    # the ports are free again: the check a new epd serve makes before it starts anything passes
    # (a port still held by a leftover child would be refused there)
    check_free("127.0.0.1", http_port, "--port")
    check_free("127.0.0.1", grpc_port, "--grpc-port")
