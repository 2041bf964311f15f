"""The LLM engine's settings (prefill and decode workers, ``epd.LLM``, ``--aggregated``)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from epd.config.base import FrozenConfig, MiB, ModelDevice, ModelDtype, OnDevice, PositiveInt, cuda_indices

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's, on a device whose KV cache size nobody gave


class EngineConfig(FrozenConfig, OnDevice):
    """The LLM engine: paged KV cache, continuous batching, chunked prefill, prefix caching."""

    block_size: PositiveInt = Field(16, description="tokens per KV block")
    kv_cache_bytes: PositiveInt = Field(256 * MiB, description="KV cache size in bytes")
    num_kv_blocks: PositiveInt | None = Field(None, description="KV blocks (overrides kv_cache_bytes)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="on CUDA: size the KV cache to this fraction of the GPU's memory minus the "
                                      "weights and a profiled worst-case step (vLLM's meaning; overrides "
                                      "kv_cache_bytes and num_kv_blocks; unset on CUDA without either: 0.9, as "
                                      "vLLM's default)")
    reserved_device_bytes: NonNegativeInt = Field(
        0, description="with gpu_memory_utilization: bytes of the GPU the KV cache leaves to others on it (an "
                       "encoder's output and cache budget; epd serve and epd.LLM fill it in)")
    max_num_seqs: PositiveInt = Field(64, description="sequences running at once")
    max_num_batched_tokens: PositiveInt = Field(2048, description="tokens per engine step (prefill chunk budget)")
    max_model_len: PositiveInt = Field(4096, description="prompt + output tokens of one request (unset on CUDA: the "
                                                         "checkpoint's max_position_embeddings, as vLLM)")
    enable_prefix_caching: bool = Field(True, description="reuse KV of shared prompt prefixes")
    enforce_eager: bool = Field(False, description="never replay decode steps from CUDA graphs (vLLM's flag)")
    async_scheduling: bool = Field(
        False, description="schedule and launch each engine step before the last one's tokens reach the host: on "
                           "a GPU the host's work of a step (scheduling, inputs, output bookkeeping) then overlaps "
                           "the device's (vLLM's flag). Decode workers and the in-process engine; a prefill worker "
                           "samples one token a request and hands its KV over at once, so it steps in order")
    tensor_parallel_size: PositiveInt = Field(
        1, description="ranks the LLM is cut into, one process each, each with a KV cache of the same pages "
                       "(its heads); gloo on the CPU, NCCL between CUDA devices (one device per rank)",
        json_schema_extra={"aliases": ["-tp"]})
    tensor_parallel_devices: tuple[str, ...] = Field(
        (), description="on CUDA: the device index of each tensor-parallel rank, rank 0's first (default: "
                        "consecutive from --device's, as vLLM takes the visible devices in order)")
    cuda_graph_batch_sizes: tuple[PositiveInt, ...] = Field(
        (), description="decode batch sizes captured as CUDA graphs, on CUDA with attention_backend flashinfer "
                        "(empty: 1, 2, 4, then every multiple of 8 up to max_num_seqs, at most 256)")
    attention_backend: Literal["auto", "sdpa", "flex", "flashinfer"] = Field(
        "auto", description="attention backend: auto (flashinfer on CUDA where installed for a bf16 / fp16 model, "
                            "else sdpa), sdpa (the "
                            "reference), flex (flex_attention over the paged cache in place) or flashinfer (CUDA)")
    dtype: ModelDtype = "auto"
    device: ModelDevice = "auto"
    num_threads: PositiveInt | None = Field(
        None, description="intra-op CPU threads of this engine (default: usable cores minus the process's busy "
                          "threads; env EPD_NUM_THREADS)")

    @field_validator("tensor_parallel_devices", mode="before")
    @classmethod
    def _device_indices(cls, value: Any) -> Any:
        return cuda_indices(value, "0,1 (one per rank)")

    @model_validator(mode="after")
    def _one_device_per_rank(self) -> "EngineConfig":
        devices = self.tensor_parallel_devices
        if devices and len(devices) != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_devices {','.join(map(str, devices))} names {len(devices)} device(s) "
                             f"for tensor_parallel_size {self.tensor_parallel_size}: give one per rank")
        if len(set(devices)) != len(devices):
            raise ValueError(f"tensor_parallel_devices {','.join(map(str, devices))}: two ranks on one device "
                             "(NCCL refuses it); give distinct devices")
        if devices and self.device == "cpu":
            raise ValueError("tensor_parallel_devices are CUDA devices, but device is cpu")
        if devices and self.device.startswith("cuda:") and self.device != f"cuda:{devices[0]}":
            raise ValueError(f"device {self.device} but tensor_parallel_devices {','.join(map(str, devices))}: rank "
                             f"0 runs on the first of them; give device cuda:{devices[0]} or leave it out")
        if devices and self.device in ("auto", "cuda"):  # rank 0 is this process: its device is the first
            object.__setattr__(self, "device", f"cuda:{devices[0]}")
        return self

    @model_validator(mode="after")
    def _graphs_need_one_rank(self) -> "EngineConfig":
        if self.cuda_graph_batch_sizes and self.tensor_parallel_size > 1:
            raise ValueError(f"cuda_graph_batch_sizes {','.join(map(str, self.cuda_graph_batch_sizes))} with "
                             f"tensor_parallel_size {self.tensor_parallel_size}: a tensor-parallel worker's decode "
                             "steps run eager (no CUDA graphs across ranks yet); leave cuda_graph_batch_sizes unset")
        return self

    def rank_device(self, rank: int) -> str:
        """The device tensor-parallel rank ``rank`` runs on: the CPU for every rank on the CPU; on
        CUDA its entry of ``tensor_parallel_devices``, else rank 0's index + ``rank``."""
        device = self.target_device
        if not device.startswith("cuda"):
            return device
        if self.tensor_parallel_devices:
            return f"cuda:{self.tensor_parallel_devices[rank]}"
        first = int(device.partition(":")[2] or 0)
        return f"cuda:{first + rank}"

    @property
    def kv_gpu_memory_utilization(self) -> float | None:
        """The fraction of the GPU the KV cache is sized from: the one given; on CUDA with no KV size
        given (kv_cache_bytes, num_kv_blocks), vLLM's default 0.9 (the KV cache takes what the device
        has, not 256 MiB); otherwise None: the KV cache is kv_cache_bytes. Decided where the model
        runs (``target_device``)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        if self.target_device.startswith("cuda") and not self.kv_size_given:
            return DEFAULT_GPU_MEMORY_UTILIZATION
        return None

    @property
    def kv_size_given(self) -> bool:
        """kv_cache_bytes or num_kv_blocks was set (not left at its default)."""
        return bool({"kv_cache_bytes", "num_kv_blocks"} & self.model_fields_set)

    def resolve_num_blocks(self, bytes_per_token: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, self.kv_cache_bytes // (bytes_per_token * self.block_size))
