"""A tier process's settings: where it serves, how it hands tensors on, its engine or
encoder, and mutual TLS between EPD's processes.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from epd.config.base import FrozenConfig, ModelDevice, ModelDtype, OnDevice, Port, PositiveInt, readable_file
from epd.config.engine import EngineConfig


class EncoderConfig(FrozenConfig, OnDevice):
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
    dtype: ModelDtype = "auto"
    device: ModelDevice = "auto"
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


class TlsConfig(FrozenConfig):
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
        return readable_file(value, "PEM file")

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


class WorkerConfig(FrozenConfig):
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
