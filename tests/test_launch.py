"""LocalCluster's thread split for co-located tier processes (EPD_NUM_THREADS for each child), and the
open-files limit every server raises."""
import pytest

from epd.server.local import LocalCluster, tier_threads
from epd.threads import usable_cores


@pytest.fixture(autouse=True)
def no_thread_env(monkeypatch):
    for name in ("EPD_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_usable_cores_are_split_between_tiers_at_least_one_each():
    cores = usable_cores()
    assert tier_threads(3, {}) == max(1, cores // 3)
    assert tier_threads(cores * 4, {}) == 1
    assert tier_threads(1, {}) is None  # one process sizes its own (epd.threads)


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
