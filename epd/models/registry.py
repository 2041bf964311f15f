"""Model families by HF ``model_type``. A family knows how to build the LLM (on our engine) and
the vision encoder (transformers) from a checkpoint directory; adding Qwen3-VL or LLaVA is a new
family module that registers itself, not an edit here."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from epd.models.checkpoint import read_config
from epd.registry import Registry


class ModelFamily(Protocol):
    name: str

    def load_llm(self, model_dir: Path) -> torch.nn.Module: ...
    def load_vision(self, model_dir: Path, *, dtype: torch.dtype, device: str): ...
    def mm_spec(self, model_dir: Path): ...


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family")


def family_for(model_dir: str | Path) -> ModelFamily:
    # importing the families registers them
    import epd.models.qwen2_vl.family  # noqa: F401
    model_type = read_config(Path(model_dir)).get("model_type")
    if model_type is None:
        raise ValueError(f"{model_dir}/config.json has no model_type")
    return MODEL_FAMILIES.get(model_type)
