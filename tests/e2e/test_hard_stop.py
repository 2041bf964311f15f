"""``epd serve`` killed hard (SIGKILL: an OOM killer, a container runtime's timeout, a crashed
terminal multiplexer) leaves nothing behind: every process it started dies with it within seconds,
their shared memory goes with them, no config file is left, and a new ``epd serve`` starts on the
same ports (both are free to bind). Its API key never touches a file (the children get their configs through pipes)."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
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


_LAUNCHER = """
import sys, time
from epd.bench.local_server import LocalServer
command = [sys.executable, "-m", "epd", "serve", "--model", "null-qwen2-vl", "--port", "0", "--grpc-port", "0"]
with LocalServer(command, name="epd serve", url_line=__import__("re").compile("(starting) ")):
    print("STARTING", flush=True)  # epd serve is past its flags, starting its processes: we are killed now
    time.sleep(120)
"""


def test_an_epd_serve_whose_launcher_dies_while_it_starts_stops_at_once_and_takes_its_tree():
    """A measurement (``epd profile``, a benchmark) runs ``epd serve`` in a session of its own; if the
    measurement is killed, its ``epd serve`` must not stay behind (nobody would ever stop it), nor wait
    out its start (up to --timeout-s) before it notices."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    tree: set[int] = set()
    try:
        lines = []
        for line in launcher.stdout:  # bounded: the launcher exits (EOF) if epd serve never starts
            lines.append(line)
            if line.startswith("STARTING"):
                break
        assert lines and lines[-1].startswith("STARTING"), "".join(lines[-20:])
        time.sleep(0.5)  # its first processes are starting
        tree = descendants(launcher.pid)
        assert tree, "epd serve was not running"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        killed_s = time.monotonic()
        assert wait_until(lambda: all(gone(pid) for pid in descendants_of_any(tree) | tree), 15.0, period_s=0.1), \
            f"15 s after its launcher's SIGKILL, still running: {sorted(p for p in tree if not gone(p))}"
        print(f"epd serve and its processes were gone {time.monotonic() - killed_s:.1f} s after the launcher")
        assert not [name for pid in tree for name in segments_of(pid)]
    finally:
        for pid in descendants_of_any(tree) | tree:  # by pid, never by name
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


def descendants_of_any(pids: set[int]) -> set[int]:
    """Every live descendant of ``pids`` (epd serve's processes started after the first look)."""
    return {child for pid in pids if not gone(pid) for child in descendants(pid)}


def test_an_epd_serve_whose_output_nobody_reads_keeps_serving_and_stops_cleanly():
    """A closed terminal or a reader that went away (``epd serve | head``) must not wedge the start
    (a process's output is read to learn that it is ready) nor skip the clean-up at the end."""
    http_port = port_outside_ephemeral_range()
    command = [sys.executable, "-m", "epd", "serve", "--model", "null-qwen2-vl", "--port", str(http_port),
               "--grpc-port", "0"]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    tree: set[int] = set()
    try:
        serve.stdout.readline()  # it is running; from here on nobody reads what it writes
        serve.stdout.close()
        healthy = wait_until(lambda: _health(http_port) == "ok", 120.0, period_s=0.5)
        tree = descendants(serve.pid)
        assert healthy, "epd serve did not become healthy with its output closed"
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(40) == 0
        assert wait_until(lambda: all(gone(pid) for pid in tree), GONE_WITHIN_S, period_s=0.05), \
            f"after epd serve stopped, still running: {sorted(p for p in tree if not gone(p))}"
        assert not [name for pid in tree for name in segments_of(pid)]
    finally:
        for pid in tree:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)


def _health(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return json.loads(resp.read()).get("status")
    except (OSError, ValueError):
        return None
