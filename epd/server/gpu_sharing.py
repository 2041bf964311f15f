"""Workers that share one GPU (``epd serve`` on one host): each LLM engine (prefill, decode) sizes
its KV cache from ``gpu_memory_utilization`` of the *whole* device, so co-located workers would each
claim it all, and the second to start would find it taken. Here the launcher plans them together:
the engines on a device split its ``gpu_memory_utilization`` equally, and leave free between them
what the encoders on it will hold (their output and cache budget, read from the checkpoint's
files), so encoder rows and KV blocks come out of one planned budget rather than an OOM under load.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from epd.config import DEFAULT_GPU_MEMORY_UTILIZATION

LLM_TIERS = ("prefill", "decode")


def rank_devices(device: str) -> list[str]:
    """A worker's devices, one per tensor-parallel rank: ``cuda:0,1`` -> [cuda:0, cuda:1]; a
    one-rank worker's ``--device`` as it is."""
    kind, _, indices = device.partition(":")
    return [f"{kind}:{index}" for index in indices.split(",")] if "," in indices else [device]


def device_args(device: str) -> tuple[str, ...]:
    """The flags that put a worker on ``device`` (``ServeConfig.devices``): its ``--device`` and,
    for a tensor-parallel worker, each rank's (``--tensor-parallel-devices``)."""
    ranks = rank_devices(device)
    if len(ranks) == 1:
        return ("--device", device)
    return ("--device", ranks[0], "--tensor-parallel-devices", ",".join(d.partition(":")[2] for d in ranks))


def devices_of(devices: Sequence[str] | None, index: int, default: str) -> list[str]:
    """The CUDA devices worker ``index`` of a tier runs on (``cuda:N``, one per rank), none for the
    CPU. ``auto`` counts as ``cuda:0``: where there is no GPU, gpu_memory_utilization is not used
    anyway."""
    device = devices[index % len(devices)] if devices else default
    if device == "cpu":
        return []
    if device in ("auto", "cuda"):
        return ["cuda:0"]
    return rank_devices(device)


def planned_utilization(engine, devices: Mapping[str, Sequence[str]]) -> float | None:
    """The ``gpu_memory_utilization`` the engines will size their KV caches from: the one given, or
    the default the engine takes on CUDA when no KV size is given (``EngineConfig``), where this
    host has a GPU for them; None: their KV caches are ``kv_cache_bytes``."""
    if engine.gpu_memory_utilization is not None:
        return engine.gpu_memory_utilization
    if engine.kv_size_given or engine.device == "cpu":
        return None
    on_gpus = engine.device.startswith("cuda") or any(devices.get(tier) for tier in LLM_TIERS)
    return DEFAULT_GPU_MEMORY_UTILIZATION if on_gpus or _cuda_here() else None


def _cuda_here() -> bool:
    """This host has a CUDA device for ``auto`` (torch is asked only where a driver is present)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not os.path.exists("/dev/nvidiactl"):
        return False
    import torch
    return torch.cuda.is_available()


def shared_gpu_args(counts: Mapping[str, int], devices: Mapping[str, Sequence[str]], worker_config,
                    model_dir: str | Path) -> dict[tuple[str, int], tuple[str, ...]]:
    """Flags per worker ``(tier, index)`` for the engines that share a GPU with other workers."""
    utilization = planned_utilization(worker_config.engine, devices)
    if utilization is None:
        return {}
    placed: dict[str, list[tuple[str, int]]] = {}
    for tier, count in counts.items():
        default = getattr(worker_config, "engine" if tier in LLM_TIERS else "encoder").device
        for index in range(count):
            for device in devices_of(devices.get(tier), index, default):
                placed.setdefault(device, []).append((tier, index))
    # each engine's share: on the device it shares with the most (a tensor-parallel engine's ranks
    # all size their KV caches from the same fraction, so the most crowded device decides)
    shares: dict[tuple[str, int], tuple[float, int]] = {}
    for workers in placed.values():
        engines = [w for w in workers if w[0] in LLM_TIERS]
        encoders = [w for w in workers if w[0] == "encoder"]
        if not engines or len(workers) == 1:
            continue
        reserved = len(encoders) * _encoder_cache_bytes(model_dir, worker_config.encoder) if encoders else 0
        for worker in engines:
            fraction, reserve = utilization / len(engines), math.ceil(reserved / len(engines))
            before = shares.get(worker, (fraction, reserve))
            shares[worker] = (min(before[0], fraction), max(before[1], reserve))
    return {worker: ("--gpu-memory-utilization", f"{fraction:.6g}", "--reserved-device-bytes", str(reserve))
            for worker, (fraction, reserve) in shares.items()}


def _encoder_cache_bytes(model_dir: str | Path, encoder_config) -> int:
    from epd.encoder.engine import output_budgets_for

    return output_budgets_for(model_dir, encoder_config)[1]
