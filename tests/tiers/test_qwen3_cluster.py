"""Qwen3-VL across real tier processes: each encoder row carries the deepstack levels packed after
its main embedding (one handle per item), prefill splits them chunk by chunk (13-token chunks cut
through the images) and adds each level after its layer; decode keeps only the mrope delta. The
output must equal the in-process engine and transformers."""
from __future__ import annotations

import pytest

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.presets import write_preset_checkpoint
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import SamplingParams
from tests.conftest import make_image_bytes, make_video_bytes
from tests.fidelity.reference import ReferenceModel, user_message

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24)
IMAGES = [make_image_bytes(150, 110, seed=51), make_image_bytes(64, 200, seed=52)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen3-vl", tmp_path_factory.mktemp("q3") / "ckpt", seed=2468)


@pytest.fixture(scope="module")
def router(model_dir):
    with LocalCluster(str(model_dir), tier_args={"prefill": ["--max-num-batched-tokens", "13"]}) as cluster:
        with SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                     decodes=cluster.decodes) as router:
            yield router


@pytest.mark.parametrize("images", [[], IMAGES[:1], IMAGES], ids=["0img", "1img", "2img"])
def test_qwen3_vl_across_the_split_equals_transformers(router, model_dir, images):
    messages = user_message("Describe every detail.", images)
    out = router.chat(messages, GREEDY)
    ref = ReferenceModel(model_dir).generate(messages, images, max_new_tokens=GREEDY.max_tokens)
    assert out.prompt_token_ids == ref.prompt_token_ids and out.token_ids == ref.token_ids
    in_process = LLM(str(model_dir), engine_config=EngineConfig(block_size=16)).chat(messages, GREEDY)[0]
    assert out.token_ids == in_process.token_ids


def test_a_qwen3_video_between_images_across_the_split_equals_the_in_process_engine(router, model_dir):
    """Each temporal patch after its timestamp: the item's segments travel to prefill
    (MultimodalItem.segment_offsets), whose M-RoPE places each patch as a one-frame image."""
    video = make_video_bytes(num_frames=12, fps=4, width=96, height=64, seed=53)
    content = [{"type": "image", "image": IMAGES[1]}, {"type": "video", "video": video},
               {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    out = router.chat(messages, GREEDY)
    expected = LLM(str(model_dir), engine_config=EngineConfig(block_size=16)).chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids


def test_a_repeated_qwen3_prompt_reuses_the_prefix_cache(router):
    messages = user_message("Which is larger?", IMAGES)
    first, again = (list(router.stream(messages, GREEDY)) for _ in range(2))
    assert again[0].num_cached_tokens > first[0].num_cached_tokens
    assert [t for e in first for t in e.token_ids] == [t for e in again for t in e.token_ids]
