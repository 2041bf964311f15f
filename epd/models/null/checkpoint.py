"""Zero-cost checkpoints: a directory like any checkpoint (config.json, the Qwen2 tokenizer and chat
template, preprocessor_config.json), without weights. Their dimensions set what the transfers
weigh: an embedding row is ``hidden_size`` wide, a token's KV is ``num_hidden_layers`` x 2 x
``num_key_value_heads`` x ``hidden_size / num_attention_heads`` elements."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from epd.models.cache import atomic_directory, epd_cache_dir

_FORMAT_VERSION = 1
_MARKER_FILE = "epd_null.json"


@dataclasses.dataclass(frozen=True)
class NullSpec:
    """Defaults: Qwen2-VL-2B's embedding width (1536) and image geometry, a 4-layer KV (4 KiB a
    token in float32: a 256-stream decode batch fits the default cache); larger values make larger
    handles, at no compute."""

    hidden_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    num_logits: int = 2048
    first_token_id: int = 256  # past the bare bytes: every token is a whole BPE piece
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # each forward (a decode step, a prefill chunk) waits this long without computing: a device's
    # step time, paced as a GPU would pace it, while the host stays idle as it would beside a GPU
    step_ms: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.step_ms <= 60_000:
            raise ValueError(f"step_ms must be in [0, 60000], got {self.step_ms}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must split into num_attention_heads "
                             f"{self.num_attention_heads}, and those into num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if not 0 <= self.first_token_id < self.num_logits:
            raise ValueError(f"need 0 <= first_token_id {self.first_token_id} < num_logits {self.num_logits}")


NULL_PRESETS = {"null-qwen2-vl": NullSpec()}


def resolve_null_preset(name: str) -> Path:
    """The cached checkpoint of a zero-cost preset (written once)."""
    spec = NULL_PRESETS[name]
    out_dir = epd_cache_dir() / "presets" / name
    if not _is_current(out_dir, spec):
        write_null_checkpoint(out_dir, spec)
    return out_dir


def write_null_checkpoint(out_dir: Path, spec: NullSpec = NullSpec()) -> Path:
    """Write a zero-cost checkpoint of ``spec`` at ``out_dir`` (replaced atomically if present)."""
    from epd.models import presets

    out_dir = Path(out_dir)
    # the tokenizer, chat template and image processor files of a Qwen2-VL preset, with this geometry
    files_spec = dataclasses.replace(presets.PRESETS["tiny-qwen2-vl"], min_pixels=spec.min_pixels,
                                     max_pixels=spec.max_pixels)
    with atomic_directory(out_dir, replace=out_dir.exists()) as tmp_dir:
        presets._save_processor_files(files_spec, tmp_dir)
        (tmp_dir / "config.json").write_text(json.dumps(_config(spec), indent=2) + "\n")
        marker = {"format": _FORMAT_VERSION, "spec": dataclasses.asdict(spec)}
        (tmp_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def _config(spec: NullSpec) -> dict:
    from epd.models import presets

    return {
        "model_type": "epd_null_vl",
        "text_config": {
            "vocab_size": presets.VOCAB_SIZE, "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
        },
        "vision_config": {"spatial_merge_size": 2, "patch_size": 14, "temporal_patch_size": 2},
        "image_token_id": presets.IMAGE_TOKEN_ID, "video_token_id": presets.VIDEO_TOKEN_ID,
        "vision_start_token_id": presets.VISION_START_TOKEN_ID, "vision_end_token_id": presets.VISION_END_TOKEN_ID,
        "eos_token_id": presets.EOS_TOKEN_ID,
        "null": {"num_logits": spec.num_logits, "first_token_id": spec.first_token_id, "step_ms": spec.step_ms},
    }


def _is_current(out_dir: Path, spec: NullSpec) -> bool:
    try:
        marker = json.loads((out_dir / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"format": _FORMAT_VERSION, "spec": dataclasses.asdict(spec)}
