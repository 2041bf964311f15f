"""The one configuration tree, typed and validated once (pydantic), from YAML, flags or Ray values:

    ServeConfig           epd serve: what to start, plus                          (deployment.py)
      RouterConfig        the router: workers, admission limits, routing, media   (router.py)
                          policy, listeners
      WorkerConfig        every tier process: where it serves and how it hands    (worker.py)
                          tensors on, plus
        EngineConfig      the LLM engine of prefill and decode                    (engine.py)
        EncoderConfig     the encoder's budgets and cache                         (worker.py)
        TlsConfig         mutual TLS between EPD's processes (the router has one  (worker.py)
                          too)
    RayDeployment         epd serve --launcher ray: per-tier TierSpec (replicas,  (deployment.py)
                          resources, WorkerConfig)

Field types, device and dtype resolution and loading are in base.py. Configs are frozen. A wrong
key, type or value anywhere is a ``ConfigError`` with one line naming the key, what was expected
and what came (``load_config``), never a traceback.
"""
from epd.config.base import (
    ConfigError,
    MiB,
    cuda_indices,
    deep_merge,
    describe,
    from_dict,
    load_config,
    load_yaml,
    parse_mapping,
    resolve_device,
    resolve_dtype,
)
from epd.config.deployment import TIERS, RayDeployment, ServeConfig, TierSpec
from epd.config.engine import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from epd.config.router import RouterConfig
from epd.config.worker import EncoderConfig, TlsConfig, WorkerConfig

__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION", "TIERS", "ConfigError", "EncoderConfig", "EngineConfig", "MiB", "RayDeployment",
    "RouterConfig", "ServeConfig", "TierSpec", "TlsConfig", "WorkerConfig", "cuda_indices", "deep_merge", "describe",
    "from_dict", "load_config", "load_yaml", "parse_mapping", "resolve_device", "resolve_dtype",
]
