"""Seeded-random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints with the real Qwen2 vocabulary, so EPD runs
anywhere.

A preset is a named `PresetSpec`. `write_preset_checkpoint` turns it into an ordinary Hugging Face
checkpoint directory (config.json, model.safetensors, generation_config.json, tokenizer files,
chat_template.jinja, preprocessor_config.json) that transformers' `AutoModelForImageTextToText` loads like a
downloaded one; `preset_checkpoint` gives a preset's cached copy (`epd.models.locate.resolve_model`
maps any model name to its directory). `load_processor` gives the matching
processor, also where transformers' `AutoProcessor` cannot (no torchvision).

Weights are drawn with std 0.2 instead of transformers' 0.02: at 0.02-0.1 greedy decoding of a model with tied
embeddings repeats one or a few tokens (the residual stream keeps the input embedding, whose logit wins), which
makes fidelity tests meaningless. Biases and norm scales are random too, so a loader that drops any tensor
changes the output.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from epd.models.cache import atomic_directory, epd_cache_dir

Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]

VOCAB_SIZE = 151_936  # the 151,657 real tokens, padded as in the Qwen2-VL configs
BOS_TOKEN_ID = 151_643  # <|endoftext|>
PAD_TOKEN_ID = 151_643  # <|endoftext|>
EOS_TOKEN_ID = 151_645  # <|im_end|>
VISION_START_TOKEN_ID = 151_652
VISION_END_TOKEN_ID = 151_653
IMAGE_TOKEN_ID = 151_655
VIDEO_TOKEN_ID = 151_656

NORM_SCALE_STD = 0.1  # norm weights are 1 + N(0, this)
_MARKER_FILE = "epd_preset.json"
_FORMAT_VERSION = 2  # bump when the written files change for the same spec (2: a chat template with tools)


@dataclass(frozen=True)
class TextDims:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # (temporal, height, width) rotary pairs; sums to head_dim / 2
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32_768
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} q heads not divisible by {self.num_key_value_heads} kv heads"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")


@dataclass(frozen=True)
class VisionDims:
    depth: int
    embed_dim: int  # the ViT width; the merger projects to the text hidden size
    num_heads: int
    intermediate_size: int  # ViT MLP width (qwen2_vl: embed_dim * mlp_ratio)
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # qwen2_5_vl only: window attention side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # qwen2_5_vl only: blocks with full attention
    deepstack_visual_indexes: tuple[int, ...] = ()  # qwen3_vl only: blocks whose output feeds the LLM's first layers
    num_position_embeddings: int = 0  # qwen3_vl only: a square grid of learned position embeddings

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            # The 2-D vision rotary splits each head into (h, w) halves of rotary pairs.
            raise ValueError(f"vision head_dim {self.embed_dim}/{self.num_heads} must be a multiple of 4")
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if any(not 0 <= i < self.depth for i in getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)} outside depth {self.depth}")


@dataclass(frozen=True)
class PresetSpec:
    family: Family
    text: TextDims
    vision: VisionDims
    min_pixels: int
    max_pixels: int
    init_std: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in get_args(Family):
            raise ValueError(f"unknown family {self.family!r}; expected one of {get_args(Family)}")
        if self.family == "qwen2_vl" and self.vision.intermediate_size % self.vision.embed_dim:
            # Qwen2-VL's ViT config has only an integer mlp_ratio.
            raise ValueError(f"vision intermediate_size {self.vision.intermediate_size} must be a multiple of "
                             f"embed_dim {self.vision.embed_dim} for qwen2_vl")
        factor = self.vision.patch_size * self.vision.spatial_merge_size
        if not factor * factor <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need {factor}^2 <= min_pixels {self.min_pixels} <= max_pixels {self.max_pixels}")


_TINY_TEXT = TextDims(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    mrope_section=(2, 3, 3),
)
_SMALL_TEXT = TextDims(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    mrope_section=(4, 6, 6),
)

_QWEN3_VISION = dict(patch_size=16, num_position_embeddings=64)  # 16-px patches, an 8 x 8 position grid

PRESETS: dict[str, PresetSpec] = {
    "tiny-qwen2-vl": PresetSpec(
        family="qwen2_vl",
        text=_TINY_TEXT,
        vision=VisionDims(depth=2, embed_dim=32, num_heads=2, intermediate_size=128),
        min_pixels=56 * 56,
        max_pixels=448 * 448,
        seed=1,
    ),
    "small-qwen2-vl": PresetSpec(
        family="qwen2_vl",
        text=_SMALL_TEXT,
        vision=VisionDims(depth=4, embed_dim=128, num_heads=4, intermediate_size=512),
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 512,
        seed=2,
    ),
    "tiny-qwen2.5-vl": PresetSpec(
        family="qwen2_5_vl",
        # Untied, like Qwen2.5-VL-7B, so the presets cover both lm_head layouts.
        text=dataclasses.replace(_TINY_TEXT, tie_word_embeddings=False),
        vision=VisionDims(depth=2, embed_dim=32, num_heads=2, intermediate_size=64, fullatt_block_indexes=(1,)),
        min_pixels=56 * 56,
        max_pixels=448 * 448,
        seed=3,
    ),
    "small-qwen2.5-vl": PresetSpec(
        family="qwen2_5_vl",
        text=_SMALL_TEXT,
        vision=VisionDims(
            depth=4, embed_dim=128, num_heads=4, intermediate_size=256, fullatt_block_indexes=(1, 3)
        ),
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 512,
        seed=4,
    ),
    "tiny-qwen3-vl": PresetSpec(
        family="qwen3_vl",
        # interleaved M-RoPE sections: (temporal, height, width) pairs of head_dim / 2 = 8
        text=dataclasses.replace(_TINY_TEXT, mrope_section=(4, 2, 2)),
        vision=VisionDims(depth=3, embed_dim=32, num_heads=2, intermediate_size=64, deepstack_visual_indexes=(0, 1),
                          **_QWEN3_VISION),
        min_pixels=64 * 64,
        max_pixels=512 * 512,
        seed=5,
    ),
    "small-qwen3-vl": PresetSpec(
        family="qwen3_vl",
        text=dataclasses.replace(_SMALL_TEXT, mrope_section=(6, 5, 5), tie_word_embeddings=False),
        vision=VisionDims(depth=4, embed_dim=128, num_heads=4, intermediate_size=256,
                          deepstack_visual_indexes=(0, 1, 2), **_QWEN3_VISION),
        min_pixels=64 * 64,
        max_pixels=32 * 32 * 512,
        seed=6,
    ),
}


def preset_checkpoint(name: str) -> Path:
    """Preset ``name``'s checkpoint in the cache, written the first time (and again when its spec
    changed)."""
    out_dir = epd_cache_dir() / "presets" / name
    if not _is_current(out_dir, PRESETS[name], PRESETS[name].seed):
        _write_checkpoint(name, out_dir, seed=None, replace=out_dir.exists())
    return out_dir


def write_preset_checkpoint(name: str, out_dir: Path, *, seed: int | None = None) -> Path:
    """Write preset `name` as a Hugging Face checkpoint at `out_dir` (replaced atomically if present)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return _write_checkpoint(name, Path(out_dir), seed=seed, replace=True)


def _write_checkpoint(name: str, out_dir: Path, *, seed: int | None, replace: bool) -> Path:
    spec = PRESETS[name]
    seed = spec.seed if seed is None else seed
    with atomic_directory(out_dir, replace=replace) as tmp_dir:
        model = build_preset_model(spec, seed=seed)
        model.save_pretrained(tmp_dir)
        _save_processor_files(spec, tmp_dir)
        marker = {"preset": name, "seed": seed, "format": _FORMAT_VERSION, "spec": dataclasses.asdict(spec)}
        (tmp_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def build_preset_model(spec: PresetSpec, *, seed: int) -> Any:
    """The transformers model of `spec`, fp32, eval mode, weights drawn from `seed`."""
    import torch
    from transformers import GenerationConfig

    config_fn, model_cls = _FAMILIES[spec.family]()
    model = model_cls(config_fn(spec)).to(torch.float32).eval()
    _init_weights(model, std=spec.init_std, seed=seed)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=[EOS_TOKEN_ID, BOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        do_sample=False,
    )
    return model


def _init_weights(model: Any, *, std: float, seed: int) -> None:
    """Weights and biases ~ N(0, std); 1-D `.weight` (norm scales) ~ 1 + N(0, NORM_SCALE_STD).

    Each tensor gets its own generator seeded from (seed, name), so a tensor's values do not depend on
    the module order of the transformers version that built the model.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1 and name.endswith(".weight"):
                param.copy_(1.0 + NORM_SCALE_STD * noise)
            else:
                param.copy_(std * noise)


def load_processor(model_dir: str | Path) -> Any:
    """The Hugging Face processor of a Qwen2-VL-family checkpoint directory.

    `AutoProcessor` where torchvision is installed. transformers 5.x cannot build these processors
    without torchvision (it always loads the torchvision-only video processor), so otherwise this is
    the family's processor with the PIL image processor and no video support.
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir)
    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if model_type not in _FAMILIES:
        raise ValueError(f"{model_dir}: model_type {model_type!r} is not one of {sorted(_FAMILIES)}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return _image_only_processor_class(model_type)(
        image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil"),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _image_only_processor_class(family: str) -> type:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    base = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]

    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        # ProcessorMixin derives its sub-processors from this signature: no `video_processor` here means
        # it neither loads nor type-checks one.
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

        def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any) -> Any:
            if videos is not None:
                raise ValueError("video inputs need transformers' video processor, which needs torchvision")
            return super().__call__(images=images, text=text, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"{base.__name__}ImageOnly"
    return ImageOnlyProcessor


def _save_processor_files(spec: PresetSpec, out_dir: Path) -> None:
    """preprocessor_config.json + tokenizer files + chat_template.jinja, as `AutoProcessor` expects them.

    Saved piece by piece because the family's processor cannot be instantiated without torchvision.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from epd.models.tokenizer import build_qwen2_tokenizer

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=spec.vision.patch_size,
        temporal_patch_size=spec.vision.temporal_patch_size,
        merge_size=spec.vision.spatial_merge_size,
    )
    image_processor.save_pretrained(out_dir)
    tokenizer = build_qwen2_tokenizer()
    tokenizer._set_processor_class(_PROCESSOR_CLASS_NAMES[spec.family])
    tokenizer.save_pretrained(out_dir)


def _text_config(spec: PresetSpec) -> dict[str, Any]:
    t = spec.text
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
        },
        "tie_word_embeddings": t.tie_word_embeddings,
        "initializer_range": spec.init_std,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "float32",
    }


def _common_vision_config(spec: PresetSpec) -> dict[str, Any]:
    v = spec.vision
    return {
        "depth": v.depth,
        "num_heads": v.num_heads,
        "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "initializer_range": spec.init_std,
    }


def _top_level_config(spec: PresetSpec) -> dict[str, Any]:
    return {
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID,
        "vision_end_token_id": VISION_END_TOKEN_ID,
        "tie_word_embeddings": spec.text.tie_word_embeddings,
        "dtype": "float32",
    }


def _qwen2_vl() -> tuple[Callable[[PresetSpec], Any], type]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    def config(spec: PresetSpec) -> Any:
        vision = _common_vision_config(spec) | {
            "embed_dim": spec.vision.embed_dim,
            "hidden_size": spec.text.hidden_size,  # merger output = text width
            "mlp_ratio": spec.vision.intermediate_size // spec.vision.embed_dim,
        }
        return Qwen2VLConfig(text_config=_text_config(spec), vision_config=vision, **_top_level_config(spec))

    return config, Qwen2VLForConditionalGeneration


def _qwen2_5_vl() -> tuple[Callable[[PresetSpec], Any], type]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def config(spec: PresetSpec) -> Any:
        vision = _common_vision_config(spec) | {
            "hidden_size": spec.vision.embed_dim,
            "intermediate_size": spec.vision.intermediate_size,
            "out_hidden_size": spec.text.hidden_size,
            "window_size": spec.vision.window_size,
            "fullatt_block_indexes": list(spec.vision.fullatt_block_indexes),
            "tokens_per_second": 2,  # as in the released Qwen2.5-VL configs (video M-RoPE time scale)
        }
        return Qwen2_5_VLConfig(text_config=_text_config(spec), vision_config=vision, **_top_level_config(spec))

    return config, Qwen2_5_VLForConditionalGeneration


def _qwen3_vl() -> tuple[Callable[[PresetSpec], Any], type]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    def config(spec: PresetSpec) -> Any:
        text = _text_config(spec) | {"head_dim": spec.text.head_dim, "attention_bias": False}
        text["rope_parameters"] = text["rope_parameters"] | {"mrope_interleaved": True}
        vision = _common_vision_config(spec) | {
            "hidden_size": spec.vision.embed_dim,
            "intermediate_size": spec.vision.intermediate_size,
            "out_hidden_size": spec.text.hidden_size,
            "num_position_embeddings": spec.vision.num_position_embeddings,
            "deepstack_visual_indexes": list(spec.vision.deepstack_visual_indexes),
        }
        return Qwen3VLConfig(text_config=text, vision_config=vision, **_top_level_config(spec))

    return config, Qwen3VLForConditionalGeneration


_PROCESSOR_CLASS_NAMES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                          "qwen3_vl": "Qwen3VLProcessor"}

# family -> loader of (config builder, model class); loaders keep transformers out of import time.
_FAMILIES: dict[str, Callable[[], tuple[Callable[[PresetSpec], Any], type]]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
}


def _is_current(out_dir: Path, spec: PresetSpec, seed: int) -> bool:
    try:
        marker = json.loads((out_dir / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    expected = {"seed": seed, "format": _FORMAT_VERSION, "spec": json.loads(json.dumps(dataclasses.asdict(spec)))}
    return all(marker.get(key) == value for key, value in expected.items())
