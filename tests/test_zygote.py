"""The zygote (``epd.server.zygote``): workers forked from one process that imported their code.
A forked worker has what a cold-started one has (its own stdout, config descriptor, environment,
session; its exit code, a kill's included, reaches the launcher) and its own random state; a
launcher whose zygote is gone starts processes cold and says so."""
from __future__ import annotations

import os
import signal

import pytest

from epd.server.local import LocalCluster, TierProcess, _config_pipe
from epd.server.parent import PARENT_PID_ENV
from epd.server.zygote_client import Zygote, ZygoteGone


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _spawn(zygote: Zygote, argv: list[str], env: dict[str, str], config_fd: int | None = None):
    read_fd, write_fd = os.pipe()
    fds = [(write_fd, 1), *(((config_fd, config_fd),) if config_fd is not None else ())]
    try:
        child = zygote.spawn(argv, {**env, PARENT_PID_ENV: str(zygote.proc.pid)}, fds)
    finally:
        os.close(write_fd)
    child.stdout = os.fdopen(read_fd, "r")
    return child


@pytest.mark.slow
def test_a_forked_worker_has_its_own_descriptors_environment_session_and_exit_code():
    from epd.config import EngineConfig, WorkerConfig

    env = {**os.environ, "EPD_NUM_THREADS": "1"}
    zygote = Zygote(env, tiers=["decode"], model=None, router=False)
    try:
        # a bad config through its descriptor: the worker says what came, and exits 2
        bad = os.open("/dev/null", os.O_RDONLY)
        read_fd, write_fd = os.pipe()
        os.write(write_fd, b"engine: {block_size: -3}\n")
        os.close(write_fd)
        os.close(bad)
        refused = _spawn(zygote, ["decode", "--config", f"/dev/fd/{read_fd}", "--model", "tiny-qwen2-vl"], env,
                         config_fd=read_fd)
        os.close(read_fd)
        assert refused.wait(120) == 2
        said = refused.stdout.read()
        assert "block_size" in said and "Traceback" not in said, said

        config_fd = _config_pipe(WorkerConfig(engine=EngineConfig(max_num_seqs=3)))
        worker = _spawn(zygote, ["decode", "--config", f"/dev/fd/{config_fd}", "--model", "tiny-qwen2-vl",
                                 "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"], env, config_fd)
        os.close(config_fd)
        tier = TierProcess("decode", worker)
        lines = iter(worker.stdout)
        ready = next((line for line in lines if line.startswith("EPD_READY")), None)
        assert ready is not None, tier.tail()
        stat = _stat(worker.pid)
        assert int(stat[1]) == zygote.proc.pid  # its parent: the zygote
        assert int(stat[3]) == worker.pid  # its own session, as a cold start's (start_new_session)
        with open(f"/proc/{worker.pid}/comm") as f:
            assert f.read().strip() == "epd-decode"
        with open(f"/proc/{worker.pid}/cmdline", "rb") as f:  # what ps and pgrep -f show: its own, as if cold
            assert f.read().replace(b"\0", b" ").strip().startswith(b"epd decode --config /dev/fd/")
        assert worker.poll() is None
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(30) == -signal.SIGKILL
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_forked_children_draw_their_own_random_numbers():
    """numpy's and torch's global generators are the parent's after a fork: each child reseeds
    (``_reseed``, called by every child the zygote forks before it runs)."""
    import numpy
    import torch

    from epd.server.zygote import _reseed

    draws = []
    for _ in range(2):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: draw, say, and go (nothing of the test's to tear down)
            try:
                _reseed()
                os.write(write_fd, f"{numpy.random.randint(1 << 30)} {int(torch.randint(1 << 30, (1,)))}".encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd) as f:
            draws.append(f.read().split())
        os.waitpid(pid, 0)
    assert len(draws[0]) == 2 and draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1], draws


def test_without_its_zygote_a_cluster_starts_processes_cold_and_says_so(monkeypatch):
    import epd.server.local as local

    class Gone:
        def __init__(self, *args, **kwargs):
            self.proc = type("P", (), {"pid": 1})()

        def spawn(self, *args, **kwargs):
            raise ZygoteGone("the zygote (pid 1) is gone (exit code 1)")

        def close(self):
            pass

    said, cold = [], []
    monkeypatch.setattr(local, "Zygote", Gone)
    cluster = LocalCluster("tiny-qwen2-vl", echo=said.append)
    monkeypatch.setattr(cluster, "_popen", lambda tier, cmd, **kw: cold.append(cmd) or "started")
    assert cluster._start("decode", ["decode", "--port", "0"]) == "started"
    assert cold[0][1:] == ["-m", "epd", "decode", "--port", "0"]
    assert any("is gone" in line and "starting processes cold" in line for line in said), said
    assert cluster._start("decode", ["decode"]) == "started" and not cluster.use_zygote  # no second try
    assert len(said) == 1
