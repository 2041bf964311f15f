"""EncoderEngine over a fake encoder (fast) and over the real tiny-qwen2-vl vision tower (slow)."""
import functools
import threading

import pytest
import torch

from epd.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.encoder.errors import MultimodalEncoderAdmissionError, MultimodalEncoderRequestError
from epd.transport.shm import shared_empty

from ..conftest import make_image_bytes
from .fakes import BYTES_PER_ROW, FakeEncoder, expected_output, make_item


@pytest.fixture
def fake_engine():
    model = FakeEncoder()
    engine = EncoderEngine(model, EncoderConfig(encoder_max_num_tokens=64), model_id="m",
                           model_max_atomic_item_tokens=64, bytes_per_embedding=BYTES_PER_ROW,
                           encoder_tokens_per_row=4)
    yield engine, model
    engine.close()


def submit_concurrently(engine, requests: dict[str, list]) -> dict:
    barrier = threading.Barrier(len(requests))
    futures = {}

    def go(request_id, items):
        barrier.wait()
        futures[request_id] = engine.submit(request_id, items)

    threads = [threading.Thread(target=go, args=kv) for kv in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return {request_id: future.result(timeout=30) for request_id, future in futures.items()}


def test_same_item_in_concurrent_requests_is_encoded_once(fake_engine):
    engine, model = fake_engine
    results = submit_concurrently(engine, {f"r{i}": [make_item("same")] for i in range(10)})
    assert model.encoded_names == ["same"]
    stats = engine.stats()
    assert (stats.num_forwards, stats.cache.misses, stats.cache.hits) == (1, 1, 9)
    assert sorted(r.cache_hits for r in results.values()) == [[False]] + [[True]] * 9
    assert all(torch.equal(r.embeddings[0], expected_output("same")) for r in results.values())


def test_partial_hits_encode_only_misses_and_keep_item_order(fake_engine):
    engine, model = fake_engine
    engine.submit("first", [make_item("a"), make_item("b")]).result(timeout=10)
    result = engine.submit("second", [make_item("c"), make_item("a"), make_item("d", 3), make_item("b")]).result(10)
    assert model.batches[-1] == ["c", "d"]
    assert result.cache_hits == [False, True, False, True]
    expected = [expected_output("c"), expected_output("a"), expected_output("d", 3), expected_output("b")]
    assert all(torch.equal(got, want) for got, want in zip(result.embeddings, expected, strict=True))


def test_never_fitting_request_is_rejected_at_submit(fake_engine):
    engine, _ = fake_engine
    with pytest.raises(MultimodalEncoderAdmissionError, match="output_budget_bytes"):
        engine.submit("big", [make_item("huge", rows=17, tokens=64)])  # 16 rows fit: 64 tokens / 4
    engine.submit("big", [make_item("ok")]).result(timeout=10)  # the id was not taken


def test_batch_failure_fails_the_producer_and_the_consumer_still_succeeds(fake_engine):
    engine, model = fake_engine
    model.fail_next_encodes = 1
    gate, entered = gate_preprocess(model)  # hold the first batch until the consumer has joined
    producer = engine.submit("producer", [make_item("x")])
    assert entered.wait(10)
    consumer = engine.submit("consumer", [make_item("x")])
    gate.set()
    with pytest.raises(MultimodalEncoderRequestError, match="CUDA out of memory"):
        producer.result(timeout=10)
    assert consumer.result(timeout=10).cache_hits == [False]  # it became the producer
    assert model.encoded_names == ["x", "x"]


def test_release_unpins_and_cancels(fake_engine):
    engine, _ = fake_engine
    engine.submit("held", [make_item("a")]).result(timeout=10)
    (entry,) = [engine.cache.get(engine.scheduler.cache_key(make_item("a")))]
    assert entry.pinned_by == {"held"}
    engine.release("held")
    assert not entry.is_pinned and engine.stats().num_held_requests == 0
    engine.submit("auto", [make_item("a")], hold_until_release=False).result(timeout=10)
    assert not entry.is_pinned
    engine.submit("twice", [make_item("b")])
    with pytest.raises(ValueError, match="'twice' is already submitted"):
        engine.submit("twice", [make_item("b")])


def gate_preprocess(model: FakeEncoder) -> tuple[threading.Event, threading.Event]:
    """Hold every forward until ``gate`` is set; ``entered`` says a forward is being held."""
    gate, entered, real_preprocess = threading.Event(), threading.Event(), model.preprocess

    def gated(images):
        entered.set()
        gate.wait(10)
        return real_preprocess(images)

    model.preprocess = gated
    return gate, entered


def test_release_of_a_waiting_request_cancels_it(fake_engine):
    engine, model = fake_engine
    gate, entered = gate_preprocess(model)
    running = engine.submit("running", [make_item("a")])
    assert entered.wait(10)
    waiting = engine.submit("waiting", [make_item("b")])
    engine.release("waiting")
    gate.set()
    assert running.result(timeout=10).cache_hits == [False]
    assert waiting.cancelled() and "b" not in model.encoded_names
    assert engine.cache.get(engine.scheduler.cache_key(make_item("b"))) is None


def test_close_finishes_the_running_batch_and_fails_the_rest(fake_engine):
    engine, model = fake_engine
    gate, entered = gate_preprocess(model)
    running = engine.submit("running", [make_item("a")])
    assert entered.wait(10)
    waiting = engine.submit("waiting", [make_item("b")])
    closer = threading.Thread(target=engine.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert running.result(timeout=10).cache_hits == [False]
    with pytest.raises(RuntimeError, match="closed before request 'waiting' finished"):
        waiting.result(timeout=10)


def test_close_rejects_new_work():
    engine = EncoderEngine(FakeEncoder(), EncoderConfig(), model_id="m", model_max_atomic_item_tokens=8,
                           bytes_per_embedding=BYTES_PER_ROW)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit("r", [make_item("a")])


# -- the real vision tower --------------------------------------------------------------------
class RecordingEncoder:
    """Passes through to QwenVisionEncoder, recording the images of every forward."""

    def __init__(self, inner) -> None:
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def preprocess(self, inputs):
        self.batches.append([getattr(x, "data", x) for x in inputs])  # the runner sends MediaInputs
        return self.inner.preprocess(inputs)


@pytest.fixture(scope="module")
def qwen_engine():
    from epd.models.locate import resolve_model
    # one intra-op thread, as the references below: how many threads a reduction is split over
    # changes its last bits, and the main thread's count depends on what ran before in this process
    engine = EncoderEngine.from_model_dir(resolve_model("tiny-qwen2-vl"), EncoderConfig(num_threads=1))
    engine.runner.model = RecordingEncoder(engine.runner.model)
    yield engine
    engine.close()


def reference_outputs(engine) -> dict[bytes, torch.Tensor]:
    """Each recorded batch re-encoded directly: same bytes, same batch, one thread as the engine's,
    so bit-identical (on a thread of its own: the count is per thread)."""
    reference = {}

    def encode() -> None:
        torch.set_num_threads(1)
        for batch in engine.runner.model.batches:
            reference.update(zip(batch, engine.runner.model.inner.encode_images(batch), strict=True))

    worker = threading.Thread(target=encode)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "re-encoding the references took over 120 s"
    return reference


@pytest.mark.slow
def test_real_encoder_same_image_in_ten_requests_one_forward(qwen_engine):
    image = make_image_bytes(90, 70, seed=11)
    item = qwen_engine.make_item(image)
    results = submit_concurrently(qwen_engine, {f"same{i}": [item] for i in range(10)})
    assert sum(batch.count(image) for batch in qwen_engine.runner.model.batches) == 1
    reference = reference_outputs(qwen_engine)[image]
    assert reference.shape == (item.expected_rows, 64)
    assert all(torch.equal(r.embeddings[0], reference) for r in results.values())
    assert sorted(r.cache_hits[0] for r in results.values()) == [False] + [True] * 9


@pytest.mark.slow
def test_real_encoder_partial_hits_keep_order_and_equal_direct_encode(qwen_engine):
    images = [make_image_bytes(56 + 28 * i, 84 - 14 * i, seed=20 + i) for i in range(4)]
    first = qwen_engine.submit("p1", [qwen_engine.make_item(images[0]), qwen_engine.make_item(images[2])])
    first.result(timeout=60)
    order = [images[1], images[0], images[3], images[2]]
    result = qwen_engine.submit("p2", [qwen_engine.make_item(image) for image in order]).result(timeout=60)
    assert result.cache_hits == [False, True, False, True]
    assert qwen_engine.runner.model.batches[-1] == [images[1], images[3]]
    reference = reference_outputs(qwen_engine)
    for image, embedding in zip(order, result.embeddings, strict=True):
        assert embedding.device.type == "cpu" and torch.equal(embedding, reference[image])
    for image, embedding in zip(order, result.embeddings, strict=True):  # and per image, to fp tolerance
        torch.testing.assert_close(embedding, qwen_engine.runner.model.inner.encode_images([image])[0])


@pytest.mark.slow
def test_real_encoder_takes_videos_beside_images_and_caches_them_by_bytes_and_sampling(qwen_engine):
    from epd.multimodal.media import MediaInput

    from ..conftest import make_video_bytes

    budgets = qwen_engine.scheduler.budgets
    assert budgets.encoder_max_num_tokens >= budgets.model_max_atomic_item_tokens \
        >= qwen_engine.media.video.max_encoder_tokens  # the largest legal video is schedulable
    video, image = make_video_bytes(num_frames=12, fps=4, seed=40), make_image_bytes(70, 50, seed=40)
    items = [qwen_engine.make_item(image), qwen_engine.make_item(video, modality="video")]
    assert items[1].modality == "video" and items[1].expected_rows == 3 * 2 * 3  # 6 frames at 2 fps, 84x56
    first = qwen_engine.submit("v1", items).result(timeout=120)
    direct = qwen_engine.runner.model.inner.encode_images([MediaInput(image), MediaInput(video, "video")])
    for got, want in zip(first.embeddings, direct):
        torch.testing.assert_close(got, want)
    again = qwen_engine.submit("v2", [qwen_engine.make_item(video, modality="video")]).result(timeout=120)
    assert again.cache_hits == [True] and torch.equal(again.embeddings[0], first.embeddings[1])
    faster = qwen_engine.make_item(video, {"fps": 4.0}, modality="video")
    assert faster.expected_rows == 2 * items[1].expected_rows and faster.processor_kwargs["fps"] == 4.0
    assert qwen_engine.submit("v3", [faster]).result(timeout=120).cache_hits == [False]


def test_model_factory_runs_on_the_encoder_loop_thread():
    threads = []

    def build():
        threads.append(threading.current_thread().name)
        return FakeEncoder()

    engine = EncoderEngine(build, EncoderConfig(encoder_max_num_tokens=64), model_id="m",
                           model_max_atomic_item_tokens=64, bytes_per_embedding=BYTES_PER_ROW)
    try:
        assert threads == ["epd-encoder-loop"]
        result = engine.submit("r", [make_item("a")]).result(timeout=10)
        assert torch.equal(result.embeddings[0], expected_output("a"))
    finally:
        engine.close()


def test_model_factory_error_reaches_the_constructor_and_stops_the_loop():
    def broken():
        raise RuntimeError("vision weights missing")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="vision weights missing"):
        EncoderEngine(broken, EncoderConfig(), model_id="m", model_max_atomic_item_tokens=8,
                      bytes_per_embedding=BYTES_PER_ROW)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.slow
def test_rows_are_made_in_the_stores_shared_memory_and_exported_without_a_copy():
    """The tier's wiring (``allocate_output=shared_empty(store, ...)``): every encoded item's rows live in
    a shm segment of the store, so its export is a lease on that memory, for the first request and
    for a cache hit alike."""
    from epd.models.locate import resolve_model
    from epd.transport import TensorStore, import_tensor

    with TensorStore() as store:
        engine = EncoderEngine.from_model_dir(resolve_model("tiny-qwen2-vl"), EncoderConfig(),
                                              allocate_output=functools.partial(shared_empty, store))
        try:
            images = [make_image_bytes(56, 84, seed=40), make_image_bytes(84, 56, seed=41)]
            first = engine.submit("a", [engine.make_item(i) for i in images], hold_until_release=False).result(60)
            again = engine.submit("b", [engine.make_item(images[1])], hold_until_release=False).result(60)
            arena = store.transport_state("shm", None)
            for rows in [*first.embeddings, *again.embeddings]:
                segment = arena.segment_of(rows)
                assert segment is not None, "rows outside the store's shared memory: the export would copy"
                arena._let_go(segment, False)  # segment_of counted a holder: give it back
            handle = store.export(again.embeddings[0], transport="shm", ttl_s=10)
            assert handle.shm.generation and handle.shm.generation != handle.lease_id  # a lease, not a copy
            assert torch.equal(import_tensor(handle).tensor, first.embeddings[1])
            store.release([handle.lease_id])
        finally:
            engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_rows_stay_on_the_gpu_with_the_event_after_their_batch():
    """No trip through the host: the rows a request gets are the cache's GPU tensors, exported over
    CUDA IPC, with the event the engine thread recorded after writing them."""
    from epd.models.locate import resolve_model
    from epd.transport import TensorStore

    engine = EncoderEngine.from_model_dir(resolve_model("tiny-qwen2-vl"), EncoderConfig(device="cuda"))
    try:
        result = engine.submit("r", [engine.make_item(make_image_bytes(56, 84, seed=50))],
                               hold_until_release=False).result(120)
        assert result.embeddings[0].is_cuda and result.ready_events[0] is not None
        with TensorStore() as store:
            handle = store.export(result.embeddings[0], transport="cuda_ipc", ttl_s=10,
                                  ready_event=result.ready_events[0])
            assert handle.WhichOneof("body") == "cuda_ipc"
            store.release([handle.lease_id], unused=True)
    finally:
        engine.close()
