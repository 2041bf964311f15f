"""How a cluster is started: ``epd serve`` (local processes) and a Ray deployment."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from epd.config.base import FrozenConfig, MiB, Port, PositiveInt, cuda_indices
from epd.config.router import RouterConfig
from epd.config.worker import TlsConfig, WorkerConfig


class ServeConfig(FrozenConfig):
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


class TierSpec(FrozenConfig):
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


class RayDeployment(FrozenConfig):
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
