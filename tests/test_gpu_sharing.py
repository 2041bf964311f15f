"""``epd serve`` on one host with GPUs shared between workers: the LLM engines on a device split its
gpu_memory_utilization and leave the encoders' cache budget on it free (the encoder's own figure,
computed from the checkpoint's files); workers alone on a device, CPU workers and a serve without
gpu_memory_utilization get nothing."""
from __future__ import annotations

import pytest

from epd.config import EncoderConfig, EngineConfig, WorkerConfig
from epd.encoder.engine import EncoderEngine, output_budgets_for
from epd.models.locate import resolve_model
from epd.server.gpu_sharing import shared_gpu_args

COUNTS = {"encoder": 1, "prefill": 1, "decode": 1}


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("tiny-qwen2-vl")


def _worker(**engine) -> WorkerConfig:
    return WorkerConfig(engine=EngineConfig(**engine), encoder=EncoderConfig(dtype="bfloat16"))


def test_the_encoders_budget_from_files_is_what_the_encoder_itself_resolves(model_dir):
    config = EncoderConfig(encoder_cache_max_bytes=3 * 1024 * 1024)
    engine = EncoderEngine.from_model_dir(model_dir, config)
    try:
        budgets = engine.scheduler.budgets
        assert output_budgets_for(model_dir, config) == (budgets.output_budget_bytes, budgets.encoder_cache_max_bytes)
    finally:
        engine.close()


def test_engines_on_one_gpu_split_it_and_leave_the_encoders_cache_free(model_dir):
    worker = _worker(gpu_memory_utilization=0.9)
    cache_bytes = output_budgets_for(model_dir, worker.encoder)[1]
    args = shared_gpu_args(COUNTS, {}, worker, model_dir)  # every tier on the default device
    assert set(args) == {("prefill", 0), ("decode", 0)}
    for flags in args.values():
        assert flags == ("--gpu-memory-utilization", "0.45", "--reserved-device-bytes", str(-(-cache_bytes // 2)))


def test_an_engine_alone_on_its_gpu_is_left_as_it_is(model_dir):
    worker = _worker(gpu_memory_utilization=0.8)
    cache_bytes = output_budgets_for(model_dir, worker.encoder)[1]
    args = shared_gpu_args({"encoder": 2, "prefill": 1, "decode": 1},
                           {"encoder": ["cuda:0"], "prefill": ["cuda:0"], "decode": ["cuda:1"]}, worker, model_dir)
    assert args == {("prefill", 0): ("--gpu-memory-utilization", "0.8", "--reserved-device-bytes",
                                     str(2 * cache_bytes))}


@pytest.mark.parametrize("worker, devices", [
    (_worker(), {}),  # no gpu_memory_utilization: fixed KV sizes, nothing to split
    (_worker(gpu_memory_utilization=0.9), {"encoder": ["cpu"], "prefill": ["cpu"], "decode": ["cpu"]}),
])
def test_nothing_to_plan(model_dir, worker, devices):
    assert shared_gpu_args(COUNTS, devices, worker, model_dir) == {}


def test_on_cuda_an_unsized_kv_cache_takes_vllms_share_of_the_device_and_must_hold_one_sequence(monkeypatch):
    """vLLM's defaults, decided where the model runs: on CUDA, with no KV size given, the KV cache
    is sized from 0.9 of the device; a size given (kv_cache_bytes, num_kv_blocks, or the fraction
    itself) wins; the CPU keeps kv_cache_bytes. Several engines on one GPU split that 0.9 even when
    nobody gave it. A device-sized cache that cannot hold one max_model_len sequence is refused,
    naming both numbers."""
    from epd.config import EngineConfig, WorkerConfig
    from epd.engine.memory_profile import check_holds_one_sequence
    from epd.server import gpu_sharing
    from epd.server.gpu_sharing import planned_utilization

    assert EngineConfig(device="cuda").kv_gpu_memory_utilization == 0.9
    assert EngineConfig(device="cuda", gpu_memory_utilization=0.5).kv_gpu_memory_utilization == 0.5
    assert EngineConfig(device="cuda", kv_cache_bytes=1 << 30).kv_gpu_memory_utilization is None
    assert EngineConfig(device="cuda", num_kv_blocks=100).kv_gpu_memory_utilization is None
    assert EngineConfig(device="cpu").kv_gpu_memory_utilization is None
    assert planned_utilization(EngineConfig(), {"prefill": ["0"], "decode": ["0"]}) == 0.9
    assert planned_utilization(EngineConfig(device="cpu"), {}) is None
    monkeypatch.setattr(gpu_sharing, "_cuda_here", lambda: False)
    assert planned_utilization(EngineConfig(), {}) is None  # auto on a host without a GPU
    monkeypatch.setattr(gpu_sharing, "_cuda_here", lambda: True)
    assert planned_utilization(EngineConfig(), {}) == 0.9
    worker = WorkerConfig(engine=EngineConfig(device="cuda"))
    args = gpu_sharing.shared_gpu_args({"encoder": 0, "prefill": 1, "decode": 1}, {}, worker, "unused")
    assert args == {("prefill", 0): ("--gpu-memory-utilization", "0.45", "--reserved-device-bytes", "0"),
                    ("decode", 0): ("--gpu-memory-utilization", "0.45", "--reserved-device-bytes", "0")}
    check_holds_one_sequence(256, 16, 4096, 0.9)
    with pytest.raises(ValueError, match=r"the KV cache holds 4080 tokens \(gpu_memory_utilization 0.9\), fewer than "
                                         r"one sequence of max_model_len 4096: lower --max-model-len to 4080"):
        check_holds_one_sequence(255, 16, 4096, 0.9)


def test_a_tensor_parallel_engine_takes_its_share_on_its_most_crowded_device(model_dir):
    """A TP2 prefill on GPUs 0 and 1 beside a decode on GPU 0: both engines split GPU 0, and the
    prefill's ranks all size from that share (GPU 1 is not its to fill alone: the ranks agree on
    one page count). A TP2 engine alone on its GPUs gets nothing."""
    worker = _worker(gpu_memory_utilization=0.9)
    args = shared_gpu_args({"encoder": 0, "prefill": 1, "decode": 1},
                           {"prefill": ["cuda:0,1"], "decode": ["cuda:0"]}, worker, model_dir)
    assert args == {w: ("--gpu-memory-utilization", "0.45", "--reserved-device-bytes", "0")
                    for w in (("prefill", 0), ("decode", 0))}
    assert shared_gpu_args({"encoder": 0, "prefill": 1, "decode": 1},
                           {"prefill": ["cuda:0,1"], "decode": ["cuda:2"]}, worker, model_dir) == {}


def test_a_workers_devices_become_its_flags():
    from epd.server.gpu_sharing import device_args

    assert device_args("cuda:3") == ("--device", "cuda:3")
    assert device_args("cuda:2,0") == ("--device", "cuda:2", "--tensor-parallel-devices", "2,0")
