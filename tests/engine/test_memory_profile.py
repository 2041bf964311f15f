"""KV sizing from device memory: the arithmetic and its refusal, and the profiled worst-case step
running on the CPU (the CUDA sizing itself: tests/engine/test_cuda_engine.py)."""
from __future__ import annotations

import pytest

from epd.config import EngineConfig
from epd.engine.memory_profile import GiB, kv_budget_bytes, profile_step
from epd.models.presets import resolve_model
from epd.models.registry import load_llm_for


def test_the_budget_is_the_fraction_minus_the_peak():
    assert kv_budget_bytes(80 * GiB, 0.9, 20 * GiB) == int(72 * GiB) - 20 * GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 of 80.0 GiB leaves nothing for the KV cache: "
                                         r"weights and one step's activations peak at 20.0 GiB"):
        kv_budget_bytes(80 * GiB, 0.2, 20 * GiB)


def test_the_profiled_step_runs_the_worst_case_batch():
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=100)
    model = load_llm_for(resolve_model("tiny-qwen2-vl"), config)
    profile_step(model, config)  # 4 sequences of 25 tokens, each sampling: no error, nothing kept


def test_the_fraction_is_validated():
    from epd.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="gpu_memory_utilization: Input should be less than or equal to 1"):
        load_config(EngineConfig, {"gpu_memory_utilization": 1.5})
