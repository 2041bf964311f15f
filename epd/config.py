"""Frozen configuration dataclasses, validated on construction, loadable from YAML.

One dataclass per concern; tiers (later) compose these rather than redefine fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

MiB = 1024 * 1024
C = TypeVar("C")

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """The LLM engine: paged KV cache, continuous batching, chunked prefill, prefix caching."""

    block_size: int = 16
    kv_cache_bytes: int = 256 * MiB
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    attention_backend: str = "sdpa"
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def torch_dtype(self):
        import torch  # keep config importable without paying for torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def resolve_num_blocks(self, bytes_per_token: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, self.kv_cache_bytes // (bytes_per_token * self.block_size))


@dataclass(frozen=True)
class WorkerConfig:
    """One tier process: what it serves, where, and how it hands tensors on."""

    model: str = "tiny-qwen2-vl"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port and print it in the ready line
    engine: EngineConfig = EngineConfig()
    transport: str = ""  # "" = automatic (shm on one host); "inline", "shm", "cuda_ipc", "nccl"
    lease_ttl_s: float = 60.0
    request_timeout_s: float = 120.0
    max_workers: int = 32  # gRPC handler threads
    metrics_port: int = 0  # Prometheus /metrics over HTTP; 0 picks a free port (in the ready line)
    overlap_prefill_with_encode: bool = True  # prefill: compute text before images while encoding
    # encoder tier only: EncoderConfig fields (epd/encoder/config.py), validated by that tier
    encoder: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"WorkerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("lease_ttl_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        if isinstance(self.engine, dict):
            object.__setattr__(self, "engine", from_dict(EngineConfig, self.engine))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RouterConfig:
    """Admission limits, routing policies and health checking of the router."""

    model: str = "tiny-qwen2-vl"
    encoders: tuple[str, ...] = ()
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    max_model_len: int = 4096
    max_items_per_request: int = 16
    encoder_output_budget_bytes: int | None = None  # None: 4096 embedding rows (the encoder default)
    encoder_max_item_tokens: int | None = None  # encoder attention tokens of one image; None: no extra cap
    max_concurrent_requests: int = 64  # in flight on the tiers
    max_queued_requests: int = 256  # waiting for a slot; beyond this: 429 at once
    queue_timeout_s: float = 10.0  # waiting longer than this: 429
    request_timeout_s: float = 300.0
    health_period_s: float = 1.0
    encoder_policy: str = "hash_affinity"
    prefill_policy: str = "prefix_affinity"
    decode_policy: str = "least_loaded"
    transport: str = ""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_items_per_request", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "request_timeout_s", "health_period_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"RouterConfig.max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in ("encoders", "prefills", "decodes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


def from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
    """Build a config dataclass from a mapping, rejecting unknown keys by name."""
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; expected some of {sorted(known)}")
    return cls(**data)


def load_yaml(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
