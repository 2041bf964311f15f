"""Shared by the benchmark scripts: run from a checkout without installing, synthetic images."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def noise_png(size_px: int, seed: int) -> bytes:
    """A distinct PNG per seed: noise, so every patch differs and no two images share a cache entry."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size_px, size_px, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
