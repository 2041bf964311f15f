"""Video through our engine == transformers' generate, token for token (fp32, greedy), for Qwen2-VL,
Qwen2.5-VL (whose temporal M-RoPE positions follow seconds of video) and Qwen3-VL (each temporal
patch after its timestamp, deepstack levels): a video alone, with images around it, chunked so that
a chunk cuts through the video, from the prefix cache, and with the LLM in two tensor-parallel ranks.

transformers' own video processor needs torchvision, which cannot load beside the CPU torch here,
so the reference gets the pixel patches our frame pipeline makes; that pipeline is checked against
transformers' image processor (a video of one repeated frame patches exactly like that frame as an
image), and the frame sampling against transformers' rule by hand."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.presets import write_preset_checkpoint
from epd.multimodal.media import MediaInput
from epd.multimodal.video import video_geometry_from_bytes
from epd.types import SamplingParams
from tests.conftest import make_image_bytes, make_video_bytes
from tests.fidelity.reference import ReferenceModel

pytestmark = pytest.mark.slow

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW)
VIDEO = make_video_bytes(num_frames=12, fps=4, width=112, height=84, seed=5)  # 3 s: 6 frames at 2 fps
VIDEO_B = make_video_bytes(num_frames=9, fps=3, width=70, height=98, seed=6)
IMAGE = make_image_bytes(120, 90, seed=7)


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def model_dir(request, tmp_path_factory):
    return write_preset_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=4321)


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceModel(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), engine_config=EngineConfig(block_size=4, num_kv_blocks=2048,
                                                          max_num_batched_tokens=4096))


def video_inputs(llm: LLM, videos: list[bytes], kwargs: dict | None = None) -> list[tuple]:
    """(pixel_values_videos, video_grid_thw, second_per_grid_t, frames_indices, source fps) of each
    video, by our pipeline, under ``kwargs``."""
    settings = llm.processor.media_settings(kwargs)
    out = []
    for data in videos:
        geometry = video_geometry_from_bytes(data, settings.video)
        item = MediaInput(data, "video", settings.item_kwargs("video", llm.processor.settings))
        pixels, grid = llm.vision.preprocess([item])
        assert tuple(grid[0].tolist()) == geometry.grid_thw
        out.append((pixels, grid, geometry.second_per_grid_t, geometry.frames_indices, geometry.metadata.fps))
    return out


def conversation(parts: list[tuple[str, bytes]], text: str = "Describe what happens in detail.") -> list[dict]:
    content = [{"type": kind, kind: data} for kind, data in parts] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def check_same(ref, out):
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.token_ids == ref.token_ids
    assert len(set(out.token_ids)) > 4, "degenerate model output makes the comparison meaningless"


@pytest.mark.parametrize("parts", [
    [("video", VIDEO)],
    [("image", IMAGE), ("video", VIDEO), ("image", IMAGE)],
    [("video", VIDEO_B), ("video", VIDEO)],
], ids=["video", "image-video-image", "two-videos"])
def test_video_prompts_match_transformers(llm, reference, parts):
    messages = conversation(parts)
    out = llm.chat(messages, GREEDY)[0]
    videos = [data for kind, data in parts if kind == "video"]
    images = [data for kind, data in parts if kind == "image"]
    check_same(reference.generate_with_videos(messages, images, video_inputs(llm, videos), MAX_NEW), out)


def test_video_with_images_in_two_tensor_parallel_ranks_matches_transformers(model_dir, reference, llm):
    """The same chat with the LLM cut into two ranks (the second a process of its own, every
    embedding row sent to it with the step), chunked so that a chunk cuts through the video."""
    parts = [("image", IMAGE), ("video", VIDEO), ("image", IMAGE)]
    messages = conversation(parts)
    config = EngineConfig(tensor_parallel_size=2, block_size=4, num_kv_blocks=2048, max_num_batched_tokens=11)
    with LLM(str(model_dir), engine_config=config) as in_ranks:
        out = in_ranks.chat(messages, GREEDY)[0]
    check_same(reference.generate_with_videos(messages, [IMAGE, IMAGE], video_inputs(llm, [VIDEO]), MAX_NEW), out)


@pytest.mark.parametrize("chunk_tokens", [5, 11])
def test_chunked_prefill_cutting_through_a_video(model_dir, reference, chunk_tokens):
    llm = LLM(str(model_dir), engine_config=EngineConfig(block_size=4, num_kv_blocks=2048,
                                                         max_num_batched_tokens=chunk_tokens))
    messages = conversation([("image", IMAGE), ("video", VIDEO)])
    out = llm.chat(messages, GREEDY)[0]
    assert video_geometry_from_bytes(VIDEO, llm.processor.settings.video).num_embedding_rows > 2 * chunk_tokens
    check_same(reference.generate_with_videos(messages, [IMAGE], video_inputs(llm, [VIDEO]), MAX_NEW), out)


def test_a_repeated_video_prompt_hits_the_prefix_cache_and_gives_the_same_tokens(llm, reference):
    messages = conversation([("video", VIDEO)], "What moves?")
    first = llm.chat(messages, GREEDY)[0]
    again = llm.chat(messages, GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    check_same(reference.generate_with_videos(messages, [], video_inputs(llm, [VIDEO]), MAX_NEW), again)


def test_other_sampling_kwargs_change_the_frames_and_match_transformers(llm, reference):
    messages = conversation([("video", VIDEO)])
    kwargs = {"fps": 4.0, "max_pixels": 64 * 64 * 2}
    out = llm.chat(messages, GREEDY, mm_processor_kwargs=kwargs)[0]
    inputs = video_inputs(llm, [VIDEO], kwargs)
    assert inputs[0][1][0, 0] == 6  # 12 frames at 4 fps: 6 temporal patches
    check_same(reference.generate_with_videos(messages, [], inputs, MAX_NEW), out)


def test_one_repeated_frame_patches_like_that_frame_as_an_image(llm):
    """Our frame pipeline (PyAV decode, the image processor's resize and normalization, temporal
    patches) against transformers' image processor, which tiles an image over a temporal patch."""
    import io

    from PIL import Image

    frame = np.random.default_rng(11).integers(0, 256, size=(84, 126, 3), dtype=np.uint8)
    video = make_video_bytes(frames=[frame, frame], fps=1)
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    bounds = llm.vision.video_sampling.geometry.pixel_kwargs
    as_video = llm.vision.preprocess([MediaInput(video, "video")])
    as_image = llm.vision.preprocess([MediaInput(buf.getvalue(), "image", bounds)])
    assert torch.equal(as_video[1], as_image[1])
    torch.testing.assert_close(as_video[0], as_image[0], rtol=0, atol=0)


def test_frames_built_by_hand_are_a_video_keyed_by_their_pixels(llm):
    """A list of frames (and the rate they were taken at) is the same video as a file of them; its
    key is its pixels, the same for equal frames, whatever objects hold them."""
    rng = np.random.default_rng(12)
    frames = [rng.integers(0, 256, size=(84, 112, 3), dtype=np.uint8) for _ in range(8)]
    by_hand = conversation([("video", frames)])
    by_hand[0]["content"][0]["fps"] = 4
    from_file = conversation([("video", make_video_bytes(frames=frames, fps=4))])
    out, expected = llm.chat(by_hand, GREEDY)[0], llm.chat(from_file, GREEDY)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids

    def item_hash(messages):
        conv, media = llm.extract_media(messages)
        return llm.processor.process_messages(conv, media).items[0].mm_hash

    copies = conversation([("video", [f.copy() for f in frames])])
    copies[0]["content"][0]["fps"] = 4
    assert item_hash(by_hand) == item_hash(copies) != item_hash(from_file)
