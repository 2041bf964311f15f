"""The router's settings: its workers, admission limits, routing, media policy and listeners."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from epd.config.base import FrozenConfig, MiB, Port, PositiveInt, parse_mapping, readable_file
from epd.config.engine import EngineConfig
from epd.config.worker import TlsConfig


class RouterConfig(FrozenConfig):
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
    stream_interval: PositiveInt = Field(
        1, description="a streamed request's tokens after its first go out in groups of this many (one event each; "
                       "the last group when it finishes): fewer events cost the router and its clients less at many "
                       "streams, for coarser streaming; 1: every token as it comes (vLLM's flag)")
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
        return readable_file(value, "file of keys")

    @model_validator(mode="after")
    def _engine_only_when_aggregated(self) -> "RouterConfig":
        if not self.aggregated and self.engine != EngineConfig():
            changed = sorted(self.engine.model_dump(exclude_defaults=True))
            raise ValueError(f"engine settings {changed} apply only with aggregated (the in-process engine); "
                             f"the tiers take them from their own worker config")
        return self
