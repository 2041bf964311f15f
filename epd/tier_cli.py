"""Command-line options shared by ``epd encoder|prefill|decode``: a YAML config plus overrides."""
from __future__ import annotations

import argparse

from epd.config import EngineConfig, WorkerConfig, from_dict, load_yaml


def worker_parser(tier: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"epd {tier}", description=f"run one {tier} worker")
    parser.add_argument("--config", help="YAML file with WorkerConfig fields (engine: {...} nested)")
    parser.add_argument("--model", help="preset name or HF checkpoint directory")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, help="0 picks a free port (printed in the ready line)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus HTTP port (0: a free one)")
    parser.add_argument("--transport", help="inline | shm | cuda_ipc | nccl (default: automatic)")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--no-overlap", dest="overlap_prefill_with_encode", action="store_false", default=None,
                        help="prefill: wait for all embeddings before computing (default: overlap)")
    return parser


def worker_config_from_args(tier: str, argv: list[str] | None) -> WorkerConfig:
    args = worker_parser(tier).parse_args(argv)
    data = load_yaml(args.config) if args.config else {}
    engine = dict(data.pop("engine", {}) or {})
    for key in ("max_num_batched_tokens", "num_kv_blocks"):
        if getattr(args, key) is not None:
            engine[key] = getattr(args, key)
    for key in ("model", "host", "port", "transport", "overlap_prefill_with_encode", "metrics_port"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    return from_dict(WorkerConfig, {**data, "engine": from_dict(EngineConfig, engine)})
