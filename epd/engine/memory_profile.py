"""Sizing the KV cache from the device's memory (``gpu_memory_utilization``, vLLM's meaning): the
cache gets what is left of that fraction of the GPU's memory after this process's peak over
loading the weights and one profiled worst-case step (``max_num_batched_tokens`` prompt tokens
spread over ``max_num_seqs`` sequences, each producing logits, plus the sampler's copies of them),
and after what the decode CUDA graphs will hold. Sized this way a 7B model on an H200 gets tens of
GB of KV instead of the CPU default's 256 MiB."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epd.engine.model_runner import ModelRunner
from epd.engine.scheduler import ScheduledChunk, SchedulerOutput
from epd.engine.sequence import Sequence
from epd.types import SamplingParams

GiB = 1024**3


def kv_budget_bytes(total_bytes: int, utilization: float, peak_bytes: int, reserved_bytes: int = 0,
                    graph_bytes: int = 0) -> int:
    """What the KV cache may take: ``utilization`` of the device minus the profiled peak, what is
    reserved for others on the device (an encoder's output and cache budget: the same memory the
    encoder's rows will take, so the two budgets are planned together) and what the decode CUDA
    graphs will hold (captured after the cache is allocated)."""
    budget = int(total_bytes * utilization) - peak_bytes - reserved_bytes - graph_bytes
    if budget <= 0:
        reserved = f" and {reserved_bytes / GiB:.1f} GiB reserved for the encoder" if reserved_bytes else ""
        graphs = f", plus {graph_bytes / GiB:.1f} GiB for the decode CUDA graphs (--enforce-eager: none)" \
            if graph_bytes else ""
        raise ValueError(f"gpu_memory_utilization={utilization} of {total_bytes / GiB:.1f} GiB leaves nothing for "
                         f"the KV cache: weights and one step's activations peak at {peak_bytes / GiB:.1f} GiB"
                         f"{reserved}{graphs}; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def decode_graph_bytes(config, activation_bytes: int) -> int:
    """What the decode CUDA graphs hold for good once captured: their memory pool (the activations
    of the largest bucket's decode step, at most one profiled step's) and their shared split-KV
    workspace. Zero where no graph is captured (not CUDA + FlashInfer, or ``enforce_eager``)."""
    from epd.engine.attention import resolve_backend
    from epd.engine.attention.flashinfer import WORKSPACE_BYTES
    from epd.engine.decode_graphs import captures_decode_graphs

    device = torch.device(config.target_device)
    backend = resolve_backend(config.attention_backend, device, config.torch_dtype)
    if config.enforce_eager or not captures_decode_graphs(device, backend):
        return 0
    return activation_bytes + WORKSPACE_BYTES


@dataclass(frozen=True)
class ProfiledStep:
    """What the worst-case step ran: ``num_seqs`` prompts of ``tokens_each`` tokens, each sampling."""

    num_seqs: int
    tokens_each: int
    logits_shape: tuple[int, ...]  # [num_seqs, vocab]: one row per sequence, as the sampler sees them


def profile_step(model: torch.nn.Module, config, mm_token_ids: tuple[int, ...] = ()) -> ProfiledStep:
    """Run the worst-case step once on a KV cache just big enough for it (then dropped)."""
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    tokens_each = max(1, config.max_num_batched_tokens // num_seqs)
    blocks_each = math.ceil(tokens_each / config.block_size)
    runner = ModelRunner(model, num_blocks=num_seqs * blocks_each, block_size=config.block_size,
                         device=config.target_device, dtype=config.torch_dtype,
                         attention_backend=config.attention_backend, mm_token_ids=mm_token_ids)
    chunks = []
    for i in range(num_seqs):
        seq = Sequence([0] * tokens_each, SamplingParams(max_tokens=1))
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
        chunks.append(ScheduledChunk(seq, 0, tokens_each))
    logits, _ = runner.execute(SchedulerOutput(chunks=chunks))
    torch.softmax(logits.float(), dim=-1).cumsum_(dim=-1)  # the sampler's [seqs, vocab] float32 copies
    profiled = ProfiledStep(num_seqs, tokens_each, tuple(logits.shape))
    del runner, logits
    return profiled


def kv_blocks_for_device_memory(model: torch.nn.Module, config, bytes_per_token: int,
                                mm_token_ids: tuple[int, ...] = ()) -> int:
    """KV blocks that fit ``config.gpu_memory_utilization`` of the (CUDA) device."""
    device = torch.device(config.target_device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    profile_step(model, config, mm_token_ids)
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    budget = kv_budget_bytes(total_bytes, config.gpu_memory_utilization, peak_bytes, config.reserved_device_bytes,
                             decode_graph_bytes(config, peak_bytes - weights_bytes))
    free_bytes, _ = torch.cuda.mem_get_info(device)
    if budget > free_bytes:  # another process holds part of the fraction asked for
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} asks {budget / GiB:.1f} GiB for the "
                         f"KV cache but only {free_bytes / GiB:.1f} GiB of the GPU are free (other processes use "
                         f"it); lower gpu_memory_utilization")
    return max(1, budget // (bytes_per_token * config.block_size))


def check_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int, utilization: float) -> None:
    """A KV cache sized from the device must hold one sequence of ``max_model_len``, or the engine
    would take requests it can never run: refused at start, naming both numbers (vLLM's check)."""
    tokens = num_blocks * block_size
    if tokens < max_model_len:
        raise ValueError(f"the KV cache holds {tokens} tokens (gpu_memory_utilization {utilization}), fewer than "
                         f"one sequence of max_model_len {max_model_len}: lower --max-model-len to {tokens} or "
                         "less, or raise --gpu-memory-utilization")


def with_model_len(config, model_dir):
    """``config`` with its ``max_model_len`` decided where the model runs: as given; unset on CUDA,
    the checkpoint's ``max_position_embeddings`` (vLLM's default: the KV cache, sized from the
    device, is then checked to hold one such sequence); unset on the CPU, the default (4096: a KV
    cache of ``kv_cache_bytes`` would rarely hold a checkpoint's whole length)."""
    if "max_model_len" in config.model_fields_set or not config.target_device.startswith("cuda"):
        return config
    from epd.models.checkpoint import read_config

    hf_config = read_config(model_dir)
    length = {**hf_config, **hf_config.get("text_config", {})}.get("max_position_embeddings")
    return config.model_copy(update={"max_model_len": int(length)}) if length else config
