"""Qwen2-VL / Qwen2.5-VL image geometry, computed from the image header alone.

The router must know how many placeholder tokens an image expands to, and the
encoder scheduler how much attention work it is, before any pixel is decoded.
For the Qwen2-VL family both are a pure function of (width, height) and the
image processor config:

1. ``smart_resize`` picks a size that is a multiple of ``patch_size * merge_size``
   with an area in [min_pixels, max_pixels] and about the same aspect ratio;
2. the resized image is cut into ``patch_size`` patches: ``grid_thw`` = (1, h, w),
   ``num_patches`` = t*h*w rows of ``pixel_values`` (encoder attention tokens);
3. each ``merge_size x merge_size`` block of patches becomes one LLM embedding
   row, so the prompt's placeholder span is ``num_patches // merge_size**2``.

``smart_resize`` reproduces transformers' function bit for bit (same float
arithmetic, same round-half-to-even ``round``) and is tested against the HF
image processor; it is re-implemented so this module needs neither torch nor
transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd.multimodal.media import MediaError, read_image_size

# transformers rejects images more elongated than this (strictly greater).
MAX_ASPECT_RATIO = 200
# A still image is a single temporal patch: HF repeats the frame temporal_patch_size times.
_IMAGE_GRID_T = 1

_DEFAULT_PATCH_SIZE = 14
_DEFAULT_TEMPORAL_PATCH_SIZE = 2
_DEFAULT_MERGE_SIZE = 2
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# The image processor kwargs a request may set (vLLM's mm_processor_kwargs for Qwen-VL images).
PIXEL_KWARGS = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class VisionGeometryConfig:
    patch_size: int = _DEFAULT_PATCH_SIZE  # px per patch side
    temporal_patch_size: int = _DEFAULT_TEMPORAL_PATCH_SIZE  # frames per patch (images: 1 frame, repeated)
    merge_size: int = _DEFAULT_MERGE_SIZE  # patches per merged embedding row, per side
    min_pixels: int = _DEFAULT_MIN_PIXELS  # resized area lower bound (HF size["shortest_edge"])
    max_pixels: int = _DEFAULT_MAX_PIXELS  # resized area upper bound (HF size["longest_edge"])

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VisionGeometryConfig.{name} must be a positive int, got {value!r}")

    @property
    def factor_px(self) -> int:
        """Resized sides are multiples of this: one merged cell."""
        return self.patch_size * self.merge_size

    @property
    def pixel_kwargs(self) -> dict[str, int]:
        """The processor kwargs this geometry resizes by (what a per-request override may change)."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

    def with_pixel_kwargs(self, overrides: Mapping[str, Any] | None) -> VisionGeometryConfig:
        """This geometry with a request's (or a server's) ``mm_processor_kwargs`` applied:
        ``min_pixels`` / ``max_pixels``, each a whole number of pixels with
        ``factor_px**2 <= min_pixels <= max_pixels <= `` the checkpoint's ``max_pixels`` (the
        encoder's attention-token and output budgets are sized by the checkpoint's own bound, so a
        larger one could never be scheduled). Raises ``ValueError`` naming what is wrong."""
        if not overrides:
            return self
        check_kwarg_names(overrides, PIXEL_KWARGS)
        bounds = self.pixel_kwargs
        for name, value in overrides.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a whole number of pixels, got {value!r}")
            bounds[name] = value
        low, high, ceiling = bounds["min_pixels"], bounds["max_pixels"], self.max_pixels
        if not self.factor_px ** 2 <= low <= high <= ceiling:
            raise ValueError(f"expected {self.factor_px ** 2} <= min_pixels <= max_pixels <= {ceiling} (the "
                             f"checkpoint's max_pixels), got min_pixels={low}, max_pixels={high}")
        return VisionGeometryConfig(self.patch_size, self.temporal_patch_size, self.merge_size, low, high)

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> VisionGeometryConfig:
        """Read a HF ``preprocessor_config.json`` dict (or a ``processor_config.json`` one).

        Precedence follows transformers 5.x ``Qwen2VLImageProcessor.__init__``:
        top-level ``min_pixels``/``max_pixels`` override ``size["shortest_edge"]``/
        ``size["longest_edge"]``; without a ``size`` key the class defaults apply.
        The legacy ``size={"min_pixels", "max_pixels"}`` form written by
        transformers 4.4x is read as a last resort (5.x itself fails on it).
        """
        image_config = config.get("image_processor")
        if isinstance(image_config, Mapping):  # 5.x processor_config.json nests it
            config = image_config
        min_pixels, max_pixels = _pixel_bounds(config)
        return cls(
            patch_size=_int_key(config, "patch_size", _DEFAULT_PATCH_SIZE),
            temporal_patch_size=_int_key(config, "temporal_patch_size", _DEFAULT_TEMPORAL_PATCH_SIZE),
            merge_size=_int_key(config, "merge_size", _DEFAULT_MERGE_SIZE),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )


def check_kwarg_names(overrides: Any, allowed: tuple[str, ...]) -> None:
    """``overrides`` is a mapping of processor kwargs this model takes (``ValueError`` otherwise)."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"expected an object of processor kwargs, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(f"unsupported processor kwargs {unknown}; this model takes {list(allowed)}")


def _int_key(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    return default if value is None else value


def _pixel_bounds(config: Mapping[str, Any]) -> tuple[int, int]:
    size = config.get("size")
    if size is None:
        size = {"shortest_edge": _DEFAULT_MIN_PIXELS, "longest_edge": _DEFAULT_MAX_PIXELS}
    if not isinstance(size, Mapping):
        raise ValueError(f"preprocessor config 'size' must be a dict of pixel bounds, got {size!r}")
    min_pixels = _first_set(config.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
    max_pixels = _first_set(config.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
    if min_pixels is None or max_pixels is None:
        raise ValueError(
            "preprocessor config must give both pixel bounds, as top-level min_pixels/max_pixels "
            f"or size.shortest_edge/size.longest_edge; got size={dict(size)!r}"
        )
    return min_pixels, max_pixels


def _first_set(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class ImageGeometry:
    width_px: int
    height_px: int
    resized_height_px: int
    resized_width_px: int
    grid_thw: tuple[int, int, int]  # patches along (time, height, width): HF image_grid_thw
    num_patches: int  # t*h*w: pixel_values rows, encoder attention tokens
    num_embedding_rows: int  # num_patches // merge_size**2: encoder output rows, placeholder span


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) that transformers' Qwen2-VL ``smart_resize`` picks; same rules, same floats."""
    if min(height, width) <= 0:
        raise MediaError(f"image size must be positive, got height={height} width={width}")
    aspect_ratio = max(height, width) / min(height, width)
    if aspect_ratio > MAX_ASPECT_RATIO:
        # Wording kept from transformers so logs read the same with either backend.
        raise MediaError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {aspect_ratio} "
            f"(image is {width}x{height} px)"
        )
    # round() is round-half-to-even, like transformers'; math.floor(x + 0.5) would differ.
    height_px = round(height / factor) * factor
    width_px = round(width / factor) * factor
    if height_px * width_px > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        # max(factor, ...): a thin strip keeps one cell across, which may overshoot max_pixels.
        height_px = max(factor, math.floor(height / beta / factor) * factor)
        width_px = max(factor, math.floor(width / beta / factor) * factor)
    elif height_px * width_px < min_pixels:
        # Also the path for images smaller than a cell, whose rounded sides are 0.
        beta = math.sqrt(min_pixels / (height * width))
        height_px = math.ceil(height * beta / factor) * factor
        width_px = math.ceil(width * beta / factor) * factor
    return height_px, width_px


def image_geometry(
    width_px: int, height_px: int, cfg: VisionGeometryConfig = VisionGeometryConfig()
) -> ImageGeometry:
    resized_height_px, resized_width_px = smart_resize(
        height_px, width_px, cfg.factor_px, cfg.min_pixels, cfg.max_pixels
    )
    grid_thw = (_IMAGE_GRID_T, resized_height_px // cfg.patch_size, resized_width_px // cfg.patch_size)
    num_patches = math.prod(grid_thw)
    return ImageGeometry(
        width_px=width_px,
        height_px=height_px,
        resized_height_px=resized_height_px,
        resized_width_px=resized_width_px,
        grid_thw=grid_thw,
        num_patches=num_patches,
        num_embedding_rows=num_patches // cfg.merge_size**2,
    )


def image_geometry_from_bytes(
    data: bytes, cfg: VisionGeometryConfig = VisionGeometryConfig()
) -> ImageGeometry:
    """Geometry of an encoded image, from its header; pixels are not decoded."""
    width_px, height_px = read_image_size(data)
    return image_geometry(width_px, height_px, cfg)


def max_tokens_per_item(cfg: VisionGeometryConfig = VisionGeometryConfig()) -> int:
    """Upper bound on ``num_patches`` (encoder tokens) of any image ``smart_resize`` accepts.

    Budgets built on it never see an item that does not fit. It is exact (reached,
    e.g. by 1120x896 for the defaults) whenever max_pixels dominates, as in every
    released Qwen2-VL / Qwen2.5-VL config; the other two terms cover the corners
    where smart_resize overshoots max_pixels.
    """
    max_cells = max(
        cfg.max_pixels // cfg.factor_px**2,  # area <= max_pixels, in whole cells
        _max_cells_thin_strip(cfg),
        _max_cells_upscaled(cfg),
        1,
    )
    return _IMAGE_GRID_T * max_cells * cfg.merge_size**2


def _max_cells_thin_strip(cfg: VisionGeometryConfig) -> int:
    # Downscale clamps the short side to one cell; the long side is then at most
    # width / beta = sqrt(max_pixels * aspect_ratio) px.
    return math.isqrt(MAX_ASPECT_RATIO * cfg.max_pixels) // cfg.factor_px


def _max_cells_upscaled(cfg: VisionGeometryConfig) -> int:
    # Upscale gives ceil(x / a) * ceil(x * a) cells with x = sqrt(min_pixels) / factor and
    # a = sqrt(aspect ratio) <= sqrt(200); bound each ceil by +1 and take the worst a.
    x = math.sqrt(cfg.min_pixels) / cfg.factor_px
    a = math.sqrt(MAX_ASPECT_RATIO)
    return math.floor(x * x + x * (a + 1 / a) + 1 + 1e-9)
