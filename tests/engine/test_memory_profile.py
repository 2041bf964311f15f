"""KV sizing from device memory: the arithmetic and its refusal, and the profiled worst-case step
running on the CPU (the CUDA sizing itself: tests/engine/test_cuda_engine.py)."""
from __future__ import annotations

import pytest

from epd.config import EngineConfig
from epd.engine.memory_profile import GiB, kv_budget_bytes, profile_step
from epd.models.locate import resolve_model
from epd.models.registry import load_llm_for


def test_the_budget_is_the_fraction_minus_the_peak():
    assert kv_budget_bytes(80 * GiB, 0.9, 20 * GiB) == int(72 * GiB) - 20 * GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 of 80.0 GiB leaves nothing for the KV cache: "
                                         r"weights and one step's activations peak at 20.0 GiB"):
        kv_budget_bytes(80 * GiB, 0.2, 20 * GiB)


def test_what_is_reserved_for_the_encoder_comes_off_the_kv_budget():
    assert kv_budget_bytes(80 * GiB, 0.9, 20 * GiB, 2 * GiB) == int(72 * GiB) - 22 * GiB
    with pytest.raises(ValueError, match=r"peak at 20.0 GiB and 60.0 GiB reserved for the encoder"):
        kv_budget_bytes(80 * GiB, 0.9, 20 * GiB, 60 * GiB)


def test_the_decode_graphs_memory_comes_off_the_kv_budget_where_graphs_are_captured(monkeypatch):
    import importlib.util

    from epd.engine.attention.flashinfer import WORKSPACE_BYTES
    from epd.engine.memory_profile import decode_graph_bytes
    assert kv_budget_bytes(80 * GiB, 0.9, 20 * GiB, 2 * GiB, 3 * GiB) == int(72 * GiB) - 25 * GiB
    with pytest.raises(ValueError, match=r"plus 3.0 GiB for the decode CUDA graphs \(--enforce-eager: none\)"):
        kv_budget_bytes(80 * GiB, 0.5, 38 * GiB, 0, 3 * GiB)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else None)
    graphs = EngineConfig(device="cuda", dtype="bfloat16")
    assert decode_graph_bytes(graphs, GiB) == GiB + WORKSPACE_BYTES
    for none in (EngineConfig(device="cuda", dtype="bfloat16", enforce_eager=True),
                 EngineConfig(device="cuda", dtype="float32"),  # sdpa: FlashInfer has no float32 kernels
                 EngineConfig(device="cuda", dtype="bfloat16", attention_backend="sdpa"),
                 EngineConfig(device="cpu")):
        assert decode_graph_bytes(none, GiB) == 0


def test_epd_llm_on_a_gpu_reserves_its_vision_towers_output_budget(monkeypatch):
    """In one process the vision tower's rows and the KV cache share the device: the engine is
    sized with the encoder's output budget (C) reserved, as an encoder tier would resolve it."""
    from epd.config import EncoderConfig
    from epd.encoder.engine import output_budgets_for
    from epd.llm import LLM
    model_dir = resolve_model("tiny-qwen2-vl")
    llm = LLM.__new__(LLM)  # only the sizing rule: no model load
    llm.model_dir = model_dir
    llm.engine_config = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9,
                                     reserved_device_bytes=5)
    expected = output_budgets_for(model_dir, EncoderConfig(device="cuda", dtype="bfloat16"))[0]
    assert llm._sized_beside_the_vision_tower().reserved_device_bytes == 5 + expected > 5
    llm.engine_config = EngineConfig(device="cpu")
    assert llm._sized_beside_the_vision_tower() is llm.engine_config  # no device memory to plan on a CPU


def _allocated_bytes(run) -> tuple[object, int]:
    """``run()``'s result and the bytes its CPU tensors allocated in all (torch's profiler: no
    device counter on a CPU, and the total grows with the activations as the peak does)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    return result, sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_the_profiled_step_runs_the_worst_case_batch():
    """max_num_batched_tokens spread over max_num_seqs sequences, each with its logits row; a
    larger budget profiles a larger step (the figure the KV cache is sized from grows with it)."""
    small = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=100)
    large = small.model_copy(update={"max_num_seqs": 8, "max_num_batched_tokens": 400})
    model = load_llm_for(resolve_model("tiny-qwen2-vl"), small)
    vocab = model.config.vocab_size
    profiled, small_bytes = _allocated_bytes(lambda: profile_step(model, small))
    assert (profiled.num_seqs, profiled.tokens_each, profiled.logits_shape) == (4, 25, (4, vocab))
    profiled, large_bytes = _allocated_bytes(lambda: profile_step(model, large))
    assert (profiled.num_seqs, profiled.tokens_each, profiled.logits_shape) == (8, 50, (8, vocab))
    # twice the rows of logits and sampler copies, four times the tokens through the layers
    assert large_bytes > 1.8 * small_bytes, (small_bytes, large_bytes)


def test_the_fraction_is_validated():
    from epd.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="gpu_memory_utilization: Input should be less than or equal to 1"):
        load_config(EngineConfig, {"gpu_memory_utilization": 1.5})
