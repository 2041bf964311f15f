"""The real Qwen2-VL / Qwen2.5-VL vision towers under CUDA graphs: replay equals eager, buckets are
reused without stale data, and what fits no bucket runs eager. Runs on any CUDA machine."""
import pytest
import torch

from epd.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.encoder.graphed_model import GraphedVisionEncoder
from epd.models.locate import resolve_model
from epd.models.qwen2_vl.vision import QwenVisionEncoder

from ..conftest import make_image_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BUCKETS = ((512, 2), (2048, 4))


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def graphed(request):
    model = QwenVisionEncoder(resolve_model(request.param), device="cuda")
    return GraphedVisionEncoder(model, BUCKETS, device="cuda")


def _images(sizes, seed=0):
    return [make_image_bytes(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]


@pytest.mark.parametrize("sizes", [[(224, 224)], [(300, 140), (90, 200), (224, 168)]], ids=["one", "three"])
def test_replay_equals_the_eager_tower(graphed, sizes):
    pixel_values, grid_thw = graphed.preprocess(_images(sizes))
    before = graphed.num_graph_batches
    replayed = [t.clone() for t in graphed.encode(pixel_values, grid_thw)]
    assert graphed.num_graph_batches == before + 1
    eager = graphed.model.encode(pixel_values, grid_thw)
    torch.cuda.synchronize()
    for ours, ref in zip(replayed, eager, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_a_bucket_replayed_for_other_images_holds_no_stale_rows(graphed):
    a, b = graphed.preprocess(_images([(224, 224)], seed=10)), graphed.preprocess(_images([(196, 140)], seed=20))
    first = graphed.encode(*a)[0].clone()
    graphed.encode(*b)
    again = graphed.encode(*a)[0]
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_a_batch_no_bucket_fits_runs_eager(graphed):
    pixel_values, grid_thw = graphed.preprocess(_images([(224, 224)] * 5))  # 5 contexts > 4
    before = graphed.num_eager_batches
    rows = graphed.encode(pixel_values, grid_thw)
    assert graphed.num_eager_batches == before + 1 and len(rows) == 5


def test_encoder_engine_with_buckets_serves_graph_rows_equal_to_cpu():
    path = resolve_model("tiny-qwen2-vl")
    engine = EncoderEngine.from_model_dir(path, EncoderConfig(device="cuda", cuda_graph_buckets=BUCKETS))
    try:
        assert isinstance(engine.runner.model, GraphedVisionEncoder)
        images = _images([(224, 224), (90, 200)], seed=30)
        result = engine.submit("r", [engine.make_item(data) for data in images]).result(timeout=60)
        cpu = QwenVisionEncoder(path).encode_images(images)
        for ours, ref in zip(result.embeddings, cpu, strict=True):
            torch.testing.assert_close(ours.cpu(), ref, rtol=1e-3, atol=1e-3)
        assert engine.runner.model.num_graph_batches >= 1
    finally:
        engine.close()
