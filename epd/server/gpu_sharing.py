"""Workers that share one GPU (``epd serve`` on one host): each LLM engine (prefill, decode) sizes
its KV cache from ``gpu_memory_utilization`` of the *whole* device, so co-located workers would each
claim it all, and the second to start would find it taken. Here the launcher plans them together:
the engines on a device split its ``gpu_memory_utilization`` equally, and leave free between them
what the encoders on it will hold (their output and cache budget, read from the checkpoint's
files), so encoder rows and KV blocks come out of one planned budget rather than an OOM under load.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

LLM_TIERS = ("prefill", "decode")


def device_of(devices: Sequence[str] | None, index: int, default: str) -> str | None:
    """The CUDA device worker ``index`` of a tier runs on (``cuda:N``), None for the CPU. ``auto``
    counts as ``cuda:0``: where there is no GPU, gpu_memory_utilization is not used anyway."""
    device = devices[index % len(devices)] if devices else default
    if device == "cpu":
        return None
    if device in ("auto", "cuda"):
        return "cuda:0"
    return device


def shared_gpu_args(counts: Mapping[str, int], devices: Mapping[str, Sequence[str]], worker_config,
                    model_dir: str | Path) -> dict[tuple[str, int], tuple[str, ...]]:
    """Flags per worker ``(tier, index)`` for the engines that share a GPU with other workers."""
    utilization = worker_config.engine.gpu_memory_utilization
    if utilization is None:
        return {}
    placed: dict[str, list[tuple[str, int]]] = {}
    for tier, count in counts.items():
        default = getattr(worker_config, "engine" if tier in LLM_TIERS else "encoder").device
        for index in range(count):
            device = device_of(devices.get(tier), index, default)
            if device is not None:
                placed.setdefault(device, []).append((tier, index))
    args: dict[tuple[str, int], tuple[str, ...]] = {}
    for workers in placed.values():
        engines = [w for w in workers if w[0] in LLM_TIERS]
        encoders = [w for w in workers if w[0] == "encoder"]
        if not engines or len(workers) == 1:
            continue
        reserved = len(encoders) * _encoder_cache_bytes(model_dir, worker_config.encoder) if encoders else 0
        for worker in engines:
            args[worker] = ("--gpu-memory-utilization", f"{utilization / len(engines):.6g}",
                            "--reserved-device-bytes", str(math.ceil(reserved / len(engines))))
    return args


def _encoder_cache_bytes(model_dir: str | Path, encoder_config) -> int:
    from epd.encoder.engine import output_budgets_for

    return output_budgets_for(model_dir, encoder_config)[1]
