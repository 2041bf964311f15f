"""A checkpoint's ``generation_config.json`` as serving defaults, the way vLLM reads it
(``--generation-config auto``, its default): the sampling fields a request leaves unset take the
checkpoint's values (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the
default max_tokens), and every EOS id it lists ends generation, not only the tokenizer's one (Qwen's
released checkpoints list two: ``<|im_end|>`` and ``<|endoftext|>``). ``vllm`` turns both off
(OpenAI's defaults, the tokenizer's EOS); a folder reads that folder's file instead."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger("epd.models")

# the file's field -> our name, and what a value must be
_SAMPLING = {"temperature": ("temperature", lambda v: math.isfinite(v) and 0.0 <= v <= 2.0, "in [0, 2]"),
             "top_p": ("top_p", lambda v: math.isfinite(v) and 0.0 < v <= 1.0, "in (0, 1]"),
             "top_k": ("top_k", lambda v: v == -1 or v >= 0, "-1, 0 (disabled) or >= 1"),
             "min_p": ("min_p", lambda v: math.isfinite(v) and 0.0 <= v <= 1.0, "in [0, 1]"),
             "repetition_penalty": ("repetition_penalty", lambda v: math.isfinite(v) and 0.0 < v <= 2.0, "in (0, 2]"),
             "max_new_tokens": ("max_tokens", lambda v: v >= 1, ">= 1")}


class GenerationConfigError(ValueError):
    """A generation_config.json this server cannot take (the message names the file and the field)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a sampling field unset gets (OpenAI's defaults unless the
    checkpoint says otherwise), and the EOS ids beyond the tokenizer's that end generation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None: the server's own default
    eos_token_ids: tuple[int, ...] = ()
    source: str = "OpenAI's defaults"
    given: tuple[str, ...] = ()  # the sampling fields the file sets (our names)

    def changed(self) -> dict:
        """The fields that differ from OpenAI's defaults (what the router logs at start)."""
        base = GenerationDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("source", "given") and getattr(self, f.name) != getattr(base, f.name)}

    def sampling_fields(self) -> dict:
        """The sampling fields the file sets, by SamplingParams' names (``epd.LLM``'s defaults)."""
        return {name: getattr(self, name) for name in self.given}


OPENAI_DEFAULTS = GenerationDefaults()


def generation_defaults(model_dir: str | Path, mode: str = "auto") -> GenerationDefaults:
    """``mode``: ``auto`` (the checkpoint's file, if it has one), ``vllm`` (none), or a folder whose
    ``generation_config.json`` to read."""
    if mode == "vllm":
        return OPENAI_DEFAULTS
    folder = Path(model_dir) if mode == "auto" else Path(mode).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise GenerationConfigError(f"--generation-config {mode}: no generation_config.json in {folder}")
        return OPENAI_DEFAULTS
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise GenerationConfigError(f"{path}: not readable JSON ({err})") from None
    values: dict = {}
    for key, (name, ok, expected) in _SAMPLING.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise GenerationConfigError(f"{path}: {key} must be {expected}, got {value!r}")
        values[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if values.get("top_k") == 0:
        values["top_k"] = -1  # 0 and -1 both mean the whole vocabulary
    eos = data.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise GenerationConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return GenerationDefaults(**values, eos_token_ids=eos_ids, source=str(path), given=tuple(values))
