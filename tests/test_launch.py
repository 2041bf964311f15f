"""LocalCluster's thread split for co-located tier processes (EPD_NUM_THREADS for each child), and the
open-files limit every server raises; supervision's restarts."""

import pytest

from epd.engine.threads import usable_cores
from epd.server.local import LocalCluster, tier_threads


@pytest.fixture(autouse=True)
def no_thread_env(monkeypatch):
    for name in ("EPD_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_usable_cores_are_split_between_tiers_at_least_one_each():
    cores = usable_cores()
    assert tier_threads(3, {}) == max(1, cores // 3)
    assert tier_threads(cores * 4, {}) == 1
    assert tier_threads(1, {}) is None  # one process sizes its own (epd.engine.threads)


def test_an_explicit_thread_count_wins(monkeypatch):
    assert tier_threads(3, {"OMP_NUM_THREADS": "8"}) is None
    assert tier_threads(3, {"EPD_NUM_THREADS": "8"}) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert "EPD_NUM_THREADS" not in LocalCluster("tiny-qwen2-vl").env  # the children honour OMP_NUM_THREADS
    assert LocalCluster("tiny-qwen2-vl", threads_per_tier=3).env["EPD_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert LocalCluster("tiny-qwen2-vl", env={"EPD_NUM_THREADS": "7"}).env["EPD_NUM_THREADS"] == "7"
    assert "EPD_NUM_THREADS" not in LocalCluster("tiny-qwen2-vl", env={"OMP_NUM_THREADS": "7"}).env


def test_default_cluster_and_single_process():
    assert LocalCluster("tiny-qwen2-vl").env["EPD_NUM_THREADS"] == str(max(1, usable_cores() // 3))
    alone = LocalCluster("tiny-qwen2-vl", num_encoders=0, num_prefills=0, num_decodes=0)
    assert "EPD_NUM_THREADS" not in alone.env


def test_servers_raise_their_open_files_limit_to_the_hard_limit():
    import subprocess
    import sys

    code = ("import resource\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
            "from epd.server.process import raise_open_files_limit\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n")
    now, soft, hard = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     timeout=60).stdout.split()
    assert now == soft == hard


def test_supervision_restarts_a_dead_worker_on_its_port_with_growing_delays_then_gives_up(monkeypatch):
    import subprocess
    import sys

    from epd.server.local import TierProcess

    cluster = LocalCluster("tiny-qwen2-vl")
    spawned = []

    def spawn(tier, args=(), with_defaults=True, port=0):  # a stand-in worker: a process that exits at once
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait(30)
        spawned.append((tier, port))
        return TierProcess(tier, proc)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    first.wait(30)
    cluster.processes = [TierProcess("encoder", first, address="127.0.0.1:4567")]
    events = cluster.supervise(max_restarts=2, now_s=100.0)
    assert len(events) == 1 and "exited with 3" in events[0] and "restarting in 1 s (1 of 2)" in events[0]
    assert cluster.supervise(max_restarts=2, now_s=100.5) == []  # not yet: the delay holds
    assert "restarted" in cluster.supervise(max_restarts=2, now_s=101.0)[0]
    assert spawned == [("encoder", 4567)]  # on its own port: the router's address stays valid
    assert "restarting in 2 s (2 of 2)" in cluster.supervise(max_restarts=2, now_s=102.0)[0]  # died again
    cluster.supervise(max_restarts=2, now_s=104.0)
    events = cluster.supervise(max_restarts=2, now_s=105.0)
    assert "left down" in events[0] and cluster.processes[0].given_up
    assert cluster.supervise(max_restarts=2, now_s=200.0) == []  # no more restarts, no more events
    assert spawned == [("encoder", 4567)] * 2


def test_worker_ports_come_from_below_the_ephemeral_range():
    from epd.server.local import port_outside_ephemeral_range

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low < 1280:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = {port_outside_ephemeral_range() for _ in range(8)}
    assert all(0 < p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn, not one fixed port two clusters on a host would both want


def test_a_worker_gets_what_was_set_even_at_a_defaults_value():
    """--max-model-len 4096 given on the command line must reach a CUDA worker as given: left unset, the
    worker takes the checkpoint's length (epd.engine.memory_profile.with_model_len)."""
    import os

    import yaml

    from epd.config import EngineConfig, WorkerConfig
    from epd.engine.memory_profile import with_model_len
    from epd.server.local import _config_pipe

    fd = _config_pipe(WorkerConfig(engine=EngineConfig(max_model_len=4096, device="cuda")))
    try:
        received = WorkerConfig.model_validate(yaml.safe_load(os.read(fd, 1 << 20)))
    finally:
        os.close(fd)
    assert "max_model_len" in received.engine.model_fields_set
    assert with_model_len(received.engine, "/nonexistent").max_model_len == 4096  # the checkpoint is not read


def test_a_failing_echo_stops_the_echo_not_the_draining_of_a_processs_output():
    """epd serve's output gone (a closed terminal, a dead launcher's pipe): the lines, the ready one
    included, must still be read, or the process blocks on a full pipe and its start never ends."""
    import threading
    from types import SimpleNamespace

    from epd.server.local import TierProcess
    from epd.server.process import READY_PREFIX

    shown = []

    def echo(line: str) -> None:
        shown.append(line)
        raise BrokenPipeError(32, "Broken pipe")

    lines = ["loading weights\n", f"{READY_PREFIX} decode 127.0.0.1:4567\n", "serving\n"]
    proc = SimpleNamespace(stdout=iter(lines), pid=4242)
    tier = TierProcess("decode", proc, echo=echo)
    drain = threading.Thread(target=tier._drain)
    drain.start()
    drain.join(10)
    assert not drain.is_alive() and tier._ready.is_set()
    assert tier.address == "127.0.0.1:4567"  # the ready line after the echo failed was read
    assert tier.log_lines == [line.rstrip("\n") for line in lines] and len(shown) == 1
