"""The engine on a CUDA device (skipped without one; ``scripts/gpu_verify.sh`` runs these first):
greedy float32 token ids equal the CPU engine's, seeded sampling works there and draws what the CPU
draws (its generator is on the CPU), bf16 stays close to float32, weights load straight onto the
device in bf16, and ``auto`` picks CUDA and bf16."""
from __future__ import annotations

import pytest
import torch

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.presets import write_preset_checkpoint
from epd.types import SamplingParams
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("small-qwen2-vl", tmp_path_factory.mktemp("cuda") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def chat():
    return user_message("Describe the picture.", [make_image_bytes(160, 120, seed=3)])


def test_cuda_fp32_greedy_equals_the_cpu_engine(model_dir, chat):
    params = SamplingParams(max_tokens=16, temperature=0.0)
    cpu = LLM(str(model_dir), engine_config=EngineConfig(device="cpu", dtype="float32")).chat(chat, params)[0]
    gpu = LLM(str(model_dir), engine_config=EngineConfig(device="cuda", dtype="float32", kv_cache_bytes=256 << 20)
              ).chat(chat, params)[0]
    assert gpu.token_ids == cpu.token_ids


def test_seeded_sampling_on_cuda_draws_what_the_cpu_draws(model_dir, chat):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=11)
    cpu = LLM(str(model_dir), engine_config=EngineConfig(device="cpu", dtype="float32")).chat(chat, params)[0]
    gpu = LLM(str(model_dir), engine_config=EngineConfig(device="cuda", dtype="float32", kv_cache_bytes=256 << 20)
              ).chat(chat, params)[0]
    assert len(gpu.token_ids) == 8
    assert gpu.token_ids[:4] == cpu.token_ids[:4]  # same seed, same probabilities up to fp32 noise


def test_auto_is_cuda_and_bf16_and_weights_land_there(model_dir, chat):
    llm = LLM(str(model_dir))
    model = llm.engine.runner.model
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.inv_freq.dtype == torch.float32
    assert len(llm.chat(chat, SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4


def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_device(model_dir):
    """A KV size given is kept; none given: 0.9 of the device (vLLM's default); 0.3 given: less."""
    import gc

    def blocks(**kv) -> tuple[int, int]:
        llm = LLM(str(model_dir), engine_config=EngineConfig(device="cuda", **kv))
        n = len(llm.engine.block_manager.blocks)
        allocated = torch.cuda.memory_allocated()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return n, allocated

    given, _ = blocks(kv_cache_bytes=256 << 20)
    default, _ = blocks()
    third, allocated = blocks(gpu_memory_utilization=0.3)
    total = torch.cuda.get_device_properties(0).total_memory
    assert default > third > given
    assert allocated <= 0.3 * total + 256 * 1024**2  # the vision tower is not counted


def test_async_scheduling_on_cuda_answers_as_steps_in_order(model_dir, chat):
    """Several requests in bf16 with CUDA graphs where FlashInfer is installed: the steps overlap
    (each launched with the last one's tokens on the device) and the greedy answers are the same."""
    params = [SamplingParams(max_tokens=12 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    answers, overlapped = [], []
    for overlap in (False, True):
        llm = LLM(str(model_dir), engine_config=EngineConfig(device="cuda", kv_cache_bytes=256 << 20,
                                                             async_scheduling=overlap))
        answers.append([out.token_ids for out in llm.chat([chat] * len(params), params)])
        overlapped.append(llm.engine.num_overlapped_steps)
    assert answers[1] == answers[0]
    assert overlapped[0] == 0 and overlapped[1] > 10
