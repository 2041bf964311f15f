"""The CPU thread policy (epd/engine/threads.py): usable cores from affinity and cgroup quota, the
precedence of flag and env, and that each engine's loop thread runs with the chosen team size."""
import logging

import pytest
import torch

from epd.config import EncoderConfig, EngineConfig
from epd.engine import threads
from epd.engine.engine_loop import EngineLoop
from epd.engine.threads import ThreadPolicy, apply_thread_policy, intra_op_threads, usable_cores

AFFINITY_CORES = 8


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(AFFINITY_CORES)))


@pytest.fixture
def no_thread_env(monkeypatch):
    for name in ("EPD_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def restore_torch_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _other_count(current: int) -> int:
    """A team size that differs from ``current``, so a test sees the policy change it."""
    return 1 if current != 1 else 2


# ---- usable cores ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cpu_max, expected", [
    ("50000 100000", 1),  # half a CPU still runs on one core
    ("150000 100000", 2),  # 1.5 CPUs: rounded up
    ("400000 100000", 4),
    ("1600000 100000", AFFINITY_CORES),  # a quota above the affinity mask: the mask
    ("max 100000", AFFINITY_CORES),
])
def test_cgroup_v2_quota_caps_the_affinity_mask(tmp_path, eight_cores, cpu_max, expected):
    _write(tmp_path, "cpu.max", cpu_max)
    assert usable_cores(tmp_path) == expected


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
@pytest.mark.parametrize("quota_us, expected", [("300000", 3), ("250000", 3), ("-1", AFFINITY_CORES)])
def test_cgroup_v1_cfs_quota_caps_the_affinity_mask(tmp_path, eight_cores, controller, quota_us, expected):
    _write(tmp_path, f"{controller}/cpu.cfs_quota_us", quota_us)
    _write(tmp_path, f"{controller}/cpu.cfs_period_us", "100000")
    assert usable_cores(tmp_path) == expected


def test_no_or_unreadable_cgroup_files_leave_the_affinity_mask(tmp_path, eight_cores):
    assert usable_cores(tmp_path) == AFFINITY_CORES
    _write(tmp_path, "cpu.max", "lots of cpu")
    assert usable_cores(tmp_path) == AFFINITY_CORES


# ---- precedence ------------------------------------------------------------------------------------
def test_default_is_usable_cores_minus_busy_threads_at_least_one(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert intra_op_threads(0, environ={}) == (4, "4 usable cores")
    assert intra_op_threads(1, environ={}) == (3, "4 usable cores - 1 busy thread")
    assert intra_op_threads(6, environ={}) == (1, "4 usable cores - 6 busy threads")


def test_override_beats_epd_env_beats_omp_env(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    environ = {"EPD_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert intra_op_threads(1, override=2, environ=environ) == (2, "num_threads=2")
    assert intra_op_threads(1, environ=environ) == (3, "EPD_NUM_THREADS=3")
    assert intra_op_threads(1, environ={"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS=5")  # the user's choice
    assert intra_op_threads(1, environ={"OMP_NUM_THREADS": "6,2"}) == (6, "OMP_NUM_THREADS=6")  # outermost level
    assert intra_op_threads(1, environ={"EPD_NUM_THREADS": " "}) == (3, "4 usable cores - 1 busy thread")


@pytest.mark.parametrize("name, value", [("EPD_NUM_THREADS", "abc"), ("EPD_NUM_THREADS", "0"),
                                         ("OMP_NUM_THREADS", "-1"), ("OMP_NUM_THREADS", "2.5")])
def test_an_invalid_env_value_names_the_variable_and_the_value(name, value):
    with pytest.raises(ValueError, match=rf"{name}='{value}': expected a positive integer"):
        intra_op_threads(0, environ={name: value})


def test_an_invalid_override_is_an_error():
    with pytest.raises(ValueError, match="num_threads must be a positive integer, got 0"):
        intra_op_threads(0, override=0, environ={})


def test_num_threads_is_a_config_field_and_a_flag():
    from epd.server.serve import serve_config_from_args
    from epd.server.tier import worker_config_from_args

    assert worker_config_from_args("prefill", ["--num-threads", "3"]).engine.num_threads == 3
    assert worker_config_from_args("encoder", ["--num-threads", "2"]).encoder.num_threads == 2
    config = serve_config_from_args(["--aggregated", "--num-threads", "1"])
    assert config.router.engine.num_threads == config.worker.engine.num_threads == config.worker.encoder.num_threads
    with pytest.raises(ValueError):
        EngineConfig(num_threads=0)


# ---- applying it -----------------------------------------------------------------------------------
def test_apply_sets_torch_threads_and_logs_once_per_role(monkeypatch, caplog, restore_torch_threads):
    chosen = _other_count(restore_torch_threads)
    caplog.set_level(logging.INFO, logger="epd.engine.threads")
    monkeypatch.setattr(threads, "_logged", set())
    assert apply_thread_policy("test-role", override=chosen) == chosen
    assert torch.get_num_threads() == chosen
    apply_thread_policy("test-role", override=chosen)
    assert [r.getMessage() for r in caplog.records] == [f"test-role: {chosen} intra-op threads (num_threads={chosen})"]


def test_engine_loop_builds_its_engine_under_the_policy(restore_torch_threads):
    chosen = _other_count(restore_torch_threads)
    seen = {}

    def build():
        seen["threads"] = torch.get_num_threads()
        return _IdleEngine()

    loop = EngineLoop(build, name="test-loop", threads=ThreadPolicy("test", override=chosen)).start(timeout_s=10)
    try:
        assert seen["threads"] == chosen
        assert loop.call(lambda engine: torch.get_num_threads()).result(10) == chosen
    finally:
        loop.stop()


def test_engine_loop_applies_the_env_by_default(monkeypatch, restore_torch_threads):
    """A tier's loop follows the split LocalCluster passes in EPD_NUM_THREADS without being told."""
    chosen = _other_count(restore_torch_threads)
    monkeypatch.setenv("EPD_NUM_THREADS", str(chosen))
    seen = {}

    def build():
        seen["threads"] = torch.get_num_threads()
        return _IdleEngine()

    EngineLoop(build, name="test-loop").start(timeout_s=10).stop()
    assert seen["threads"] == chosen


def test_encoder_engine_builds_its_model_under_its_num_threads(no_thread_env, restore_torch_threads):
    from epd.encoder.engine import EncoderEngine
    from tests.encoder.fakes import FakeEncoder

    chosen = _other_count(restore_torch_threads)
    seen = {}

    def build():
        seen["threads"] = torch.get_num_threads()
        return FakeEncoder()

    engine = EncoderEngine(build, EncoderConfig(num_threads=chosen), model_id="m", model_max_atomic_item_tokens=8,
                           bytes_per_embedding=16)
    engine.close()
    assert seen["threads"] == chosen


class _IdleEngine:
    has_unfinished = False
    num_steps = 0

    def step(self):
        raise AssertionError("an idle engine is never stepped")
