"""Reading a Hugging Face checkpoint directory: config, safetensors shards, chat template."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from epd.progress import bar

log = logging.getLogger("epd.models")


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory: config.json not found")
    return read_json(path)


def safetensors_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / name for name in read_json(index)["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _shards(model_dir: Path) -> Iterator[Path]:
    """Every safetensors shard, with one log line each as it starts and one when all are read (a
    large checkpoint loads for minutes: the log says where it is, as vLLM's progress bar does)."""
    files = safetensors_files(model_dir)
    total_bytes, done_bytes, start = sum(p.stat().st_size for p in files), 0, time.monotonic()
    for i, path in enumerate(files, start=1):
        log.info("loading weights: %s shard %d of %d (%s, %.1f MB), %.1f of %.1f MB read, %.1f s",
                 bar(done_bytes, total_bytes), i, len(files), path.name, path.stat().st_size / 1e6,
                 done_bytes / 1e6, total_bytes / 1e6, time.monotonic() - start)
        yield path
        done_bytes += path.stat().st_size
    log.info("loaded weights: %s %d shard(s), %.1f MB in %.1f s", bar(1, 1), len(files), total_bytes / 1e6,
             time.monotonic() - start)


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over every shard; tensors are loaded one at a time (no pickle)."""
    for path in _shards(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weight_slices(model_dir: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, lazy slice) over every shard: indexing the slice (``[a:b]``, ``[:, a:b]``,
    ``[:]``) reads only those elements from the file, so a tensor-parallel rank reads only its part.
    A slice is valid until the next one is yielded."""
    for path in _shards(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def read_chat_template(model_dir: Path) -> str | None:
    """``chat_template.jinja`` wins, then ``chat_template.json``, then tokenizer_config.json."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            template = read_json(path).get("chat_template")
            if isinstance(template, str):
                return template
    return None


def read_preprocessor_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "preprocessor_config.json"
    return read_json(path) if path.is_file() else {}


def read_video_preprocessor_config(model_dir: Path) -> dict:
    """A video processor's settings where transformers looks for them, in its order:
    processor_config.json's nested ``video_processor``, video_preprocessor_config.json, then the
    image processor's preprocessor_config.json (older checkpoints keep one file for both)."""
    model_dir = Path(model_dir)
    processor = model_dir / "processor_config.json"
    if processor.is_file() and isinstance(read_json(processor).get("video_processor"), dict):
        return read_json(processor)["video_processor"]
    video = model_dir / "video_preprocessor_config.json"
    return read_json(video) if video.is_file() else read_preprocessor_config(model_dir)
