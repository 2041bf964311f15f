"""LocalCluster's thread split for co-located tier processes."""
import os

from epd.server.local import LocalCluster, tier_threads


def test_cores_are_split_between_tiers_at_least_one_each():
    cores = len(os.sched_getaffinity(0))
    assert tier_threads(3, {}) == max(1, cores // 3)
    assert tier_threads(cores * 4, {}) == 1
    assert tier_threads(1, {}) is None  # one process (epd serve --aggregated) keeps torch's default


def test_an_explicit_thread_count_wins(monkeypatch):
    assert tier_threads(3, {"OMP_NUM_THREADS": "8"}) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert LocalCluster("tiny-qwen2-vl").env["OMP_NUM_THREADS"] == "5"
    assert LocalCluster("tiny-qwen2-vl", threads_per_tier=3).env["OMP_NUM_THREADS"] == "3"
    assert LocalCluster("tiny-qwen2-vl", env={"OMP_NUM_THREADS": "7"}).env["OMP_NUM_THREADS"] == "7"


def test_default_cluster_and_single_process(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert LocalCluster("tiny-qwen2-vl").env["OMP_NUM_THREADS"] == str(max(1, cores // 3))
    alone = LocalCluster("tiny-qwen2-vl", num_encoders=0, num_prefills=0, num_decodes=0)
    assert "OMP_NUM_THREADS" not in alone.env
