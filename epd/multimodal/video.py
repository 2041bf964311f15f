"""Video inputs for the Qwen2-VL family: the container header gives what admission needs (size,
frame rate, frame count, duration) before any frame is decoded; frame sampling picks indices from
it; only those frames are decoded (PyAV), resized like the model's images and cut into temporal
patches of ``temporal_patch_size`` frames.

A video's cache key does not scan decoded frames: the sampled frame indices are a deterministic
function of the source bytes and the sampling settings, so the BLAKE3 digest of the bytes plus the
four sampling facts (``frames_indices``, ``fps``, ``duration``, ``total_num_frames``), the
processor kwargs and the model id name exactly the frames the model will see. Frames built by hand
(no source bytes) are hashed pixel by pixel instead (``hash_video_frames``).

Everything here reads untrusted bytes: each limit is checked from the header before decoding, and
every failure a client can cause is a ``MediaError`` (a 400) naming what was expected."""
from __future__ import annotations

import fractions
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epd.multimodal.geometry import VisionGeometryConfig, smart_resize
from epd.multimodal.hashing import hash_item
from epd.multimodal.media import MIB, MediaError

# The video processor's own pixel bounds when a checkpoint gives none (transformers' Qwen2-VL
# video processor: shortest_edge 128 * 28 * 28, longest_edge 768 * 28 * 28).
_VIDEO_MIN_PIXELS = 128 * 28 * 28
_VIDEO_MAX_PIXELS = 768 * 28 * 28
# Frame sampling: 2 frames per second, at least 4 (Qwen's own video loader, qwen-vl-utils), at most
# 32 (vLLM's default frame count): a video is one atomic encoder item, and the encoder's token budget
# is raised to the largest one a checkpoint allows, so this bound sizes every encoder batch.
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 32
# The processor kwargs a request may set for videos, beside the pixel bounds.
SAMPLING_KWARGS = ("fps", "min_frames", "max_frames")


@dataclass(frozen=True)
class VideoLimits:
    """Decode-bomb guards, all checked from the container header before a frame is decoded."""

    max_bytes: int = 48 * MIB  # the encoded file: it travels to an encoder in one gRPC message (64 MiB)
    max_duration_s: float = 3600.0
    max_fps: float = 1000.0  # a header claiming more is not a camera
    max_total_frames: int = 1_000_000
    max_side_px: int = 8192
    max_decoded_pixels: int = 2**31  # sampled frames x width x height, decoded as RGB: ~6 GiB worst case


DEFAULT_VIDEO_LIMITS = VideoLimits()


@dataclass(frozen=True)
class VideoMetadata:
    """What the container header says (the four hashed sampling facts come from it)."""

    width_px: int
    height_px: int
    fps: float
    total_num_frames: int
    duration_s: float


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video: ``fps`` frames per second of video, between
    ``min_frames`` and ``max_frames``, a multiple of the temporal patch size; frames resized into
    [min_pixels, max_pixels] like images."""

    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    geometry: VisionGeometryConfig = field(default_factory=lambda: VisionGeometryConfig(
        min_pixels=_VIDEO_MIN_PIXELS, max_pixels=_VIDEO_MAX_PIXELS))

    def __post_init__(self) -> None:
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not 0 < self.fps <= 60:
            raise ValueError(f"fps must be a number in (0, 60], got {self.fps!r}")
        for name in ("min_frames", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.min_frames > self.max_frames:
            raise ValueError(f"expected min_frames <= max_frames, got {self.min_frames} > {self.max_frames}")
        if self.max_frames < self.geometry.temporal_patch_size:
            raise ValueError(f"max_frames must be at least the temporal patch size "
                             f"{self.geometry.temporal_patch_size}, got {self.max_frames}")

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> VideoSampling:
        """A checkpoint's video settings (``checkpoint.read_video_preprocessor_config``): its pixel
        bounds, else the video processor's own; its ``fps`` / ``min_frames`` / ``max_frames``, else
        Qwen's sampling defaults (transformers' processor samples nothing by default; a server must)."""
        if any(k in config for k in ("size", "min_pixels", "max_pixels")):
            geometry = VisionGeometryConfig.from_preprocessor_config(config)
        else:
            geometry = VisionGeometryConfig.from_preprocessor_config(
                {**config, "min_pixels": _VIDEO_MIN_PIXELS, "max_pixels": _VIDEO_MAX_PIXELS})
        return cls(fps=float(config.get("fps") or DEFAULT_FPS),
                   min_frames=int(config.get("min_frames") or DEFAULT_MIN_FRAMES),
                   max_frames=int(config.get("max_frames") or DEFAULT_MAX_FRAMES), geometry=geometry)

    @property
    def kwargs(self) -> dict[str, Any]:
        """As processor kwargs (what a request may override; part of every video's key)."""
        return {"fps": float(self.fps), "min_frames": self.min_frames, "max_frames": self.max_frames,
                **self.geometry.pixel_kwargs}

    def with_kwargs(self, overrides: Mapping[str, Any] | None, ceiling: VideoSampling) -> VideoSampling:
        """These settings with a request's ``mm_processor_kwargs`` applied (``ValueError`` naming
        what is wrong); ``max_frames`` and the pixel bounds stay within ``ceiling``'s (the
        checkpoint's own: the encoder's budgets are sized by its largest video)."""
        if not overrides:
            return self
        sampling = {k: overrides[k] for k in SAMPLING_KWARGS if k in overrides}
        if "fps" in sampling and not isinstance(sampling["fps"], bool) and isinstance(sampling["fps"], int):
            sampling["fps"] = float(sampling["fps"])
        pixels = {k: v for k, v in overrides.items() if k not in SAMPLING_KWARGS}
        geometry = ceiling.geometry.with_pixel_kwargs({**self.geometry.pixel_kwargs, **pixels}) if pixels \
            else self.geometry
        out = VideoSampling(**{"fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames,
                               **sampling, "geometry": geometry})
        if out.max_frames > ceiling.max_frames:
            raise ValueError(f"max_frames must be at most {ceiling.max_frames} (the checkpoint's), got {out.max_frames}")
        return out

    @property
    def max_encoder_tokens(self) -> int:
        """Encoder tokens of the largest video these settings make: the most frames, each at most
        the largest frame ``smart_resize`` allows."""
        from epd.multimodal.geometry import max_tokens_per_item

        return self.max_frames // self.geometry.temporal_patch_size * max_tokens_per_item(self.geometry)


@dataclass(frozen=True)
class VideoGeometry:
    """A video as the model sees it: which frames, at what size, how many patches and rows."""

    metadata: VideoMetadata
    frames_indices: tuple[int, ...]
    resized_height_px: int
    resized_width_px: int
    grid_thw: tuple[int, int, int]  # (temporal patches, patches down, patches across): HF video_grid_thw
    num_patches: int  # t*h*w: encoder attention tokens
    num_embedding_rows: int  # num_patches // merge_size**2: the placeholder span
    second_per_grid_t: float  # seconds of video per temporal patch (Qwen2.5-VL's M-RoPE uses it)

    @property
    def sampled_fps(self) -> float:
        return len(self.frames_indices) / self.metadata.total_num_frames * self.metadata.fps


# ---- the header ----------------------------------------------------------------------------------

def probe_video(data: bytes, limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> VideoMetadata:
    """The container header's facts, checked against ``limits``; no frame is decoded."""
    if not data:
        raise MediaError("expected video bytes, got 0 bytes")
    if len(data) > limits.max_bytes:
        raise MediaError(f"video is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    av = _av()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(f"expected a video stream in the container, found none ({len(data)} bytes)")
            stream = container.streams.video[0]
            meta = _metadata(container, stream)
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise MediaError(f"expected a video container PyAV can read (MP4, Matroska, WebM, AVI, ...); got "
                         f"{len(data)} bytes starting with {data[:8]!r}: {exc}") from None
    _check_metadata(meta, limits)
    return meta


def _metadata(container, stream) -> VideoMetadata:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    duration_s = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0
    if not duration_s and container.duration:
        duration_s = container.duration / 1_000_000  # AV_TIME_BASE: microseconds
    total = int(stream.frames or 0)
    if not total and duration_s and fps:  # containers without a frame count (Matroska, WebM)
        total = round(duration_s * fps)
    if not duration_s and total and fps:
        duration_s = total / fps
    width, height = stream.codec_context.width, stream.codec_context.height
    return VideoMetadata(int(width or 0), int(height or 0), fps, total, duration_s)


def _check_metadata(meta: VideoMetadata, limits: VideoLimits) -> None:
    if meta.width_px <= 0 or meta.height_px <= 0:
        raise MediaError(f"video declares an empty frame size {meta.width_px}x{meta.height_px}")
    if max(meta.width_px, meta.height_px) > limits.max_side_px:
        raise MediaError(f"video frames are {meta.width_px}x{meta.height_px}; each side must be at most "
                         f"{limits.max_side_px} px")
    if not 0 < meta.fps <= limits.max_fps or not math.isfinite(meta.fps):
        raise MediaError(f"video declares {meta.fps} frames per second; expected (0, {limits.max_fps}]")
    if meta.total_num_frames <= 0:
        raise MediaError("video declares no frames (an empty or truncated container)")
    if meta.total_num_frames > limits.max_total_frames:
        raise MediaError(f"video declares {meta.total_num_frames} frames; at most {limits.max_total_frames}")
    if not 0 < meta.duration_s <= limits.max_duration_s:
        raise MediaError(f"video declares a duration of {meta.duration_s:.3f} s; expected (0, "
                         f"{limits.max_duration_s:g}] s")


# ---- sampling and geometry -----------------------------------------------------------------------

def sample_frame_indices(meta: VideoMetadata, sampling: VideoSampling) -> tuple[int, ...]:
    """transformers' Qwen2-VL ``sample_frames`` with ``fps``: ``total / video fps * fps`` frames,
    clamped to [min_frames, max_frames] and the video's own frame count, rounded down to the
    temporal patch size, spread evenly (the same float32 ``arange`` it uses)."""
    import torch

    tps = sampling.geometry.temporal_patch_size
    total = meta.total_num_frames
    max_frames = math.floor(min(sampling.max_frames, total) / tps) * tps
    wanted = total / meta.fps * sampling.fps
    num_frames = math.floor(min(max(wanted, sampling.min_frames), max_frames, total) / tps) * tps
    if num_frames < tps:
        raise MediaError(f"video has {total} frames; at least {tps} (one temporal patch) are needed")
    return tuple(torch.arange(0, total, total / num_frames).int().tolist()[:num_frames])


def video_geometry(meta: VideoMetadata, sampling: VideoSampling,
                   limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> VideoGeometry:
    """Which frames, at what size, and how many rows: all from the header."""
    indices = sample_frame_indices(meta, sampling)
    decoded = len(indices) * meta.width_px * meta.height_px
    if decoded > limits.max_decoded_pixels:
        raise MediaError(f"video would decode {len(indices)} frames of {meta.width_px}x{meta.height_px} = "
                         f"{decoded} pixels; at most {limits.max_decoded_pixels} (lower fps or max_frames)")
    cfg = sampling.geometry
    height, width = smart_resize(meta.height_px, meta.width_px, cfg.factor_px, cfg.min_pixels, cfg.max_pixels)
    grid = (len(indices) // cfg.temporal_patch_size, height // cfg.patch_size, width // cfg.patch_size)
    num_patches = math.prod(grid)
    sampled_fps = len(indices) / meta.total_num_frames * meta.fps
    return VideoGeometry(meta, indices, height, width, grid, num_patches, num_patches // cfg.merge_size ** 2,
                         cfg.temporal_patch_size / sampled_fps)


def video_geometry_from_bytes(data: bytes, sampling: VideoSampling,
                              limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> VideoGeometry:
    return video_geometry(probe_video(data, limits), sampling, limits)


def hash_encoded_video(data: bytes, geometry: VideoGeometry, *, processor_kwargs: Mapping[str, Any],
                       model_id: str, frames_hash: str | None = None) -> str:
    """The cache key of a video from its source bytes: their BLAKE3 digest plus the sampling facts
    (not every decoded frame). ``frames_hash``: frames built by hand, keyed by their pixels
    (``hash_video_frames``) instead of the container made of them."""
    from blake3 import blake3

    meta = geometry.metadata
    source = {"frames_hash": frames_hash} if frames_hash else {"raw_bytes_hash": blake3(bytes(data)).hexdigest()}
    return hash_item({"kind": "encoded_video", "model_id": model_id, "processor_kwargs": dict(processor_kwargs),
                      **source,
                      "frames_indices": list(geometry.frames_indices), "fps": float(meta.fps),
                      "duration": float(meta.duration_s), "total_num_frames": meta.total_num_frames})


def hash_video_frames(frames: Sequence[np.ndarray], *, processor_kwargs: Mapping[str, Any], model_id: str) -> str:
    """The cache key of frames built by hand (no source bytes to anchor it): every pixel."""
    return hash_item({"kind": "video_frames", "model_id": model_id, "processor_kwargs": dict(processor_kwargs),
                      "frames": [np.ascontiguousarray(f) for f in frames]})


# ---- frames ------------------------------------------------------------------------------------

def decode_frames(data: bytes, geometry: VideoGeometry) -> list[np.ndarray]:
    """The sampled frames as RGB uint8 arrays [H, W, 3], decoding no further than the last one. A
    container that ends before it (truncated, or a header that lies) is a ``MediaError``."""
    av = _av()
    wanted = set(geometry.frames_indices)
    last = geometry.frames_indices[-1]
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= last:
                    break
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise MediaError(f"video does not decode after {len(frames)} of {len(wanted)} sampled frames: {exc}") \
            from None
    if len(frames) != len(wanted):
        raise MediaError(f"video ended after {len(frames)} of the {len(wanted)} sampled frames (its header "
                         f"declares {geometry.metadata.total_num_frames} frames): truncated or mislabelled")
    shape = (geometry.metadata.height_px, geometry.metadata.width_px, 3)
    if any(f.shape != shape for f in frames):
        raise MediaError(f"video frames change size mid-stream; expected every frame {shape[1]}x{shape[0]}")
    return frames


def frames_to_video(frames: Sequence[Any], fps: float = DEFAULT_FPS) -> bytes:
    """Frames built by hand ([H, W, 3] uint8 arrays or PIL images, all one size) as a lossless
    video (FFV1 in Matroska) at ``fps``: the one form every tier takes. Its key is its pixels
    (``hash_video_frames``), since these bytes have no source to anchor it."""
    av = _av()
    arrays = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in frames]
    if not arrays:
        raise MediaError("a video of frames needs at least one frame, got none")
    shape = arrays[0].shape
    if len(shape) != 3 or shape[2] != 3 or any(a.shape != shape or a.dtype != np.uint8 for a in arrays):
        raise MediaError(f"video frames must be RGB uint8 arrays [H, W, 3] of one size, got {shape} "
                         f"{arrays[0].dtype} first")
    if not 0 < fps:
        raise MediaError(f"fps must be > 0, got {fps}")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fractions.Fraction(fps).limit_denominator(1000))
        stream.height, stream.width = shape[:2]
        stream.pix_fmt = "bgr0"
        for frame in arrays:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _av():
    import av  # imported on first use: processes that never see a video never load FFmpeg

    return av
