"""The hostile-input corpus: requests an untrusted client can send to the public HTTP API, each with
the status and the words of the error it must get. Built once; ``test_hostile_inputs`` replays it
against a real ``epd serve``.

A case is (name, what is sent, expected status, a regex the error message must match). What is
sent is a JSON body (a dict), or raw bytes with a content type."""
from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from dataclasses import dataclass, field

from PIL import Image

from tests.conftest import make_image_bytes, make_video_bytes

# the serve under test runs with these limits (small, so a case that passes one is cheap to send)
LIMITS = {"max_request_body_bytes": 4 * 1024 * 1024, "max_messages": 64, "max_content_parts": 64,
          "max_text_chars": 20_000, "max_items_per_request": 4, "max_model_len": 2048}
MODEL = "m"


@dataclass
class Case:
    name: str
    body: dict | bytes
    status: int
    message: str  # regex the error message must match
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*parts, **fields) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}], **fields}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is it?"}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (10 G pixels), a few hundred bytes long."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 4096))
            + _png_chunk(b"IEND", b""))


def noise_jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()  # noise: a scan of several KB after a header of a few hundred bytes
    Image.frombytes("RGB", (width, height), random.Random(3).randbytes(width * height * 3)).save(out, "JPEG")
    return out.getvalue()


def corrupt_jpeg() -> bytes:
    """A JPEG whose header is intact (it passes the router's header check) and whose scan is
    overwritten and cut: only decoding the pixels, in the encoder, finds it."""
    data = bytearray(noise_jpeg(96, 64))
    data[len(data) // 3:len(data) // 2] = bytes(len(data) // 2 - len(data) // 3)
    return bytes(data[: len(data) * 2 // 3])


def cases(media_dir: str, loopback_url: str) -> list[Case]:
    png = make_image_bytes(64, 48, seed=5)
    clip = make_video_bytes(num_frames=8, fps=4, width=64, height=48, seed=5)
    too_big_for_the_body = "A" * (LIMITS["max_request_body_bytes"] + 1024)
    nested = b"[" * 200_000 + b"]" * 200_000
    return [
        # ---- the body itself
        Case("malformed JSON", b'{"model": "m", "messages": [', 400, r"not valid JSON"),
        Case("not UTF-8", b'{"model": "\xff\xfe"}', 400, r"not valid JSON|UTF-8"),
        Case("JSON that is not an object", b'[1, 2, 3]', 400, r"expected a JSON object"),
        Case("deeply nested JSON", nested, 400, r"nest|not valid JSON"),
        Case("wrong content type", b"model=m", 400, r"JSON", content_type="application/x-www-form-urlencoded"),
        Case("body over the limit", chat(TEXT, user=too_big_for_the_body), 413, r"max_request_body_bytes"),
        # ---- messages and parts
        Case("no messages", {"model": MODEL}, 400, r"messages"),
        Case("messages not a list", {"model": MODEL, "messages": "hi"}, 400, r"messages"),
        Case("empty messages", {"model": MODEL, "messages": []}, 400, r"messages"),
        Case("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, r"role"),
        Case("unknown part type", chat({"type": "audio_url", "audio_url": {"url": "x"}}), 400, r"audio_url"),
        Case("image part without url", chat({"type": "image_url", "image_url": {}}), 400, r"url"),
        Case("image part of the wrong shape", chat({"type": "image_url", "image_url": ["x"]}), 400, r"image_url"),
        Case("too many messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 65}, 400,
             r"max_messages"),
        Case("too many content parts", chat(*[TEXT] * 65), 400, r"max_content_parts"),
        Case("text too long", chat({"type": "text", "text": "x" * 20_001}), 400, r"max_text_chars"),
        Case("unknown model", {**chat(TEXT), "model": "gpt-4o"}, 404, r"model .*gpt-4o.* does not exist"),
        # ---- sampling and limits
        Case("huge max_tokens", chat(TEXT, max_tokens=10**9), 400, r"max_tokens|max_model_len"),
        Case("negative max_tokens", chat(TEXT, max_tokens=-1), 400, r"max_tokens"),
        Case("max_tokens not a number", chat(TEXT, max_tokens="ten"), 400, r"max_tokens"),
        Case("negative temperature", chat(TEXT, temperature=-1), 400, r"temperature"),
        Case("top_p above 1", chat(TEXT, top_p=2), 400, r"top_p"),
        Case("top_logprobs above 20", chat(TEXT, logprobs=True, top_logprobs=100), 400, r"top_logprobs"),
        Case("stream not a boolean", chat(TEXT, stream={"on": True}), 400, r"stream"),
        # ---- media the router refuses before any work
        Case("bad base64", chat(image("data:image/png;base64,!!!not-base64!!!"), TEXT), 400, r"base64"),
        Case("data URL that is not an image", chat(image(data_url(b"hello", "text/plain")), TEXT), 400,
             r"image"),
        Case("bytes that are no image format", chat(image(data_url(b"\x00" * 64)), TEXT), 400,
             r"messages\[0\]\.content\[0\]"),
        Case("decompression bomb", chat(image(data_url(bomb_png())), TEXT), 400, r"pixels|too large|bomb"),
        Case("extreme aspect ratio", chat(image(data_url(make_image_bytes(4000, 2, seed=1))), TEXT), 400,
             r"aspect ratio"),
        Case("too many images", chat(*[image(data_url(png))] * 5, TEXT), 400, r"max_items_per_request|images"),
        Case("path traversal", chat(image(f"file://{media_dir}/../../../etc/passwd"), TEXT), 400,
             r"allowed_local_media_path|outside"),
        Case("local file with no root allowed", chat(image("file:///etc/hostname"), TEXT), 400, r"file"),
        Case("SSRF by loopback IP", chat(image(f"{loopback_url}/a.png"), TEXT), 400, r"private|loopback|not public"),
        Case("SSRF by name", chat(image("http://localhost/a.png"), TEXT), 400, r"private|loopback|not public"),
        Case("SSRF to cloud metadata", chat(image("http://169.254.169.254/latest/meta-data/"), TEXT), 400,
             r"private|link-local|not public"),
        Case("SSRF by decimal IP", chat(image("http://2130706433/a.png"), TEXT), 400, r"private|loopback|not public"),
        Case("SSRF by IPv6 loopback", chat(image("http://[::1]/a.png"), TEXT), 400, r"private|loopback|not public"),
        Case("unsupported URL scheme", chat(image("ftp://example.com/a.png"), TEXT), 400, r"scheme|ftp"),
        # ---- media that pass the header check and fail to decode in the encoder
        Case("truncated PNG", chat(TEXT, image(data_url(png[: len(png) // 2]))), 400,
             r"messages\[0\]\.content\[1\].*truncated or corrupt"),
        Case("corrupt JPEG", chat(image(data_url(corrupt_jpeg(), "image/jpeg")), TEXT), 400,
             r"messages\[0\]\.content\[0\]: .*JPEG data is truncated or corrupt \(96x64 declared\)"),
        Case("PNG sent as image/jpeg", chat(image(data_url(png, "image/jpeg")), TEXT), 400,
             r"messages\[0\]\.content\[0\].*image/jpeg.*PNG"),
        # ---- videos
        Case("video data URL that is no video", chat(video(data_url(b"\x00" * 512, "video/mp4")), TEXT), 400,
             r"messages\[0\]\.content\[0\].*expected a video container"),
        Case("image sent as a video", chat(video(data_url(png)), TEXT), 400, r"video/\* type"),
        Case("truncated video container", chat(video(data_url(clip[: len(clip) // 3], "video/x-matroska")), TEXT),
             400, r"video"),
        Case("video of one frame", chat(video(data_url(make_video_bytes(num_frames=1, fps=1), "video/x-matroska")),
                                        TEXT), 400, r"at least 2"),
        Case("video frames of absurd size", chat(video(data_url(make_video_bytes(num_frames=2, fps=1, width=8200,
                                                                                 height=2), "video/x-matroska")),
                                                 TEXT), 400, r"at most 8192 px"),
        Case("absurd frame rate", chat(video(data_url(make_video_bytes(num_frames=4, fps=5000), "video/x-matroska")),
                                       TEXT), 400, r"frames per second"),
        Case("video part of the wrong shape", chat({"type": "video_url", "video_url": ["x"]}), 400, r"video_url"),
        Case("unsupported processor kwarg", chat(video(data_url(clip, "video/x-matroska")), TEXT,
                                                 mm_processor_kwargs={"num_frames": 4}), 400, r"num_frames"),
    ]
