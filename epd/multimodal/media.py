"""Image inputs: bytes in, limits enforced, RGB out.

Everything that reaches PIL here is untrusted. Three rules follow:

* Sizes are checked before work is done: byte counts before reading or base64
  decoding, declared pixel counts (from the header) before decoding pixels.
* No global PIL state is changed (``Image.MAX_IMAGE_PIXELS``,
  ``ImageFile.LOAD_TRUNCATED_IMAGES``); our limits are checked beside PIL's.
* Every failure a client can cause becomes a ``MediaError`` that says what was
  expected and what came, so the API layer can answer 400 without guessing.

Remote URLs are not fetched here; the router's fetcher owns network access
(timeouts, redirects, SSRF rules) and hands the bytes to ``load_media_bytes``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from epd.errors import InvalidRequest

MIB = 1024 * 1024

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_REMOTE_SCHEMES = ("http", "https")
# Local, non-hostname authorities a file:// URL may name (RFC 8089).
_LOCAL_FILE_HOSTS = ("", "localhost")
_SOURCE_PREVIEW_CHARS = 80


class MediaError(InvalidRequest):
    """A media input the server refuses: bad form, too large, or not a decodable image."""


class LocalFileRefused(MediaError):
    """A local path this server may not read: no allowed root, or outside it."""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 32 * MIB  # encoded size (file, data URL payload, raw bytes)
    max_pixels: int = 32 * 1024 * 1024  # width * height, checked from the header: ~96 MiB once RGB
    max_side_px: int = 16384  # either side; guards extreme strips that pass max_pixels

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_side_px"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MediaLimits.{name} must be > 0, got {getattr(self, name)}")


DEFAULT_LIMITS = MediaLimits()

MODALITIES = ("image", "video")


@dataclass(frozen=True)
class MediaInput:
    """One item for a vision encoder: the encoded bytes of an image or a video, and the processor
    kwargs it is resized (a video also sampled) by; None: the checkpoint's own."""

    data: bytes
    modality: str = "image"
    processor_kwargs: Mapping[str, Any] | None = None
    # what names its content when the bytes do not: a video built from frames by hand is keyed by
    # its pixels (``video.hash_video_frames``), not by the container made of them here
    content_hash: str | None = None

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise MediaError(f"expected a modality in {list(MODALITIES)}, got {self.modality!r}")

    @classmethod
    def of(cls, value: MediaInput | bytes) -> MediaInput:
        """Plain bytes are an image with the checkpoint's kwargs."""
        return value if isinstance(value, MediaInput) else cls(bytes(value))


# ---------------------------------------------------------------------------
# Source -> bytes
# ---------------------------------------------------------------------------


def load_media_bytes(
    source: str | bytes | os.PathLike,
    *,
    allowed_local_root: str | os.PathLike | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
    modality: str = "image",
) -> bytes:
    """Raw encoded bytes of an image (or a video: ``modality``) given as bytes, a ``data:`` URL
    (``image/*``, or ``video/*`` for a video), a ``file://`` URL or a path.

    Local files are read only when ``allowed_local_root`` is given and the path,
    after resolving symlinks and ``..``, lies inside it. Relative paths are
    relative to the process working directory, like any other path. ``http(s)``
    URLs are refused: the router's fetcher downloads them.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _check_size(bytes(source), "raw bytes", limits)
    if isinstance(source, os.PathLike):
        return _read_local_file(os.fspath(source), allowed_local_root, limits)
    if not isinstance(source, str):
        raise MediaError(
            f"expected image bytes, a data: URL, a file:// URL or a local path; "
            f"got a {type(source).__name__}"
        )
    scheme = _url_scheme(source)
    if scheme is None:
        return _read_local_file(source, allowed_local_root, limits)
    if scheme == "data":
        return _decode_data_url(source, limits, modality)
    if scheme == "file":
        return _read_local_file(_file_url_path(source), allowed_local_root, limits)
    if scheme in _REMOTE_SCHEMES:
        raise MediaError(
            f"remote URL {_preview(source)!r} is not loaded here: http(s) images are "
            f"fetched by the router's media fetcher, which passes on the bytes"
        )
    raise MediaError(
        f"unsupported URL scheme {scheme!r} in {_preview(source)!r}; "
        f"expected data:, file:// or http(s)://"
    )


def _url_scheme(source: str) -> str | None:
    match = _URL_SCHEME.match(source)
    # A one-letter "scheme" is a Windows drive ("C:\\img.png"), i.e. a path.
    if match is None or len(match.group(1)) == 1:
        return None
    return match.group(1).lower()


def _preview(source: str) -> str:
    # Data URLs can be megabytes; never echo a whole one into an error message.
    if len(source) <= _SOURCE_PREVIEW_CHARS:
        return source
    return source[:_SOURCE_PREVIEW_CHARS] + "..."


def _check_size(data: bytes, what: str, limits: MediaLimits) -> bytes:
    if not data:
        raise MediaError(f"{what}: expected image bytes, got 0 bytes")
    if len(data) > limits.max_bytes:
        raise MediaError(f"{what}: {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    return data


def _decode_data_url(url: str, limits: MediaLimits, modality: str = "image") -> bytes:
    """``data:image/<subtype>[;param...];base64,<payload>`` (a video: ``video/<subtype>``) -> payload bytes."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"data URL {_preview(url)!r} has no ',' separating header and payload")
    params = [p.strip() for p in header[len("data:"):].split(";")]
    mime_type = params[0].lower()
    if not mime_type.startswith(f"{modality}/"):
        raise MediaError(f"data URL must carry an {modality}/* type, got {mime_type or 'no type'!r}")
    if "base64" not in (p.lower() for p in params[1:]):
        raise MediaError(f"data URL with type {mime_type!r} must be base64-encoded (';base64,')")
    # Base64 grows data by 4/3; refuse before decoding so a huge payload costs no memory twice.
    encoded = "".join(payload.split())  # line breaks are common in pasted base64
    max_encoded_chars = (limits.max_bytes + 2) // 3 * 4
    if len(encoded) > max_encoded_chars:
        raise MediaError(
            f"data URL payload decodes to more than {limits.max_bytes} bytes "
            f"({len(encoded)} base64 characters)"
        )
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"data URL payload is not valid base64: {exc}") from exc
    _check_size(data, "data URL payload", limits)
    _check_declared_format(mime_type, data)
    return data


# a data URL's declared type, as the format PIL reads from the bytes
_FORMAT_OF_MIME = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/pjpeg": "JPEG",
                   "image/webp": "WEBP", "image/gif": "GIF", "image/bmp": "BMP", "image/tiff": "TIFF"}


def _check_declared_format(mime_type: str, data: bytes) -> None:
    """A data URL whose bytes are another format than it declares is refused: the client sent
    something else than it meant to (and a type and content that disagree is how filters are
    slipped past). Types we do not map (``image/*``, vendor types) are not judged."""
    declared = _FORMAT_OF_MIME.get(mime_type)
    if declared is None:
        return
    try:
        with Image.open(io.BytesIO(data)) as image:
            actual = image.format
    except Exception:  # noqa: BLE001 - no readable header: the size check names that problem
        return
    if actual is not None and actual != declared:
        raise MediaError(f"data URL declares {mime_type} but the data is {actual}")


def _file_url_path(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc.lower() not in _LOCAL_FILE_HOSTS:
        raise MediaError(
            f"file URL {_preview(url)!r} names host {parsed.netloc!r}; "
            f"expected file:///absolute/path or file://localhost/absolute/path"
        )
    return urllib.request.url2pathname(parsed.path)


def _read_local_file(path: str, allowed_local_root: str | os.PathLike | None, limits: MediaLimits) -> bytes:
    if allowed_local_root is None:
        raise LocalFileRefused(
            f"local file {path!r} refused: local paths are disabled on this server "
            f"(no allowed local root is configured); send the image as bytes or a data URL"
        )
    real_path = _resolve_inside_root(path, allowed_local_root)
    return _read_regular_file(real_path, limits)


def _resolve_inside_root(path: str, allowed_local_root: str | os.PathLike) -> Path:
    root = Path(allowed_local_root).resolve()
    # "..": judged on the path as written first, so whether a file outside the root exists is
    # never told (a "does not exist" for root/../../etc/x would be)
    written = Path(os.path.abspath(Path(path).expanduser()))
    if not (written.is_relative_to(root) or written.is_relative_to(os.path.abspath(allowed_local_root))):
        raise LocalFileRefused(f"local file {path!r} lies outside the allowed root {str(root)!r}")
    try:
        # strict: resolve every symlink now, so the containment check sees the real target.
        real_path = Path(path).expanduser().resolve(strict=True)
    except FileNotFoundError as exc:
        raise MediaError(f"local file {path!r} does not exist") from exc
    except (OSError, RuntimeError) as exc:  # permission denied, symlink loop
        raise MediaError(f"local file {path!r} cannot be resolved: {exc}") from exc
    if not real_path.is_relative_to(root):
        raise LocalFileRefused(
            f"local file {path!r} resolves to {str(real_path)!r}, outside the allowed "
            f"root {str(root)!r}"
        )
    return real_path


def _read_regular_file(real_path: Path, limits: MediaLimits) -> bytes:
    # O_NOFOLLOW: the last component may not have been swapped for a symlink since
    # resolve(). O_NONBLOCK: opening a FIFO must not hang the server.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real_path, flags)
    except OSError as exc:
        raise MediaError(f"local file {str(real_path)!r} cannot be opened: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"local path {str(real_path)!r} is not a regular file")
        if info.st_size > limits.max_bytes:
            raise MediaError(
                f"local file {str(real_path)!r}: {info.st_size} bytes exceeds the limit "
                f"of {limits.max_bytes} bytes"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            # One byte over the limit tells us the file grew after fstat.
            data = f.read(limits.max_bytes + 1)
    finally:
        os.close(fd)
    return _check_size(data, f"local file {str(real_path)!r}", limits)


# ---------------------------------------------------------------------------
# Bytes -> size / pixels
# ---------------------------------------------------------------------------


def read_image_size(data: bytes) -> tuple[int, int]:
    """(width_px, height_px) from the image header; pixels are not decoded."""
    with _open_image(data) as image:
        return image.size


def decode_image(data: bytes, *, limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode to an RGB image, refusing oversize images before their pixels are decoded.

    Transparency is composited onto white, as transformers' ``convert_to_rgb``
    does for the Qwen2-VL processors, so our pixels match what HF would feed
    the encoder. EXIF orientation is not applied: the decoded size must equal
    the header size that placeholder counts were computed from. Animated
    formats yield their first frame.
    """
    _check_size(data, "image", limits)
    with _open_image(data) as image:
        _check_declared_size(image.size, limits)
        try:
            image.load()
        except MemoryError:
            raise
        except Exception as exc:  # PIL decoders raise many types on corrupt input
            raise MediaError(
                f"{image.format or 'image'} data is truncated or corrupt "
                f"({image.size[0]}x{image.size[1]} declared): {exc}"
            ) from exc
        return _to_rgb(image)


def _open_image(data: bytes) -> Image.Image:
    if not data:
        raise MediaError("expected image bytes, got 0 bytes")
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        # Raised by PIL when the header alone declares an absurd pixel count.
        raise MediaError(f"image refused as a decompression bomb: {exc}") from exc
    except MemoryError:
        raise
    except Exception as exc:  # UnidentifiedImageError, and plugin errors on broken headers
        raise MediaError(
            f"expected an image in a format PIL can read (PNG, JPEG, WebP, GIF, ...); "
            f"got {len(data)} bytes starting with {data[:8]!r}: {exc}"
        ) from exc


def _check_declared_size(size_px: tuple[int, int], limits: MediaLimits) -> None:
    width_px, height_px = size_px
    if width_px <= 0 or height_px <= 0:
        raise MediaError(f"image declares an empty size {width_px}x{height_px}")
    if max(width_px, height_px) > limits.max_side_px:
        raise MediaError(
            f"image is {width_px}x{height_px}; each side must be at most {limits.max_side_px} px"
        )
    num_pixels = width_px * height_px
    # PIL's own bomb threshold (warning level) still applies: we never raise it globally.
    pil_max_pixels = Image.MAX_IMAGE_PIXELS or num_pixels
    max_pixels = min(limits.max_pixels, pil_max_pixels)
    if num_pixels > max_pixels:
        raise MediaError(
            f"image is {width_px}x{height_px} = {num_pixels} pixels; at most {max_pixels} "
            f"pixels are decoded (decompression-bomb guard)"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    # Mirrors transformers.image_transforms.convert_to_rgb (5.x): alpha -> white background.
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
