"""Load a checkpoint's tokenizer and make sure it carries a chat template."""
from __future__ import annotations

import copy
import threading
from pathlib import Path

from epd.models.checkpoint import read_chat_template, read_config

# Loading is slow (a Qwen tokenizer.json is ~19 MB of JSON, parsed by transformers and again by the
# Rust tokenizer: ~1.4 s of CPU), and one process may need the same tokenizer more than once (the
# router and the in-process engine of --aggregated; every pipeline a test builds). Loaded once per
# process and checkpoint state; each caller gets its own shallow copy, so what it sets on it (a
# chat template override) stays its own, while the immutable Rust tokenizer is shared.
_LOADED: dict[tuple, object] = {}
_LOCK = threading.Lock()


def load_tokenizer(model_dir: Path):
    if not Path(model_dir).is_dir():  # not a checkpoint directory: transformers says what is wrong
        return _load(Path(model_dir))
    key = _state_of(Path(model_dir))
    with _LOCK:
        tokenizer = _LOADED.get(key)
        if tokenizer is None:
            tokenizer = _LOADED[key] = _load(Path(model_dir))
    return copy.copy(tokenizer)


def _config_unless_known(model_dir: Path) -> dict:
    """A checkpoint of a model_type transformers does not know (the zero-cost model's): its
    tokenizer files alone say which tokenizer, and transformers is not asked to read its config
    (it would warn that the model may not load)."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_file = model_dir / "config.json"
    model_type = read_config(model_dir).get("model_type") if config_file.is_file() else None
    return {} if model_type is None or model_type in CONFIG_MAPPING else {"config": PretrainedConfig()}


def _state_of(model_dir: Path) -> tuple:
    """The checkpoint directory and what its tokenizer files are now: a rewritten checkpoint (a
    preset rebuilt in place) is loaded again."""
    files = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in model_dir.iterdir()
                   if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt")))
    return str(model_dir.resolve()), tuple(files)


def _load(model_dir: Path):
    # imported here: prefill and decode workers load a tokenizer only for their first grammar, and
    # transformers costs ~0.9 s of CPU to import (paid again by every worker started or restarted)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **_config_unless_known(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        template = read_chat_template(model_dir)
        if template is None:
            raise ValueError(f"{model_dir} has no chat template (chat_template.jinja, chat_template.json "
                             f"or tokenizer_config.json)")
        tokenizer.chat_template = template
    return tokenizer
