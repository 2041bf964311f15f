"""Header-only Qwen2-VL geometry must equal what the HF image processor produces."""

from __future__ import annotations

import copy
import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd.multimodal.geometry import (
    ImageGeometry,
    VisionGeometryConfig,
    image_geometry,
    image_geometry_from_bytes,
    max_tokens_per_item,
    smart_resize,
)
from epd.multimodal.media import MediaError

# transformers 5.x without torchvision: the PIL backend is the processor we can run.
HFProcessor = Qwen2VLImageProcessorPil

SMALL = {"min_pixels": 3136, "max_pixels": 200704}  # 256 cells: keeps huge images cheap
DEFAULT: dict = {}

# (width_px, height_px)
SIZES = [
    (333, 517), (517, 333),
    (1, 1), (2, 3), (5, 7), (27, 29), (28, 28), (56, 30), (30, 56),
    (70, 42), (98, 126), (126, 98),  # sides at x.5 cells: round-half-to-even matters
    (100, 100), (111, 999), (999, 111),
    (224, 224), (448, 448), (462, 448), (640, 480), (480, 640),
    (896, 1120), (1120, 896), (1024, 768), (1280, 720), (1920, 1080), (1080, 1920),
    (2048, 2048), (4000, 3000), (3000, 4000),
    (28, 5000), (5000, 28), (4000, 30), (30, 4000),
    (25, 5000), (5000, 25),  # aspect ratio exactly 200: still accepted
    (28, 5599), (1, 200), (200, 1), (14, 2799), (3, 600),
]
TOO_ELONGATED = [(1, 201), (201, 1), (28, 5700), (10, 2001), (4000, 19)]


@pytest.fixture(scope="module")
def processors() -> dict[str, object]:
    return {"small": HFProcessor(**SMALL), "default": HFProcessor(**DEFAULT)}


def _hf(processor, width_px: int, height_px: int) -> tuple[tuple[int, ...], int]:
    out = processor(Image.new("RGB", (width_px, height_px)))
    (grid_thw,) = out["image_grid_thw"].tolist()
    return tuple(grid_thw), out["pixel_values"].shape[0]


@pytest.mark.parametrize(
    "cfg_name, cfg_kwargs", [("small", SMALL), ("default", DEFAULT)], ids=["small", "default"]
)
@pytest.mark.parametrize("width_px, height_px", SIZES)
def test_geometry_matches_hf_processor(processors, cfg_name, cfg_kwargs, width_px, height_px) -> None:
    cfg = VisionGeometryConfig(**cfg_kwargs)
    geometry = image_geometry(width_px, height_px, cfg)
    grid_thw, num_rows = _hf(processors[cfg_name], width_px, height_px)
    assert geometry.grid_thw == grid_thw
    assert geometry.num_patches == num_rows
    assert geometry.num_embedding_rows == num_rows // cfg.merge_size**2
    assert (geometry.resized_height_px, geometry.resized_width_px) == (
        grid_thw[1] * cfg.patch_size,
        grid_thw[2] * cfg.patch_size,
    )


@pytest.mark.parametrize("width_px, height_px", TOO_ELONGATED)
def test_aspect_ratio_over_200_refused_like_hf(processors, width_px, height_px) -> None:
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 200"):
        _hf(processors["small"], width_px, height_px)
    with pytest.raises(MediaError, match="absolute aspect ratio must be smaller than 200"):
        image_geometry(width_px, height_px, VisionGeometryConfig(**SMALL))


def test_geometry_fields_for_a_known_image() -> None:
    assert image_geometry(517, 333) == ImageGeometry(
        width_px=517,
        height_px=333,
        resized_height_px=336,
        resized_width_px=504,
        grid_thw=(1, 24, 36),
        num_patches=864,
        num_embedding_rows=216,
    )


def test_empty_size_refused() -> None:
    with pytest.raises(MediaError, match="must be positive"):
        smart_resize(0, 10, 28, 3136, 200704)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_geometry_from_bytes_reads_header(fmt: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (333, 517)).save(buf, format=fmt)
    assert image_geometry_from_bytes(buf.getvalue()) == image_geometry(333, 517)
    with pytest.raises(MediaError):
        image_geometry_from_bytes(b"not an image")


# ---------------------------------------------------------------------------
# VisionGeometryConfig.from_preprocessor_config
# ---------------------------------------------------------------------------


def _saved_config(tmp_path: Path, **kwargs) -> dict:
    HFProcessor(**kwargs).save_pretrained(tmp_path)
    return json.loads((tmp_path / "preprocessor_config.json").read_text())


def test_config_round_trip_through_save_pretrained(tmp_path: Path) -> None:
    saved = _saved_config(tmp_path, **SMALL)
    assert VisionGeometryConfig.from_preprocessor_config(saved) == VisionGeometryConfig(**SMALL)


def test_config_round_trip_honours_every_key(tmp_path: Path) -> None:
    kwargs = {
        "min_pixels": 1000, "max_pixels": 50_000, "patch_size": 16, "merge_size": 2, "temporal_patch_size": 1
    }
    saved = _saved_config(tmp_path, **kwargs)
    cfg = VisionGeometryConfig.from_preprocessor_config(saved)
    assert cfg == VisionGeometryConfig(**kwargs)
    processor = HFProcessor.from_pretrained(tmp_path)
    for width_px, height_px in [(333, 517), (5, 7), (1000, 40)]:
        grid_thw, num_rows = _hf(processor, width_px, height_px)
        assert image_geometry(width_px, height_px, cfg).grid_thw == grid_thw
        assert image_geometry(width_px, height_px, cfg).num_patches == num_rows


def _hf_bounds(config: dict) -> tuple[int, int]:
    size = HFProcessor.from_dict(copy.deepcopy(config)).size
    return size.shortest_edge, size.longest_edge


@pytest.mark.parametrize(
    "config",
    [
        {},  # class defaults
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14},  # Qwen2-VL hub form
        {"size": {"shortest_edge": 100, "longest_edge": 9000}},  # transformers 5.x save form
        {"size": {"shortest_edge": 100, "longest_edge": 9000}, "max_pixels": 7000},
        {"size": {"shortest_edge": 100, "longest_edge": 9000}, "min_pixels": 50},
        # transformers 4.4x saved both forms; the top-level keys win
        {"size": {"min_pixels": 1, "max_pixels": 2}, "min_pixels": 3136, "max_pixels": 200704},
    ],
)
def test_config_precedence_matches_hf(config: dict) -> None:
    cfg = VisionGeometryConfig.from_preprocessor_config(config)
    assert (cfg.min_pixels, cfg.max_pixels) == _hf_bounds(config)


def test_config_nested_processor_form() -> None:
    nested = {"image_processor": {"size": {"shortest_edge": 100, "longest_edge": 9000}, "patch_size": 16}}
    assert VisionGeometryConfig.from_preprocessor_config(nested) == VisionGeometryConfig(
        patch_size=16, min_pixels=100, max_pixels=9000
    )


def test_config_legacy_size_form_read() -> None:
    cfg = VisionGeometryConfig.from_preprocessor_config({"size": {"min_pixels": 1000, "max_pixels": 5000}})
    assert (cfg.min_pixels, cfg.max_pixels) == (1000, 5000)


def test_config_missing_bound_refused() -> None:
    with pytest.raises(ValueError, match="must give both pixel bounds"):
        VisionGeometryConfig.from_preprocessor_config({"size": {"shortest_edge": 100}})
    with pytest.raises(ValueError, match="positive int"):
        VisionGeometryConfig(patch_size=0)


# ---------------------------------------------------------------------------
# max_tokens_per_item
# ---------------------------------------------------------------------------


def test_max_tokens_default_is_reached() -> None:
    assert max_tokens_per_item() == 5120
    assert image_geometry(1120, 896).num_patches == 5120
    assert max_tokens_per_item(VisionGeometryConfig(**SMALL)) == 1024


def _sweep_sizes(seed: int = 0, count: int = 4000) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = [(w, h) for w, h in SIZES]
    for _ in range(count):
        short_px = rng.randint(1, 600)
        long_px = min(short_px * 200, rng.randint(short_px, short_px * 200))
        sizes.append((short_px, long_px) if rng.random() < 0.5 else (long_px, short_px))
    sizes += [(s, s * 200) for s in range(1, 200)]  # the thin strips that overshoot max_pixels
    return sizes


@pytest.mark.parametrize(
    "cfg",
    [
        VisionGeometryConfig(),
        VisionGeometryConfig(**SMALL),
        VisionGeometryConfig(min_pixels=784, max_pixels=784 * 4),  # strips dominate
        VisionGeometryConfig(min_pixels=200_704, max_pixels=200_704),  # upscaling dominates
        VisionGeometryConfig(patch_size=16, merge_size=2, min_pixels=1024, max_pixels=16384),
    ],
    ids=["default", "small", "tiny-max", "big-min", "patch16"],
)
def test_max_tokens_bounds_every_image(cfg: VisionGeometryConfig) -> None:
    bound = max_tokens_per_item(cfg)
    worst = max(image_geometry(w, h, cfg).num_patches for w, h in _sweep_sizes())
    assert worst <= bound
