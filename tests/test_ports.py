"""A port ``epd serve`` or ``epd router`` needs and cannot have is one line naming the port and its
flag, exit 1, before anything starts: no traceback, no process left behind."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from epd.server.ports import PortTaken, check_free


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _pgroup_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "epd", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    return proc


@pytest.mark.parametrize("command, flag", [("serve", "--grpc-port"), ("serve", "--port"), ("router", "--grpc-port")])
def test_a_taken_port_is_one_line_exit_1_and_nothing_started(taken_port, command, flag):
    others = {"--grpc-port": ["--port", "0"], "--port": ["--grpc-port", "0"]}[flag]
    workers = ["--decodes", "127.0.0.1:1"] if command == "router" else ["--no-standby"]
    proc = subprocess.Popen([sys.executable, "-m", "epd", command, "--model", "tiny-qwen2-vl", flag, str(taken_port),
                             *others, *workers], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    lines = err.strip().splitlines()
    assert lines[-1] == (f"epd {command}: error: {flag} {taken_port}: 127.0.0.1:{taken_port} is in use (Address "
                         f"already in use; another epd serve?); give {flag} another port, or 0 for a free one"), err
    assert "Traceback" not in err and "starting" not in out, (out, err)
    assert not _pgroup_members(proc.pid)  # nothing it started lives on


def test_one_stream_port_for_several_decode_workers_is_refused_before_anything_starts():
    proc = _run("serve", "--model", "tiny-qwen2-vl", "--decodes", "2", "--stream-port", "50999", "--port", "0",
                "--grpc-port", "0")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "epd serve: error: --stream-port 50999 with 2 decode workers: each needs a port of its own; use 0")


def test_port_zero_and_a_free_port_pass_the_check(taken_port):
    check_free("127.0.0.1", 0, "--port")
    with pytest.raises(PortTaken, match=f"--port {taken_port}: 127.0.0.1:{taken_port} is in use"):
        check_free("127.0.0.1", taken_port, "--port")
