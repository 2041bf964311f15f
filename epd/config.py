"""The one configuration tree, typed and validated once (pydantic), from YAML, flags or Ray values:

    ServeConfig           epd serve: what to start, plus
      RouterConfig        the router: workers, admission limits, routing, media policy, listeners
      WorkerConfig        every tier process: where it serves and how it hands tensors on, plus
        EngineConfig      the LLM engine of prefill and decode
        EncoderConfig     the encoder's budgets and cache
        TlsConfig         mutual TLS between EPD's processes (the router has one too)
    RayDeployment         epd serve --launcher ray: per-tier TierSpec (replicas, resources, WorkerConfig)

Configs are frozen. A wrong key, type or value anywhere is a ``ConfigError`` with one line naming
the key, what was expected and what came (``load_config``), never a traceback.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    field_validator,
    model_validator,
)

MiB = 1024 * 1024
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's, on a device whose KV cache size nobody gave
C = TypeVar("C", bound=BaseModel)

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_device(value: str) -> str:
    if not _DEVICE_PATTERN.fullmatch(value):
        raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return value


def resolve_device(device: str) -> str:
    """``auto``: this process's CUDA device when it has one, else the CPU. Resolved where the
    model runs (a launcher without a GPU must not decide for a worker with one)."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA, float32 on the CPU (where bf16 matmuls are slow)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"


def cuda_indices(value: Any, example: str) -> Any:
    """CUDA device indices, comma-separated or a list, as a tuple of digit strings (the flags' form)."""
    indices = [a.strip() for a in value.split(",") if a.strip()] if isinstance(value, str) else value
    for index in indices or ():
        if not str(index).isdigit():
            raise ValueError(f"expected CUDA device indices like {example}, got {value!r}")
    return tuple(str(i) for i in indices or ())


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # YAML's yes/no must not pass as 1/0
        raise ValueError(f"expected an integer, got {value!r}")
    return value


# vLLM's spellings too (--dtype half / float), as the names torch gives them
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
Dtype = Annotated[Literal["auto", "float32", "bfloat16", "float16"],
                  BeforeValidator(lambda value: _DTYPE_ALIASES.get(value, value))]
Device = Annotated[str, AfterValidator(_check_device)]
PositiveInt = Annotated[int, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming key, expected and value."""


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _integers_are_not_booleans(cls, value: Any, info) -> Any:
        annotation = str(cls.model_fields[info.field_name].annotation)
        return _no_bool(value) if "int" in annotation and "bool" not in annotation else value


def _torch_dtype(name: str):
    import torch  # keep configs importable without paying for torch
    return getattr(torch, name)


class EngineConfig(_Config):
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
    dtype: Dtype = Field("auto", description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    device: Device = Field("auto", description="auto (CUDA when this process has it, else CPU), cpu, cuda or cuda:N")
    num_threads: PositiveInt | None = Field(
        None, description="intra-op CPU threads of this engine (default: usable cores minus the process's busy "
                          "threads; env EPD_NUM_THREADS)")

    @property
    def target_device(self) -> str:
        return resolve_device(self.device)

    @property
    def torch_dtype(self):
        return _torch_dtype(resolve_dtype(self.dtype, self.device))

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


class EncoderConfig(_Config):
    """One encoder worker's budgets, each in its own unit:
      (A) ``encoder_batch_size``      atomic items per encoder batch;
      (B) ``encoder_max_num_tokens``  encoder attention tokens per batch (raised to the largest item);
      (C) ``output_budget_bytes``     output bytes of one iteration, or ``max_output_rows`` rows of it;
                                      default: the rows (B) can produce;
      (D) ``encoder_cache_max_bytes`` the reuse cache, >= (C): the same pool, grown; default (C).
    """

    encoder_batch_size: PositiveInt = Field(32, description="items per encoder batch")
    encoder_max_num_tokens: PositiveInt = Field(16384, description="encoder attention tokens per batch")
    output_budget_bytes: PositiveInt | None = Field(None, description="output bytes of one encoder iteration")
    max_output_rows: PositiveInt | None = Field(None, description="output rows of one encoder iteration")
    encoder_cache_max_bytes: PositiveInt | None = Field(None, description="encoder cache size in bytes")
    dtype: Dtype = Field("auto", description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    device: Device = Field("auto", description="auto (CUDA when this process has it, else CPU), cpu, cuda or cuda:N")
    cuda_graph_buckets: tuple[tuple[PositiveInt, PositiveInt], ...] = Field(
        (), description="(total_tokens, num_contexts) per captured CUDA graph; empty: eager")
    num_threads: PositiveInt | None = Field(
        None, description="intra-op CPU threads of this encoder (default: usable cores; env EPD_NUM_THREADS)")
    encoder_cache_store: Literal["local", "mooncake"] = Field(
        "local", description="local: each encoder's own cache; mooncake: also a Mooncake Store that every encoder "
                             "of the cluster shares (epd serve starts one on 127.0.0.1 unless --mooncake-master "
                             "names one)")
    mooncake_master: str | None = Field(None, description="HOST:PORT of the Mooncake master of the encoder cache "
                                                          "store")
    encoder_cache_claim_ttl_s: float = Field(
        10.0, gt=0, description="with the store: how long an encoder's claim on a new item holds off other "
                                "encoders (they wait for its result); a claimant that dies is taken over after it")
    mooncake_metadata_server: str = Field(
        "P2PHANDSHAKE", description="Mooncake's metadata service: P2PHANDSHAKE (none: peers exchange it), or an "
                                    "http:// or etcd:// address")
    mooncake_protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transfers: tcp, or rdma where "
                                                                         "the hosts have it")
    mooncake_device_names: str = Field("", description="RDMA devices for mooncake_protocol rdma (e.g. mlx5_0)")

    @field_validator("mooncake_master")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _budgets_agree(self) -> "EncoderConfig":
        if self.output_budget_bytes is not None and self.max_output_rows is not None:
            raise ValueError(f"give output_budget_bytes or max_output_rows, not both (got "
                             f"{self.output_budget_bytes} bytes and {self.max_output_rows} rows)")
        if (self.output_budget_bytes is not None and self.encoder_cache_max_bytes is not None
                and self.encoder_cache_max_bytes < self.output_budget_bytes):
            raise ValueError(f"encoder_cache_max_bytes={self.encoder_cache_max_bytes} must be >= "
                             f"output_budget_bytes={self.output_budget_bytes}: one iteration's outputs live in the cache")
        buckets = self.cuda_graph_buckets
        for total_tokens, num_contexts in buckets:
            if total_tokens < num_contexts:
                raise ValueError(f"cuda_graph_buckets entry {(total_tokens, num_contexts)}: total_tokens must be >= "
                                 f"num_contexts (every context holds at least one token)")
        if len(set(buckets)) != len(buckets):
            raise ValueError(f"cuda_graph_buckets has duplicates: {list(buckets)}")
        if buckets and self.device == "cpu":
            raise ValueError(f"cuda_graph_buckets needs a CUDA device, got device={self.device!r}")
        return self

    @property
    def target_device(self) -> str:
        return resolve_device(self.device)

    @property
    def torch_dtype(self):
        return _torch_dtype(resolve_dtype(self.dtype, self.device))


class TlsConfig(_Config):
    """Mutual TLS between EPD's own processes (router, encoder, prefill, decode): every internal gRPC
    server asks for a client certificate signed by ``tls_ca`` and every internal channel presents
    ``tls_cert``. The same block, the same files, on every process (one Secret in the chart)."""

    tls_cert: str | None = Field(None, description="PEM certificate this process presents to its peers (mutual TLS "
                                                   "between router and tiers; needs tls_key and tls_ca)")
    tls_key: str | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: str | None = Field(None, description="PEM CA bundle: a peer whose certificate it did not sign is refused")
    tls_server_name: str | None = Field(None, description="name to check in a worker's certificate instead of its "
                                                          "address (one certificate for every pod)")

    @field_validator("tls_cert", "tls_key", "tls_ca")
    @classmethod
    def _readable_pem(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"expected a readable PEM file, got {value!r} (no such file)")
        return value

    @model_validator(mode="after")
    def _all_or_none(self) -> "TlsConfig":
        given = {name: getattr(self, name) is not None for name in ("tls_cert", "tls_key", "tls_ca")}
        if any(given.values()) and not all(given.values()):
            missing = sorted(name for name, ok in given.items() if not ok)
            raise ValueError(f"mutual TLS needs tls_cert, tls_key and tls_ca together; missing {missing}")
        if self.tls_server_name is not None and not self.enabled:
            raise ValueError("tls_server_name applies only with tls_cert, tls_key and tls_ca")
        return self

    @property
    def enabled(self) -> bool:
        return self.tls_cert is not None


class WorkerConfig(_Config):
    """One tier process: what it serves, where, and how it hands tensors on."""

    model: str = Field("tiny-qwen2-vl", description="preset name or Hugging Face checkpoint directory")
    served_model_name: tuple[str, ...] = Field((), description="the name(s) clients send as `model` (default: "
                                                               "--model); any other is a 404")
    host: str = Field("127.0.0.1", description="address the worker binds and advertises")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="what this process logs")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object a line (for "
                                                                     "log collectors)")
    port: Port = Field(0, description="gRPC port (0: a free one, printed in the ready line)")
    engine: EngineConfig = EngineConfig()
    encoder: EncoderConfig = EncoderConfig()
    transport: str = Field("", description="inline | shm | cuda_ipc | nccl (empty: chosen per pair)")
    host_id: str = Field("", description="the host this worker shares memory with (equal ids: shm / CUDA IPC "
                                         "between them; empty: this machine's hostname and boot id)")
    lease_ttl_s: float = Field(60.0, gt=0, description="seconds an exported tensor is kept for its consumer")
    request_timeout_s: float = Field(120.0, gt=0, description="longest wait for one request (bounds the caller's "
                                                                "deadline too)")
    max_requests: PositiveInt = Field(1024, description="requests a worker holds at once, queued or running; "
                                                        "beyond: RESOURCE_EXHAUSTED with a retry hint")
    max_imported_bytes: PositiveInt = Field(4 * 1024**3, description="bytes of other workers' tensors held for "
                                            "queued requests (embeddings at prefill, KV at decode); beyond: "
                                            "RESOURCE_EXHAUSTED with a retry hint")
    io_threads: PositiveInt = Field(8, description="threads for blocking transfer work (imports, exports, lease "
                                                   "calls); requests in flight cost no thread")
    metrics_port: Port = Field(0, description="Prometheus /metrics port (0: a free one)")
    stream_port: Port = Field(0, description="decode: TCP port of the routers' token streams (0: a free one; its "
                                             "health answer tells routers which)")
    drain_timeout_s: float = Field(25.0, ge=0, description="on SIGTERM: take no new request (health says DRAINING) "
                                                           "and wait this long for the held ones before stopping "
                                                           "(below Kubernetes' terminationGracePeriodSeconds)")
    overlap_prefill_with_encode: bool = Field(True, description="prefill text before images while encoding",
                                              json_schema_extra={"flag": "overlap"})
    tls: TlsConfig = TlsConfig()

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [a for a in value.split(",") if a] if isinstance(value, str) else value

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def public_model_name(self) -> str:
        """The name its metrics carry as ``model_name``: the router's, so one label joins both."""
        return self.served_model_name[0] if self.served_model_name else self.model


class RouterConfig(_Config):
    """The router: its workers, admission limits, routing policies, media policy and listeners."""

    model: str = Field("tiny-qwen2-vl", description="preset name or Hugging Face checkpoint directory")
    served_model_name: tuple[str, ...] = Field((), description="the name(s) clients send as `model` (default: "
                                                               "--model); any other is a 404")
    encoders: tuple[str, ...] = Field((), description="encoder addresses (host:port)")
    prefills: tuple[str, ...] = Field((), description="prefill addresses (host:port)")
    decodes: tuple[str, ...] = Field((), description="decode addresses (host:port)")
    encoder_service: str | None = Field(None, description="a name (host:port) whose addresses are the encoders, e.g. "
                                                          "a Kubernetes headless Service: resolved every "
                                                          "discovery_period_s, new ones added, gone ones drained")
    prefill_service: str | None = Field(None, description="as encoder_service, for prefill workers")
    decode_service: str | None = Field(None, description="as encoder_service, for decode workers")
    discovery_period_s: float = Field(5.0, gt=0, description="seconds between lookups of the *_service names")
    shutdown_grace_s: float = Field(25.0, ge=0, description="on SIGTERM: stop taking requests and let the streams in "
                                                            "flight finish for this long (below Kubernetes' "
                                                            "terminationGracePeriodSeconds)")
    discovery_drain_timeout_s: float = Field(60.0, gt=0, description="how long a worker that left its service may "
                                                                     "finish its requests before it is forgotten")
    host: str = Field("127.0.0.1", description="where the router listens")
    port: Port = Field(8000, description="HTTP port of the OpenAI API (0: a free one)")
    grpc_port: Port = Field(50051, description="port of the public gRPC API (0: a free one)")
    http_fd: NonNegativeInt | None = Field(
        None, description="serve HTTP on this listening socket, inherited from the launcher, instead of binding "
                          "--port (epd serve --routers N: one socket, bound once, every router accepting on it)")
    router_index: NonNegativeInt = Field(0, description="which of epd serve's routers this is (in /health and the "
                                                        "epd_router_info metric)")
    public_grpc: bool = Field(True, description="serve the public gRPC API on --grpc-port (with --routers N the "
                                                "first router does)")
    max_model_len: PositiveInt = Field(4096, description="prompt + output tokens of one request (unset: the "
                                                         "smallest its prefill and decode workers take, 4096 "
                                                         "until they answer)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="what this process logs")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object a line (for "
                                                                     "log collectors)")
    enable_log_requests: bool = Field(False, description="one log line when a request starts (sizes and sampling, "
                                                         "never its text or images) and one when it ends (vLLM's "
                                                         "flag)")
    disable_log_stats: bool = Field(False, description="no stats line (tokens/s, requests running and waiting per "
                                                       "tier, KV usage, encoder cache hits, moves) every "
                                                       "log_stats_interval_s")
    log_stats_interval_s: float = Field(10.0, gt=0, description="seconds between two stats lines")
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="what the router's HTTP server (uvicorn) logs; info adds one access line a request")
    generation_config: str = Field(
        "auto", description="auto: the checkpoint's generation_config.json gives the sampling fields a request leaves "
                            "unset their defaults and every EOS id it lists stops generation (vLLM's default); "
                            "vllm: OpenAI's defaults and the tokenizer's EOS only; or a folder with a "
                            "generation_config.json")
    default_max_tokens: PositiveInt | None = Field(
        None, description="max_tokens of a request that gives none (default: what max_model_len leaves after its "
                          "prompt, as vLLM)")
    max_items_per_request: PositiveInt = Field(16, description="images per request")
    max_request_body_bytes: PositiveInt = Field(100 * MiB, description="an HTTP request body beyond this is a 413, "
                                                                       "refused before it is read")
    max_messages: PositiveInt = Field(1024, description="messages per request")
    max_content_parts: PositiveInt = Field(4096, description="content parts per request, all messages together")
    max_text_chars: PositiveInt = Field(2_000_000, description="characters of text per request, all messages "
                                                               "together (checked before tokenizing)")
    encoder_output_budget_bytes: PositiveInt | None = Field(
        None, description="embedding bytes of one request (default: 4096 rows, the encoder's default)")
    encoder_max_item_tokens: PositiveInt | None = Field(None, description="encoder tokens of one image")
    max_concurrent_requests: PositiveInt = Field(256, description="requests on the tiers at once (the tiers queue "
                                                               "what they cannot compute yet)")
    max_queued_requests: int = Field(1024, ge=0, description="requests waiting for a slot; beyond: 429")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait for a slot (or for a full tier); then 429")
    request_timeout_s: float = Field(300.0, gt=0, description="deadline of a request that sets none")
    health_period_s: float = Field(1.0, gt=0, description="seconds between worker health checks")
    stall_timeout_s: float = Field(60.0, gt=0, description="a worker holding work whose progress counter stood "
                                                           "still this long leaves rotation")
    health_timeout_s: float = Field(5.0, gt=0, description="a health check not answered this long fails; "
                                                           "3 failed in a row take the worker out of rotation")
    max_migrations: int = Field(3, ge=0, description="times one request may be moved off a worker that died, "
                                                     "stalled or failed it (re-dispatched before its first token, "
                                                     "migrated mid-stream); then it fails naming the tier")
    encoder_policy: str = Field("hash_affinity", description="routing policy for encoders")
    prefill_policy: str = Field("prefix_affinity", description="routing policy for prefill")
    decode_policy: str = Field("least_loaded", description="routing policy for decode")
    decode_link: Literal["tcp", "grpc"] = Field("tcp", description="how decode workers stream tokens back: tcp (the "
                                                "TCP link a worker's health offers; gRPC when it offers none) or "
                                                "grpc (always the gRPC Stream call: only the gRPC port reachable)")
    transport: str = Field("", description="inline | shm | cuda_ipc | nccl (empty: chosen per pair)")
    prefill_store_reads: Literal["auto", "always", "never"] = Field(
        "auto", description="with the encoder cache store: items prefill reads from the store itself instead of an "
                            "encoder pushing them: auto (those no encoder on prefill's host holds), always (every "
                            "item the store has), never")
    autoscale_budget: PositiveInt | None = Field(
        None, description="the online planner (epd.plan.autoscale): at most this many workers (encoders + prefills "
                          "+ decodes); it moves and adds workers where requests wait and gives idle ones back, and its "
                          "launcher (epd serve) carries that out. Unset: off")
    autoscale_ttft_slo_s: float | None = Field(
        None, gt=0, description="with autoscale_budget: a TTFT objective (p90 of the last 30 s); missed, the tier "
                                "where requests wait most grows")
    autoscale_min_workers: PositiveInt = Field(
        1, description="with autoscale_budget: the fewest workers of each tier the planner keeps (it gives no idle "
                       "worker back below it, nor moves one away from it; KEDA's minReplicaCount)")
    autoscale_interval_s: float = Field(1.0, gt=0, description="with autoscale_budget: seconds between looks")
    autoscale_cooldown_s: float = Field(10.0, gt=0, description="with autoscale_budget: seconds after a decision "
                                                                "is carried out before the next")
    allowed_local_media_path: str | None = Field(None, description="serve file:// images only from under this directory")
    allow_private_network: bool = Field(False, description="let http(s) images come from private addresses")
    allowed_media_domains: tuple[str, ...] = Field(
        (), description="http(s) images only from these hosts or their subdomains (repeatable; default: any public "
                        "host)")
    allowed_origins: tuple[str, ...] = Field(
        (), description="browser origins allowed to call the HTTP API (CORS; '*' for any; default: none, no CORS "
                        "headers)")
    chat_template: str | None = Field(None, description="a chat template (a file, or the Jinja text itself) instead "
                                                        "of the model's")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict, description="vLLM's per-modality item limit, JSON or image=N,video=M (0 refuses the "
                                          "modality); max_items_per_request caps them together")
    mm_processor_kwargs: dict[str, int | float] = Field(
        default_factory=dict, description="how every request's images are resized and videos sampled, JSON or k=v "
                                          "(vLLM's; a request's own mm_processor_kwargs win): min_pixels / max_pixels "
                                          "(within the checkpoint's), fps, min_frames, max_frames")
    api_keys: tuple[str, ...] = Field((), description="API keys a client must send as 'Authorization: Bearer "
                                                      "<key>' (repeatable; a flag shows in ps: prefer "
                                                      "--api-key-file or the EPD_API_KEY variable)",
                                      json_schema_extra={"flag": "api_key"})
    api_key_file: str | None = Field(None, description="file with one API key per line, read again when it changes "
                                                       "(rotate keys without a restart)")
    protect_health_and_metrics: bool = Field(False, description="/health and /metrics need an API key too")
    api_key_requests_per_s: float | None = Field(None, gt=0, description="chat requests per second each API key "
                                                                         "may send on average (token bucket); "
                                                                         "beyond: 429. Off when unset")
    api_key_burst: PositiveInt = Field(10, description="chat requests an API key may send at once, on top of "
                                                       "api_key_requests_per_s")
    admin_port: Port | None = Field(None, description="port of the admin API (register and drain workers) on "
                                                       "admin_host; off when unset. Needs a token: "
                                                       "EPD_ADMIN_TOKEN or admin_token_file")
    admin_host: str = Field("127.0.0.1", description="where the admin API listens")
    admin_token_file: str | None = Field(None, description="file with the admin API's token(s), one per line")
    tls: TlsConfig = TlsConfig()  # the router's channels to its workers
    aggregated: bool = Field(False, description="no tiers: run the whole model in the router process")
    engine: EngineConfig = EngineConfig()  # the in-process engine's (with aggregated only)

    @field_validator("encoders", "prefills", "decodes", "api_keys", "served_model_name", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return [a for a in value.split(",") if a] if isinstance(value, str) else value

    @field_validator("limit_mm_per_prompt", "mm_processor_kwargs", mode="before")
    @classmethod
    def _mm_limits(cls, value: Any) -> Any:
        return parse_mapping(value)

    @model_validator(mode="after")
    def _apply_mm_limits(self) -> "RouterConfig":
        unknown = set(self.limit_mm_per_prompt) - {"image", "video"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt knows image and video, got {sorted(unknown)}")
        negative = {k: v for k, v in self.limit_mm_per_prompt.items() if v < 0}
        if negative:
            raise ValueError(f"limit_mm_per_prompt: counts must be >= 0 (0 refuses the modality), got {negative}")
        return self

    @model_validator(mode="after")
    def _autoscale_room(self) -> "RouterConfig":
        if self.autoscale_budget is not None and self.autoscale_budget < 3 * self.autoscale_min_workers:
            raise ValueError(f"autoscale_budget {self.autoscale_budget} cannot keep autoscale_min_workers "
                             f"{self.autoscale_min_workers} in each of the 3 tiers; expected at least "
                             f"{3 * self.autoscale_min_workers}")
        return self

    @field_validator("encoder_service", "prefill_service", "decode_service")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"expected host:port (a name whose addresses are the workers), got {value!r}")
        return value

    @field_validator("api_key_file", "admin_token_file")
    @classmethod
    def _readable_key_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"expected a readable file of keys, got {value!r} (no such file)")
        return value

    @model_validator(mode="after")
    def _engine_only_when_aggregated(self) -> "RouterConfig":
        if not self.aggregated and self.engine != EngineConfig():
            changed = sorted(self.engine.model_dump(exclude_defaults=True))
            raise ValueError(f"engine settings {changed} apply only with aggregated (the in-process engine); "
                             f"the tiers take them from their own worker config")
        return self


class ServeConfig(_Config):
    """``epd serve``: how many of each tier to start and how, plus the router's and the workers' own."""

    encoders: Annotated[int, Field(ge=0)] = Field(1, description="encoder processes")
    prefills: Annotated[int, Field(ge=0)] = Field(1, description="prefill processes")
    decodes: Annotated[int, Field(ge=0)] = Field(1, description="decode processes")
    encoder_gpus: tuple[str, ...] = Field((), description="CUDA device indices for the encoder workers (e.g. 0 or "
                                                          "0,1): worker i runs on cuda:<the i-th, round robin>")
    prefill_gpus: tuple[str, ...] = Field((), description="CUDA device indices for the prefill workers")
    decode_gpus: tuple[str, ...] = Field((), description="CUDA device indices for the decode workers")
    prefill_tp: PositiveInt | None = Field(
        None, description="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size)")
    decode_tp: PositiveInt | None = Field(
        None, description="tensor-parallel ranks of each decode worker (default: --tensor-parallel-size)")
    threads_per_tier: PositiveInt | None = Field(
        None, description="intra-op threads of each tier process (default: the host's cores split between them)")
    revision: str | None = Field(None, description="a hub id's branch, tag or commit (default: main)")
    download_dir: str | None = Field(None, description="the Hugging Face cache a hub id is looked up in and "
                                                       "downloaded to (default: HF_HUB_CACHE)")
    routers: PositiveInt = Field(1, description="router processes serving the one HTTP port (vLLM's "
                                                "--api-server-count): the port is bound once and every router "
                                                "accepts on it; the first also serves gRPC",
                                 json_schema_extra={"aliases": ["--api-server-count"]})
    encoder_cache_store_bytes: PositiveInt = Field(
        1024 * MiB, description="memory of the encoder cache store that epd serve starts (--encoder-cache-store "
                                "mooncake without --mooncake-master)")
    timeout_s: float = Field(300.0, gt=0, description="how long to wait for everything to be healthy")
    max_restarts: int = Field(5, ge=0, description="restarts of each worker that dies (local launcher); then "
                                                   "it stays down and /health shows its tier degraded")
    standby: bool = Field(True, description="fork every worker and router from one process that imported their "
                                            "code (a zygote), so a start or restart costs the model load, not "
                                            "a cold start (local launcher); off: each process starts cold")
    launcher: Literal["local", "ray"] = Field("local", description="local processes or Ray actors")
    ray_address: str | None = Field(None, description="an existing Ray cluster ('auto'); default: start a local one")
    ray_config: str | None = Field(None, description="RayDeployment YAML (deploy/ray/cluster.yaml)")
    router: RouterConfig = RouterConfig()
    worker: WorkerConfig = WorkerConfig()

    @field_validator("encoder_gpus", "prefill_gpus", "decode_gpus", mode="before")
    @classmethod
    def _gpu_indices(cls, value: Any) -> Any:
        return cuda_indices(value, "0 or 0,1")

    @model_validator(mode="after")
    def _one_tls_block(self) -> "ServeConfig":
        """Mutual TLS is the whole cluster's: given once (flags, or the router's or the workers'
        YAML), it is every process's; given twice, the two must agree (two identities in one
        cluster would refuse each other)."""
        router, worker = self.router.tls, self.worker.tls
        if router.enabled and worker.enabled and router != worker:
            raise ValueError("router.tls differs from worker.tls; give mutual TLS once (the --tls-* flags, or one of "
                             "the two YAML files)")
        tls = router if router.enabled else worker
        if tls.enabled:
            object.__setattr__(self, "router", self.router.model_copy(update={"tls": tls}))
            object.__setattr__(self, "worker", self.worker.model_copy(update={"tls": tls}))
        return self

    @model_validator(mode="after")
    def _one_public_name(self) -> "ServeConfig":
        """The served names are the router's; the workers carry the first as their metrics'
        ``model_name`` label, so they follow it wherever it was given (a flag sets both)."""
        names = self.router.served_model_name
        if names and self.worker.served_model_name != names:
            object.__setattr__(self, "worker", self.worker.model_copy(update={"served_model_name": names}))
        return self

    def tensor_parallel_size(self, tier: str) -> int:
        """Ranks of each of ``tier``'s workers: its own flag, else the workers' engine's (encoders: 1,
        a vision tower stays whole and encoders scale by replicas)."""
        if tier == "encoder":
            return 1
        return getattr(self, f"{tier}_tp") or self.worker.engine.tensor_parallel_size

    def devices(self, tier: str) -> list[str]:
        """The devices of each of ``tier``'s workers in turn (empty: the worker config's own):
        ``cuda:N``, or for a tensor-parallel worker its ranks' ``cuda:N,M`` (worker i takes the
        next ``tp`` of ``--<tier>-gpus``, round robin: ``--prefill-gpus 0,1 --prefill-tp 2`` is one
        worker on GPUs 0 and 1)."""
        gpus, tp = getattr(self, f"{tier}_gpus"), self.tensor_parallel_size(tier)
        if tp == 1 or not gpus:
            return [f"cuda:{index}" for index in gpus]
        if len(gpus) < tp:
            raise ValueError(f"--{tier}-gpus {','.join(gpus)} has {len(gpus)} GPU(s) for {tier} workers of "
                             f"{tp} tensor-parallel ranks, one GPU each: give at least {tp}")
        count = getattr(self, f"{tier}s")
        return ["cuda:" + ",".join(gpus[(worker * tp + rank) % len(gpus)] for rank in range(tp))
                for worker in range(max(1, count))]


TIERS = ("encoder", "prefill", "decode")


class TierSpec(_Config):
    """One tier on Ray: how many actors, what each asks of Ray, and its workers' config."""

    replicas: Annotated[int, Field(ge=0)] = 1
    num_cpus: float = Field(1.0, ge=0, description="CPUs per actor, per tensor-parallel rank")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor, per tensor-parallel rank")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per actor")
    max_restarts: Annotated[int, Field(ge=-1)] = 3
    config: WorkerConfig = WorkerConfig()  # model, host, port and transport are the deployment's

    @property
    def ranks(self) -> int:
        return self.config.engine.tensor_parallel_size

    def actor_resources(self) -> dict[str, float]:
        """What one actor asks of Ray. A tensor-parallel worker's ranks are processes of its actor
        (rank 0 starts them), so the actor asks for every rank's CPUs and GPUs: Ray then puts them
        all on one node and shows the actor (and so its ranks) each of those GPUs, ranks taking
        them in order."""
        return {"CPU": self.num_cpus * self.ranks, **({"GPU": self.num_gpus * self.ranks} if self.num_gpus else {}),
                **self.resources}


class RayDeployment(_Config):
    """EPD on Ray (``deploy/ray/cluster.yaml``)."""

    model: str = "tiny-qwen2-vl"
    host: str = Field("127.0.0.1", description="the address workers bind and advertise ('node': the Ray node's IP)")
    http_port: Port = 8000
    grpc_port: Port = 50051
    transport: str = ""
    colocate_prefill_decode: bool = Field(False, description="STRICT_PACK placement: a CUDA-IPC / shm pair")
    router_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources of the router "
                                               "actor (e.g. to put it on the node users reach)")
    tiers: dict[Literal["encoder", "prefill", "decode"], TierSpec] = Field(
        default_factory=lambda: {tier: TierSpec() for tier in TIERS})
    router: RouterConfig = RouterConfig()
    tls: TlsConfig = Field(TlsConfig(), description="mutual TLS of every process (the router's and each tier's own "
                                                    "tls block must then be unset)")

    @field_validator("tiers", mode="after")
    @classmethod
    def _every_tier(cls, tiers: dict) -> dict:
        return {tier: tiers.get(tier, TierSpec()) for tier in TIERS}

    @model_validator(mode="after")
    def _one_tls_block(self) -> "RayDeployment":
        """The deployment's ``tls`` is every process's: it fills the router's and each tier's, which
        may only repeat it (two identities in one cluster would refuse each other)."""
        if not self.tls.enabled:
            return self
        nested = {"router.tls": self.router.tls, **{f"tiers.{t}.config.tls": s.config.tls for t, s in self.tiers.items()}}
        for key, tls in nested.items():
            if tls.enabled and tls != self.tls:
                raise ValueError(f"{key} differs from the deployment's tls block; give mutual TLS once, in 'tls'")
        object.__setattr__(self, "router", self.router.model_copy(update={"tls": self.tls}))
        object.__setattr__(self, "tiers", {t: s.model_copy(update={"config": s.config.model_copy(update={
            "tls": self.tls})}) for t, s in self.tiers.items()})
        return self


def parse_mapping(value: Any) -> Any:
    """A mapping given on the command line: JSON (``{"image": 4}``, vLLM's form) or ``k=v,k=v``."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as err:
            raise ValueError(f"expected a JSON object or key=value pairs, got {value!r}: {err}") from None
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, number = pair.partition("=")
        try:
            out[key.strip()] = json.loads(number.strip()) if sep else None
        except ValueError:
            out[key.strip()] = None
        if not isinstance(out[key.strip()], (int, float)) or isinstance(out[key.strip()], bool):
            raise ValueError(f"expected a JSON object or key=value pairs of numbers, got {value!r}")
    return out


# ---- loading ---------------------------------------------------------------------------------------
def load_config(cls: type[C], data: dict[str, Any] | None = None, *, source: str = "config") -> C:
    """Validate ``data`` as ``cls``; any problem is a one-line ``ConfigError`` naming the key."""
    try:
        return cls.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(describe(err, source)) from None


def from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
    return load_config(cls, data, source=cls.__name__)


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def describe(err: ValidationError, source: str) -> str:
    """The first problem as ``source: key: what was expected, got value`` (+ how many more)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a rule across fields: the message names them and their values
        return f"{source}: {message}{more}"
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key {key!r}{more}"
    got = "" if first["type"] == "missing" or "got " in message else f", got {first['input']!r}"
    return f"{source}: {key}: {message}{got}{more}"


def deep_merge(base: dict, overrides: dict) -> dict:
    """``overrides`` on top of ``base``, nested mappings merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
