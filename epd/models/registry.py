"""Model families by Hugging Face ``model_type``, as a lazy name -> module table: a family is
imported only when a checkpoint of its type is opened, and adding one is one line here plus its
own module (no registration by import side effect)."""
from __future__ import annotations

import importlib
from pathlib import Path

from epd.models.checkpoint import read_config
from epd.models.spec import ModelFamily

# model_type -> "module:attribute" of the family object
_FAMILIES = {
    "qwen2_vl": "epd.models.qwen2_vl.family:QWEN2_VL",
    "qwen2_5_vl": "epd.models.qwen2_vl.family:QWEN2_5_VL",
    "qwen3_vl": "epd.models.qwen3_vl.family:QWEN3_VL",
    "epd_null_vl": "epd.models.null.family:NULL_VL",  # the zero-cost model (a benchmark tool)
}


def family_named(model_type: str) -> ModelFamily:
    target = _FAMILIES.get(model_type)
    if target is None:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


def family_for(model_dir: str | Path) -> ModelFamily:
    model_type = read_config(Path(model_dir)).get("model_type")
    if model_type is None:
        raise ValueError(f"{model_dir}/config.json has no model_type")
    return family_named(model_type)


def load_llm_for(model_dir, engine_config):
    """The LLM of ``model_dir`` on the engine config's device, in its dtype (``auto`` resolved here)."""
    return family_for(model_dir).load_llm(model_dir, device=engine_config.target_device,
                                          dtype=engine_config.torch_dtype)
