"""Media loading: every way an input can be malformed, oversized or out of bounds."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from epd.multimodal.media import MediaError, MediaLimits, decode_image, load_media_bytes, read_image_size


def _encode(image: Image.Image, fmt: str = "PNG", **save_kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def _noise_image(width_px: int, height_px: int, mode: str = "RGB") -> Image.Image:
    # Noise keeps JPEG/PNG payloads large enough that truncation lands in pixel data.
    rng = np.random.default_rng(0)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, size=(height_px, width_px, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode)


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def _png_header_only(width_px: int, height_px: int) -> bytes:
    """A tiny, valid-looking PNG whose IHDR declares any size: a decompression-bomb stand-in."""
    ihdr = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(b""))
        + _png_chunk(b"IEND", b"")
    )


@pytest.fixture
def png_bytes() -> bytes:
    return _encode(_noise_image(40, 30))


@pytest.fixture
def media_root(tmp_path: Path, png_bytes: bytes) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(png_bytes)
    (tmp_path / "secret.png").write_bytes(png_bytes)
    return root


# ---------------------------------------------------------------------------
# load_media_bytes: in-memory sources
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_raw_bytes_pass_through(png_bytes: bytes, wrap) -> None:
    assert load_media_bytes(wrap(png_bytes)) == png_bytes


def test_empty_bytes_refused() -> None:
    with pytest.raises(MediaError, match="got 0 bytes"):
        load_media_bytes(b"")


def test_raw_bytes_over_limit_refused(png_bytes: bytes) -> None:
    with pytest.raises(MediaError, match=f"{len(png_bytes)} bytes exceeds the limit of 100 bytes"):
        load_media_bytes(png_bytes, limits=MediaLimits(max_bytes=100))


def test_data_url_decoded(png_bytes: bytes) -> None:
    encoded = base64.b64encode(png_bytes).decode()
    assert load_media_bytes(f"data:image/png;base64,{encoded}") == png_bytes
    # Scheme and type are case-insensitive; pasted base64 often carries line breaks.
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert load_media_bytes(f"DATA:Image/PNG;base64,{wrapped}") == png_bytes


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:text/plain;base64,aGVsbG8=", "image/\\* type, got 'text/plain'"),
        ("data:;base64,aGVsbG8=", "got 'no type'"),
        ("data:image/png,rawbytes", "must be base64-encoded"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,", "got 0 bytes"),
    ],
)
def test_bad_data_url_refused(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_media_bytes(url)


def test_data_url_over_limit_refused_before_decoding() -> None:
    payload = "A" * 4_000_000  # valid base64 for 3 MB of zeros
    with pytest.raises(MediaError, match="decodes to more than 1000 bytes"):
        load_media_bytes(f"data:image/png;base64,{payload}", limits=MediaLimits(max_bytes=1000))


@pytest.mark.parametrize("url", ["http://example.com/a.png", "HTTPS://example.com/a.png"])
def test_remote_urls_left_to_router(url: str) -> None:
    with pytest.raises(MediaError, match="router's media fetcher"):
        load_media_bytes(url)


def test_unknown_scheme_refused() -> None:
    with pytest.raises(MediaError, match="unsupported URL scheme 's3'"):
        load_media_bytes("s3://bucket/a.png")


def test_wrong_source_type_refused() -> None:
    with pytest.raises(MediaError, match="got a int"):
        load_media_bytes(42)  # type: ignore[arg-type]


def test_error_message_does_not_echo_whole_url() -> None:
    url = "ftp://" + "x" * 10_000
    with pytest.raises(MediaError) as info:
        load_media_bytes(url)
    assert len(str(info.value)) < 300


# ---------------------------------------------------------------------------
# load_media_bytes: local files
# ---------------------------------------------------------------------------


def test_local_path_inside_root(media_root: Path, png_bytes: bytes) -> None:
    path = media_root / "cat.png"
    assert load_media_bytes(str(path), allowed_local_root=media_root) == png_bytes
    assert load_media_bytes(path, allowed_local_root=str(media_root)) == png_bytes
    assert load_media_bytes(path.as_uri(), allowed_local_root=media_root) == png_bytes
    assert load_media_bytes(f"file://localhost{path}", allowed_local_root=media_root) == png_bytes


def test_dotdot_that_stays_inside_root_allowed(media_root: Path, png_bytes: bytes) -> None:
    path = f"{media_root}/sub/../cat.png"
    assert load_media_bytes(path, allowed_local_root=media_root) == png_bytes


def test_relative_path_is_relative_to_cwd(media_root: Path, png_bytes: bytes, monkeypatch) -> None:
    monkeypatch.chdir(media_root.parent)
    assert load_media_bytes("root/cat.png", allowed_local_root="root") == png_bytes


def test_local_paths_refused_without_root(media_root: Path) -> None:
    with pytest.raises(MediaError, match="local paths are disabled"):
        load_media_bytes(str(media_root / "cat.png"))
    with pytest.raises(MediaError, match="local paths are disabled"):
        load_media_bytes((media_root / "cat.png").as_uri())


def test_path_outside_root_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="outside the allowed root"):
        load_media_bytes(str(media_root.parent / "secret.png"), allowed_local_root=media_root)


def test_dotdot_escape_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="outside the allowed root"):
        load_media_bytes(f"{media_root}/sub/../../secret.png", allowed_local_root=media_root)
    with pytest.raises(MediaError, match="outside the allowed root"):
        load_media_bytes(f"file://{media_root}/../secret.png", allowed_local_root=media_root)


def test_symlink_escape_refused(media_root: Path) -> None:
    (media_root / "link.png").symlink_to(media_root.parent / "secret.png")
    (media_root / "linkdir").symlink_to(media_root.parent, target_is_directory=True)
    with pytest.raises(MediaError, match="outside the allowed root"):
        load_media_bytes(str(media_root / "link.png"), allowed_local_root=media_root)
    with pytest.raises(MediaError, match="outside the allowed root"):
        load_media_bytes(str(media_root / "linkdir" / "secret.png"), allowed_local_root=media_root)


def test_symlink_inside_root_allowed(media_root: Path, png_bytes: bytes) -> None:
    (media_root / "sub" / "alias.png").symlink_to(media_root / "cat.png")
    assert load_media_bytes(str(media_root / "sub" / "alias.png"), allowed_local_root=media_root) == png_bytes


def test_missing_file_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="does not exist"):
        load_media_bytes(str(media_root / "nope.png"), allowed_local_root=media_root)


def test_directory_and_fifo_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="not a regular file"):
        load_media_bytes(str(media_root / "sub"), allowed_local_root=media_root)
    fifo = media_root / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(MediaError, match="not a regular file"):  # and must not block
        load_media_bytes(str(fifo), allowed_local_root=media_root)


def test_local_file_over_limit_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="exceeds the limit of 100 bytes"):
        load_media_bytes(
            str(media_root / "cat.png"), allowed_local_root=media_root, limits=MediaLimits(max_bytes=100)
        )


def test_file_url_with_remote_host_refused(media_root: Path) -> None:
    with pytest.raises(MediaError, match="names host 'fileserver'"):
        load_media_bytes("file://fileserver/share/cat.png", allowed_local_root=media_root)


# ---------------------------------------------------------------------------
# read_image_size / decode_image
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_read_image_size_is_width_height(fmt: str) -> None:
    assert read_image_size(_encode(_noise_image(37, 21), fmt)) == (37, 21)


@pytest.mark.parametrize("data", [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 20])
def test_non_image_bytes_refused(data: bytes) -> None:
    with pytest.raises(MediaError, match="expected"):
        read_image_size(data)
    with pytest.raises(MediaError, match="expected"):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_refused(fmt: str) -> None:
    data = _encode(_noise_image(64, 48), fmt)
    truncated = data[: len(data) // 2]
    # The header survives, so the size (and hence geometry) is still known...
    assert read_image_size(truncated) == (64, 48)
    # ...but decoding the pixels fails with a clear error.
    with pytest.raises(MediaError, match="truncated or corrupt"):
        decode_image(truncated)


def test_corrupt_png_refused() -> None:
    data = bytearray(_encode(_noise_image(64, 48)))
    idat_at = data.index(b"IDAT")
    data[idat_at + 20 : idat_at + 40] = b"\xff" * 20
    with pytest.raises(MediaError, match="truncated or corrupt"):
        decode_image(bytes(data))


def test_pil_bomb_header_refused() -> None:
    bomb = _png_header_only(100_000, 100_000)  # 1e10 pixels from a ~60-byte file
    with pytest.raises(MediaError, match="decompression bomb"):
        read_image_size(bomb)
    with pytest.raises(MediaError, match="decompression bomb"):
        decode_image(bomb)


def test_pixels_over_limit_refused_from_header() -> None:
    header = _png_header_only(8000, 8000)  # 64 Mpx: under PIL's bomb limit, over ours
    assert read_image_size(header) == (8000, 8000)
    with pytest.raises(MediaError, match="8000x8000 = 64000000 pixels; at most 33554432"):
        decode_image(header)
    with pytest.raises(MediaError, match="at most 100 pixels"):
        decode_image(_encode(_noise_image(20, 20)), limits=MediaLimits(max_pixels=100))


def test_side_over_limit_refused() -> None:
    with pytest.raises(MediaError, match="each side must be at most 16384 px"):
        decode_image(_png_header_only(17_000, 1))


def test_decode_over_max_bytes_refused(png_bytes: bytes) -> None:
    with pytest.raises(MediaError, match="exceeds the limit of 10 bytes"):
        decode_image(png_bytes, limits=MediaLimits(max_bytes=10))


def test_pil_global_state_untouched(png_bytes: bytes) -> None:
    before = Image.MAX_IMAGE_PIXELS
    decode_image(png_bytes)
    with pytest.raises(MediaError):
        decode_image(_png_header_only(8000, 8000))
    assert Image.MAX_IMAGE_PIXELS == before


def _mode_cases() -> list[tuple[str, bytes]]:
    rgba = _noise_image(16, 12, "RGBA")
    palette = _noise_image(16, 12).convert("P")
    palette_with_transparency = palette.copy()
    palette_with_transparency.info["transparency"] = 0
    return [
        ("RGB", _encode(_noise_image(16, 12))),
        ("L", _encode(_noise_image(16, 12, "L"))),
        ("LA", _encode(_noise_image(16, 12, "LA"))),
        ("RGBA", _encode(rgba)),
        ("P", _encode(palette)),
        ("P+tRNS", _encode(palette_with_transparency)),
        ("1", _encode(_noise_image(16, 12, "L").convert("1"))),
        ("CMYK JPEG", _encode(_noise_image(16, 12, "CMYK"), "JPEG")),
        ("RGBA WEBP", _encode(rgba, "WEBP", lossless=True)),
    ]


@pytest.mark.parametrize("label, data", _mode_cases(), ids=[label for label, _ in _mode_cases()])
def test_modes_decode_to_rgb_like_transformers(label: str, data: bytes) -> None:
    from transformers.image_transforms import convert_to_rgb

    image = decode_image(data)
    assert image.mode == "RGB"
    assert image.size == (16, 12)
    expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(image), expected)


def test_transparent_pixels_become_white() -> None:
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    image.putpixel((0, 0), (10, 20, 30, 255))
    decoded = decode_image(_encode(image))
    assert decoded.getpixel((1, 1)) == (255, 255, 255)
    assert decoded.getpixel((0, 0)) == (10, 20, 30)


def test_outside_the_root_reads_the_same_whether_the_file_exists_or_not(media_root: Path) -> None:
    """No oracle for files outside the root: ``..`` is judged on the path as written."""
    (media_root.parent / "exists.png").write_bytes(b"\x89PNG")
    messages = []
    for name in ("exists.png", "missing.png"):
        with pytest.raises(MediaError) as refused:
            load_media_bytes(f"{media_root}/../{name}", allowed_local_root=media_root)
        messages.append(str(refused.value).replace(name, "NAME"))
    assert messages[0] == messages[1] and "outside the allowed root" in messages[0]


def test_a_root_given_through_a_symlink_still_serves_its_files(media_root: Path, png_bytes: bytes) -> None:
    link = media_root.parent / "link-to-root"
    link.symlink_to(media_root)
    assert load_media_bytes(f"{link}/cat.png", allowed_local_root=link) == png_bytes


def test_a_data_url_whose_bytes_are_another_format_is_refused(png_bytes: bytes) -> None:
    import base64
    payload = base64.b64encode(png_bytes).decode()
    with pytest.raises(MediaError, match=r"data URL declares image/jpeg but the data is PNG"):
        load_media_bytes(f"data:image/jpeg;base64,{payload}")
    assert load_media_bytes(f"data:image/png;base64,{payload}") == png_bytes
    assert load_media_bytes(f"data:image/*;base64,{payload}") == png_bytes  # a type we do not judge
