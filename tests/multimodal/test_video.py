"""Video inputs (epd/multimodal/video.py): the container header, frame sampling (transformers'
Qwen2-VL rule, worked by hand), geometry, the cache key from source bytes + sampling facts, the
decoded frames, and every hostile input a MediaError (a 400) naming its limit."""
from __future__ import annotations

import numpy as np
import pytest

from epd.multimodal.geometry import VisionGeometryConfig
from epd.multimodal.media import MediaError
from epd.multimodal.processor_kwargs import MediaSettings
from epd.multimodal.video import (
    VideoLimits,
    VideoMetadata,
    VideoSampling,
    decode_frames,
    hash_encoded_video,
    hash_video_frames,
    probe_video,
    sample_frame_indices,
    video_geometry,
    video_geometry_from_bytes,
)
from tests.conftest import make_video_bytes

SMALL = VideoSampling(geometry=VisionGeometryConfig(min_pixels=3136, max_pixels=200704))


def test_the_header_gives_size_rate_frames_and_duration_without_decoding():
    meta = probe_video(make_video_bytes(num_frames=30, fps=10, width=96, height=64))
    assert meta == VideoMetadata(width_px=96, height_px=64, fps=10.0, total_num_frames=30, duration_s=3.0)


@pytest.mark.parametrize("total,fps,sampling,expected", [
    (30, 10.0, VideoSampling(), (0, 5, 10, 15, 20, 25)),  # 3 s at 2 fps
    (7, 7.0, VideoSampling(), (0, 1, 3, 5)),  # 1 s: 2 frames wanted, min_frames 4
    (100, 30.0, VideoSampling(fps=30.0), tuple(int(i * 100 / 32) for i in range(32))),  # capped at max_frames 32
    (9, 3.0, VideoSampling(fps=1.0, min_frames=1), (0, 4)),  # 3 frames wanted, rounded down to a patch of 2
    (11, 11.0, VideoSampling(fps=11.0, min_frames=1, max_frames=64), tuple(range(10))),  # the video's own 11 -> 10
])
def test_frames_are_sampled_by_transformers_rule(total, fps, sampling, expected):
    meta = VideoMetadata(64, 64, fps, total, total / fps)
    assert sample_frame_indices(meta, sampling) == expected


def test_a_video_shorter_than_one_temporal_patch_is_refused():
    with pytest.raises(MediaError, match="at least 2"):
        sample_frame_indices(VideoMetadata(64, 64, 1.0, 1, 1.0), VideoSampling())


def test_geometry_rows_and_seconds_per_patch():
    meta = VideoMetadata(width_px=112, height_px=84, fps=4.0, total_num_frames=12, duration_s=3.0)
    geo = video_geometry(meta, SMALL)
    assert geo.frames_indices == (0, 2, 4, 6, 8, 10) and geo.sampled_fps == 2.0
    assert (geo.resized_height_px, geo.resized_width_px) == (84, 112)
    assert geo.grid_thw == (3, 6, 8) and geo.num_patches == 144 and geo.num_embedding_rows == 36
    assert geo.second_per_grid_t == 1.0  # two frames per patch at 2 sampled frames per second


def test_the_key_is_the_bytes_digest_plus_sampling_facts():
    data = make_video_bytes(num_frames=12, fps=4, seed=1)
    other = make_video_bytes(num_frames=12, fps=4, seed=2)
    geo, geo_fast = video_geometry_from_bytes(data, SMALL), video_geometry_from_bytes(data, VideoSampling(
        fps=4.0, geometry=SMALL.geometry))

    def key(d, g, s):
        return hash_encoded_video(d, g, processor_kwargs=s.kwargs, model_id="m")

    assert key(data, geo, SMALL) == key(data, geo, SMALL)
    assert key(data, geo, SMALL) != key(other, video_geometry_from_bytes(other, SMALL), SMALL)
    assert key(data, geo, SMALL) != key(data, geo_fast, VideoSampling(fps=4.0, geometry=SMALL.geometry))
    assert hash_encoded_video(data, geo, processor_kwargs=SMALL.kwargs, model_id="other") != key(data, geo, SMALL)
    frames = decode_frames(data, geo)
    assert hash_video_frames(frames, processor_kwargs=SMALL.kwargs, model_id="m") == \
        hash_video_frames([f.copy() for f in frames], processor_kwargs=SMALL.kwargs, model_id="m")


def test_decoded_frames_are_the_sampled_frames_written():
    rng = np.random.default_rng(3)
    written = [rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8) for _ in range(8)]
    data = make_video_bytes(frames=written, fps=2)  # 4 s at 2 fps: every frame
    geo = video_geometry_from_bytes(data, SMALL)
    assert geo.frames_indices == tuple(range(8))
    assert all(np.array_equal(a, b) for a, b in zip(decode_frames(data, geo), written))


@pytest.mark.parametrize("make,limits,said", [
    (lambda: b"", VideoLimits(), "0 bytes"),
    (lambda: b"\x00" * 4096, VideoLimits(), "expected a video container"),
    (lambda: make_video_bytes()[:200], VideoLimits(), "video"),
    (lambda: make_video_bytes(), VideoLimits(max_bytes=100), "at most 100 are accepted"),
    (lambda: make_video_bytes(num_frames=40, fps=4), VideoLimits(max_duration_s=5), "duration of 10.000 s"),
    (lambda: make_video_bytes(width=96, height=64), VideoLimits(max_side_px=80), "at most 80 px"),
    (lambda: make_video_bytes(num_frames=40, fps=40), VideoLimits(max_fps=30), "40.0 frames per second"),
    (lambda: make_video_bytes(num_frames=40, fps=4), VideoLimits(max_total_frames=20), "declares 40 frames"),
])
def test_hostile_containers_are_refused_naming_the_limit(make, limits, said):
    with pytest.raises(MediaError, match=said):
        video_geometry_from_bytes(make(), SMALL, limits)


def test_a_frame_bomb_is_refused_before_decoding():
    data = make_video_bytes(num_frames=40, fps=20, width=96, height=64)
    with pytest.raises(MediaError, match=r"would decode 32 frames of 96x64 .* at most 100000"):
        video_geometry_from_bytes(data, VideoSampling(fps=20.0, geometry=SMALL.geometry),
                                  VideoLimits(max_decoded_pixels=100_000))


def test_a_container_that_ends_before_its_sampled_frames_is_refused():
    data = make_video_bytes(num_frames=12, fps=4)
    geo = video_geometry(VideoMetadata(96, 64, 4.0, 40, 10.0), SMALL)  # a header that claims more frames
    with pytest.raises(MediaError, match="ended after 6 of the"):
        decode_frames(data, geo)


def test_processor_kwargs_change_sampling_within_the_checkpoints_bounds():
    base = MediaSettings(VisionGeometryConfig(min_pixels=3136, max_pixels=200704), SMALL)
    settings = base.with_kwargs({"fps": 1, "max_frames": 8, "max_pixels": 50176})
    assert settings.video.fps == 1.0 and settings.video.max_frames == 8
    assert settings.video.geometry.max_pixels == 50176 and settings.image.max_pixels == 50176
    assert settings.item_kwargs("video", base) == settings.video.kwargs and base.item_kwargs("video", base) is None
    for bad, said in [({"max_frames": 64}, "max_frames must be at most 32"), ({"fps": 0}, "fps must be"),
                      ({"min_frames": 9, "max_frames": 8}, "min_frames <= max_frames"),
                      ({"num_frames": 8}, "unsupported processor kwargs ['num_frames']")]:
        with pytest.raises(ValueError, match=said.replace("[", r"\[").replace("]", r"\]")):
            base.with_kwargs(bad)


def test_a_container_with_a_video_stream_and_no_frames_is_refused():
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "bgr0"
        container.start_encoding()  # the header is written, no frame follows
        for packet in stream.encode():
            container.mux(packet)
    assert len(buf.getvalue()) > 100
    with pytest.raises(MediaError, match="no frames|duration|expected a video container"):
        probe_video(buf.getvalue())
