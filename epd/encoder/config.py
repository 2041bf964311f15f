"""Configuration of one encoder worker, frozen and checked on construction.

Budgets (seed §4.1), each in its own unit:
  (A) ``encoder_batch_size``      atomic MM items per encoder batch;
  (B) ``encoder_max_num_tokens``  encoder attention tokens per batch (raised to the largest item);
  (C) ``output_budget_bytes``     output bytes of one encoder iteration, or ``max_output_rows``
                                  rows of it; default: the rows (B) can produce;
  (D) ``encoder_cache_max_bytes`` the reuse cache, >= (C): the same pool, grown; default (C).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class EncoderConfig:
    encoder_batch_size: int = 32
    encoder_max_num_tokens: int = 16384
    output_budget_bytes: int | None = None
    max_output_rows: int | None = None
    encoder_cache_max_bytes: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # (total_tokens, num_contexts) per captured CUDA graph; empty: the encoder runs eager
    cuda_graph_buckets: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("encoder_batch_size", "encoder_max_num_tokens"):
            self._check_positive(name, getattr(self, name))
        for name in ("output_budget_bytes", "max_output_rows", "encoder_cache_max_bytes"):
            if getattr(self, name) is not None:
                self._check_positive(name, getattr(self, name))
        if self.output_budget_bytes is not None and self.max_output_rows is not None:
            raise ValueError(
                "EncoderConfig: give output_budget_bytes or max_output_rows, not both "
                f"(got {self.output_budget_bytes} bytes and {self.max_output_rows} rows)"
            )
        if (self.output_budget_bytes is not None and self.encoder_cache_max_bytes is not None
                and self.encoder_cache_max_bytes < self.output_budget_bytes):
            raise ValueError(
                f"EncoderConfig.encoder_cache_max_bytes={self.encoder_cache_max_bytes} must be >= "
                f"output_budget_bytes={self.output_budget_bytes}: one iteration's outputs live in the cache"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"EncoderConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"EncoderConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "cuda_graph_buckets", self._checked_buckets(self.cuda_graph_buckets))

    @staticmethod
    def _check_positive(name: str, value: object) -> None:
        if not _is_positive_int(value):
            raise ValueError(f"EncoderConfig.{name} must be a positive int, got {value!r}")

    def _checked_buckets(self, buckets) -> tuple[tuple[int, int], ...]:
        # YAML gives lists; store tuples so the config stays hashable
        checked = []
        for bucket in buckets or ():
            pair = tuple(bucket) if isinstance(bucket, (list, tuple)) else (bucket,)
            if len(pair) != 2 or not all(_is_positive_int(v) for v in pair):
                raise ValueError(
                    "EncoderConfig.cuda_graph_buckets entries must be (total_tokens, num_contexts) "
                    f"pairs of positive ints, got {bucket!r}"
                )
            if pair[0] < pair[1]:
                raise ValueError(
                    f"EncoderConfig.cuda_graph_buckets entry {pair}: total_tokens must be >= num_contexts "
                    "(every context holds at least one token)"
                )
            checked.append(pair)
        if len(set(checked)) != len(checked):
            raise ValueError(f"EncoderConfig.cuda_graph_buckets has duplicates: {checked}")
        if checked and not self.device.startswith("cuda"):
            raise ValueError(
                f"EncoderConfig.cuda_graph_buckets needs a CUDA device, got device={self.device!r}"
            )
        return tuple(checked)

    @property
    def torch_dtype(self):
        import torch  # keep the config importable without torch
        return getattr(torch, self.dtype)
