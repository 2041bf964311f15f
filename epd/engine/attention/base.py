"""The attention backend protocol and its registry.

A backend is planned once per step (``plan``: whatever it derives from the page metadata, built
once rather than per layer) and then called once per layer (``forward``). Every backend writes the
new tokens' K/V into the cache first and then attends over the paged cache of each sequence.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from epd.engine.attention.metadata import AttentionMetadata, KVCache
from epd.registry import Registry


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend may need to know of the model before the first step (kernels that plan
    per step are planned for these shapes and this dtype)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


class AttentionBackend(Protocol):
    # whether ``plan`` reads the CSR page list (``kv_indices``): built only for a backend that
    # does (or for tensor-parallel ranks, whose step carries it): 0.11 -> 0.035 ms at 256 x 4,000
    reads_page_list: bool

    def __init__(self, spec: AttentionSpec) -> None: ...

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step, before the first layer: derive this backend's per-step inputs."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (new tokens) -> [T, H, D]."""


ATTENTION_BACKENDS: Registry[type] = Registry("attention backend")
AUTO = "auto"


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its attention kernels' query/KV types


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """``auto``: FlashInfer on CUDA where it is installed and the model runs in fp16 / bf16 (its
    kernels have no float32 form), else SDPA (the CPU's fastest here, and the reference). ``flex``
    stays opt-in on CUDA until a GPU run has measured it."""
    if name != AUTO:
        return name
    if torch.device(device).type == "cuda" and dtype in FLASHINFER_DTYPES \
            and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "sdpa"
