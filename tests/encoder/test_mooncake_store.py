"""The encoder cache store's Mooncake backend against a real ``mooncake_master`` and segment server on
127.0.0.1 (``epd.server.mooncake.MooncakeStore``): the rules the shared cache relies on hold there
(a put replaces, a claim's first write wins and is read back), and two encoder engines, each its
own Mooncake client, run one forward for sixteen concurrent requests of one new image. At the end
the store's processes are gone."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from epd.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.encoder.shared_store import SharedEncoderStore
from epd.server.mooncake import MooncakeStore
from epd.transport.mooncake import MooncakeBackend
from tests.procs import gone

from .fakes import BYTES_PER_ROW, FakeEncoder, expected_output, make_item

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store():
    s = MooncakeStore(segment_bytes=64 * 2**20).start()
    pids = [p.pid for p in s.procs]
    try:
        yield s
    finally:
        s.stop()
        assert all(gone(pid) for pid in pids)


def _client(store) -> MooncakeBackend:
    client = MooncakeBackend(store.master)
    assert client.wait_joined(30), "could not join the master"
    return client


def test_a_put_replaces_and_a_claims_first_write_wins(store):
    first, second = _client(store), _client(store)
    try:
        first.put("t/k", b"one")
        assert second.get("t/k") == b"one"  # and read: a lease keeps it from removal a while
        second.put("t/k", b"two")
        assert first.get("t/k") == b"two"
        assert first.put_first("t/claim", b"first") == b"first"
        assert second.put_first("t/claim", b"second") == b"first"  # the second writer learns who won
        assert second.get("t/missing") is None
    finally:
        first.close()
        second.close()


def test_two_engines_on_one_store_encode_a_new_image_once_for_sixteen_requests(store):
    engines = []
    for _ in range(2):
        model = FakeEncoder()
        model.hold = threading.Event()
        engine = EncoderEngine(model, EncoderConfig(encoder_max_num_tokens=64), model_id="m-sixteen",
                               model_max_atomic_item_tokens=64, bytes_per_embedding=BYTES_PER_ROW,
                               encoder_tokens_per_row=4,
                               shared_store=SharedEncoderStore(_client(store)))
        engines.append((engine, model))
    try:
        futures = [engines[i % 2][0].submit(f"r{i}", [make_item("fresh", 3)]) for i in range(16)]
        deadline = time.monotonic() + 10
        while sum(e.shared_store.stats.claims + e.shared_store.stats.waits for e, _ in engines) < 2:
            assert time.monotonic() < deadline, "the engines never looked the item up"
            time.sleep(0.01)
        for _, model in engines:
            model.hold.set()
        results = [f.result(timeout=30) for f in futures]
        assert all(torch.equal(r.embeddings[0], expected_output("fresh", 3)) for r in results)
        assert sum(len(model.batches) for _, model in engines) == 1
        assert sorted((e.shared_store.stats.claims, e.shared_store.stats.waits) for e, _ in engines) == [(0, 1), (1, 0)]
    finally:
        for engine, model in engines:
            model.hold = None
            engine.close()
