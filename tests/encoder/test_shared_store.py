"""The cluster's encoder cache store as an encoder uses it (``epd.encoder.shared_store``), proved
in-process over a store in memory with Mooncake Store's rules (a claim's first write wins; the
Mooncake tests, tests/chaos/test_encoder_cache_store.py, run the same paths against a real master):
entries checked by dtype, shape and checksum; a bad entry re-encoded and counted; an outage degrades
to the local cache without failing a request; two engines share one encoding; an item being encoded
by one engine is waited for by the others, not encoded again, and a claimant that dies is taken over
when its lease runs out."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from epd.config import EncoderConfig
from epd.encoder.cache import EncoderCacheKey
from epd.encoder.engine import EncoderEngine
from epd.encoder.shared_store import (
    CorruptEntry,
    MemoryBackend,
    SharedEncoderStore,
    decode_entry,
    encode_entry,
    store_key,
)

from .fakes import BYTES_PER_ROW, HIDDEN, FakeEncoder, expected_output, make_item

KEY = EncoderCacheKey("c0ffee", "kw", "model", 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_entry_round_trips_and_owns_its_memory(dtype):
    rows = torch.randn(3, 5).to(dtype)
    back = decode_entry(encode_entry(rows), (3, 5), dtype)
    assert back.dtype == dtype and torch.equal(back, rows)
    back += 1  # writable, its own bytes
    assert not torch.equal(back, rows)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-1], "payload bytes"),  # truncated
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),  # one bit flipped
    (lambda b: b"XXXX" + b[4:], "not an entry"),
    (lambda b: b[:10], "shorter than an entry's header"),
    (lambda b: b[:6] + bytes([200]) + b[7:], "200 dimensions"),  # the header's ndim (not in the checksum)
    (lambda b: b[:20], "dimensions in 20 bytes"),  # cut inside the shape
])
def test_a_damaged_entry_is_refused(damage, message):
    blob = encode_entry(torch.randn(3, 5))
    with pytest.raises(CorruptEntry, match=message):
        decode_entry(damage(blob), (3, 5), torch.float32)


def test_an_entry_of_another_dtype_or_shape_is_refused():
    blob = encode_entry(torch.randn(3, 5))
    with pytest.raises(CorruptEntry, match=r"expected torch.bfloat16"):
        decode_entry(blob, (3, 5), torch.bfloat16)
    with pytest.raises(CorruptEntry, match=r"\(3, 5\), expected torch.float32 \(4, 5\)"):
        decode_entry(blob, (4, 5), torch.float32)


def test_the_key_names_every_input_that_changes_the_bytes():
    base = store_key(KEY, torch.float32)
    for other in (store_key(KEY._replace(content_hash="beef"), torch.float32),
                  store_key(KEY._replace(processor_kwargs_hash="kw2"), torch.float32),
                  store_key(KEY._replace(model_id="other"), torch.float32),
                  store_key(KEY._replace(expected_rows=4), torch.float32), store_key(KEY, torch.bfloat16)):
        assert other != base


def test_fetch_put_and_a_corrupt_entry_is_removed_and_counted():
    backend = MemoryBackend()
    store = SharedEncoderStore(backend)
    try:
        assert store.fetch(KEY, (3, 5), torch.float32) is None
        rows = torch.randn(3, 5)
        store.put(KEY, rows)
        assert store.flush()
        assert torch.equal(store.fetch(KEY, (3, 5), torch.float32), rows)
        name = store_key(KEY, torch.float32)
        backend.entries[name] = backend.entries[name][:-4]  # truncated in the store
        assert store.fetch(KEY, (3, 5), torch.float32) is None
        assert name not in backend.entries  # removed: the next encoder's put replaces it
        s = store.stats
        assert (s.hits, s.misses, s.puts, s.rejected, s.errors, s.up) == (1, 1, 1, 1, 0, True)
    finally:
        store.close()


def test_the_store_names_an_item_it_found_or_put_for_the_router_and_forgets_what_failed():
    """``holds``: the hint an encoder's answer carries (a router may have prefill read the rows
    from the store next time); never for an entry it found damaged or a put that failed."""
    backend, other = MemoryBackend(), MemoryBackend()
    store, reader = SharedEncoderStore(backend), SharedEncoderStore(backend)
    try:
        name = store_key(KEY, torch.float32)
        assert store.holds(KEY, torch.float32) is None
        store.put(KEY, torch.randn(3, 5))
        assert store.holds(KEY, torch.float32) == name  # queued: in the store within milliseconds
        assert store.flush() and reader.holds(KEY, torch.float32) is None
        assert reader.fetch(KEY, (3, 5), torch.float32) is not None and reader.holds(KEY, torch.float32) == name
        backend.entries[name] = backend.entries[name][:-4]
        assert reader.fetch(KEY, (3, 5), torch.float32) is None and reader.holds(KEY, torch.float32) is None
        store.put(KEY, torch.randn(3, 5))
        backend.fail = True  # the put fails: not named, nor anything while the store is down
        assert store.flush() and store.holds(KEY, torch.float32) is None
        failing = SharedEncoderStore(other)
        failing.put(KEY, torch.randn(3, 5))
        assert failing.flush()
        other.fail = True
        assert failing.holds(KEY, torch.float32) == name
        failing.fetch(KEY.__class__("other", "kw", "model", 3), (3, 5), torch.float32)  # the outage
        assert failing.holds(KEY, torch.float32) is None
        failing.close()
    finally:
        store.close()
        reader.close()


def test_an_outage_is_counted_once_per_call_and_the_store_left_alone_until_retry():
    backend, now = MemoryBackend(), [0.0]
    store = SharedEncoderStore(backend, retry_after_s=5.0, clock=lambda: now[0])
    try:
        backend.fail = True
        assert store.fetch(KEY, (3, 5), torch.float32) is None
        assert (store.stats.errors, store.stats.up, store.stats.misses) == (1, False, 0)
        calls = sum(backend.calls.values())
        store.put(KEY, torch.randn(3, 5))
        store.flush()
        assert store.fetch(KEY, (3, 5), torch.float32) is None
        assert sum(backend.calls.values()) == calls  # within retry_after_s: not asked again
        backend.fail = False
        now[0] = 6.0
        assert store.fetch(KEY, (3, 5), torch.float32) is None  # asked again: a miss, and up
        assert store.stats.up and store.stats.misses == 1
    finally:
        store.close()


def _engine(backend: MemoryBackend, **store_options):
    model = FakeEncoder()
    engine = EncoderEngine(model, EncoderConfig(encoder_max_num_tokens=64), model_id="m",
                           model_max_atomic_item_tokens=64, bytes_per_embedding=BYTES_PER_ROW,
                           encoder_tokens_per_row=4, shared_store=SharedEncoderStore(backend, **store_options))
    return engine, model


def test_an_item_encoded_while_the_store_was_down_is_put_on_its_next_use_once_the_store_is_back():
    """The hints an encoder's answer carries (``store_hints``): an item whose rows it made while
    the store was away reaches the store on its next use (its own cache hits it, so nothing else
    would put it), once; ``refresh`` puts it again."""
    from epd.encoder.servicer import store_hints

    backend, now = MemoryBackend(), [0.0]
    engine, model = _engine(backend, retry_after_s=5.0, clock=lambda: now[0])
    items = [make_item("x"), make_item("y", 3)]
    try:
        backend.fail = True
        result = engine.submit("a", items).result(timeout=10)
        assert engine.shared_store.flush()  # its puts, dropped: the store was down
        assert [h.WhichOneof("body") for h in store_hints(engine, items, result, False)] == [None, None]
        assert not engine.shared_store.ready()
        backend.fail = False  # back, but left alone until retry_after_s has passed
        assert [h.WhichOneof("body") for h in store_hints(engine, items, result, False)] == [None, None]
        assert backend.calls["put"] == 0 and not backend.entries
        now[0] = 6.0
        result = engine.submit("b", items).result(timeout=10)
        assert result.cache_hits == [True, True] and model.batches == [["x", "y"]]  # the store never asked
        store_hints(engine, items, result, False)
        assert engine.shared_store.flush() and backend.calls["put"] == 2
        hints = store_hints(engine, items, result, False)
        assert [h.store.key for h in hints] == [store_key(engine.scheduler.cache_key(i), torch.float32) for i in items]
        for item, hint in zip(items, hints):
            assert torch.equal(decode_entry(backend.entries[hint.store.key], (item.expected_rows, HIDDEN), torch.float32),
                               expected_output(item.content_hash, item.expected_rows))
        assert engine.shared_store.flush() and backend.calls["put"] == 2  # known now: not put again
        store_hints(engine, items[:1], result, True)
        assert engine.shared_store.flush() and backend.calls["put"] == 3
    finally:
        engine.close()


def test_what_one_engine_encodes_another_fetches_instead_of_encoding():
    backend = MemoryBackend()
    first, first_model = _engine(backend)
    second, second_model = _engine(backend)
    try:
        first.submit("a", [make_item("x"), make_item("y", 3)]).result(timeout=10)
        assert first.shared_store.flush()
        result = second.submit("b", [make_item("y", 3), make_item("z")]).result(timeout=10)
        assert second_model.batches == [["z"]]  # y came from the store: only z was encoded
        assert torch.equal(result.embeddings[0], expected_output("y", 3))
        assert torch.equal(result.embeddings[1], expected_output("z"))
        assert (second.num_encoded_items, second.shared_store.stats.hits) == (1, 1)
        assert first_model.batches == [["x", "y"]]
    finally:
        first.close()
        second.close()


def test_a_corrupt_entry_is_encoded_again_and_a_store_outage_fails_no_request():
    backend = MemoryBackend()
    first, _ = _engine(backend)
    second, second_model = _engine(backend)
    try:
        first.submit("a", [make_item("x")]).result(timeout=10)
        assert first.shared_store.flush()
        (name,) = backend.entries
        backend.entries[name] = backend.entries[name][:-1] + b"\x00"  # a flipped byte
        result = second.submit("b", [make_item("x")]).result(timeout=10)
        assert second_model.batches == [["x"]] and torch.equal(result.embeddings[0], expected_output("x"))
        assert second.shared_store.stats.rejected == 1
        backend.fail = True
        result = second.submit("c", [make_item("w")]).result(timeout=10)
        assert torch.equal(result.embeddings[0], expected_output("w"))
        assert second.shared_store.stats.errors >= 1 and not second.shared_store.stats.up
    finally:
        first.close()
        second.close()


def test_an_item_another_engine_is_encoding_is_waited_for_not_encoded_again():
    backend = MemoryBackend()
    first, first_model = _engine(backend)
    second, second_model = _engine(backend)
    try:
        first_model.hold = threading.Event()
        slow = first.submit("a", [make_item("x")])
        assert first_model.entered.wait(10)  # claimed, and encoding
        waiting = second.submit("b", [make_item("x"), make_item("y")])
        assert wait_until(lambda: second.shared_store.stats.waits == 1, 10)
        assert second_model.batches in ([["y"]], [])  # y is its own; x is first's
        first_model.hold.set()
        assert torch.equal(slow.result(timeout=10).embeddings[0], expected_output("x"))
        result = waiting.result(timeout=10)
        assert torch.equal(result.embeddings[0], expected_output("x"))
        assert second_model.encoded_names == ["y"] and first_model.encoded_names == ["x"]
        assert (first.shared_store.stats.claims, second.shared_store.stats.claims) == (1, 1)  # x and y
        assert not [k for k in backend.entries if "/claim/" in k]  # each claim removed once its result was in
    finally:
        first_model.hold = None
        first.close()
        second.close()


def test_sixteen_requests_for_one_new_image_over_two_engines_run_one_forward():
    backend = MemoryBackend()
    engines = [_engine(backend), _engine(backend)]
    try:
        for _, model in engines:
            model.hold = threading.Event()
        barrier = threading.Barrier(16)
        futures = {}

        def go(i: int) -> None:
            barrier.wait()
            futures[i] = engines[i % 2][0].submit(f"r{i}", [make_item("new")])

        threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert wait_until(lambda: any(m.entered.is_set() for _, m in engines), 10)
        time.sleep(0.2)  # both engines have scheduled the item by now: one encodes, one waits
        for _, model in engines:
            model.hold.set()
        results = [futures[i].result(timeout=10) for i in range(16)]
        assert all(torch.equal(r.embeddings[0], expected_output("new")) for r in results)
        assert sum(len(m.batches) for _, m in engines) == 1  # one forward in the "cluster"
        assert sum(e.shared_store.stats.waits for e, _ in engines) == 1  # the other engine waited for it
    finally:
        for engine, model in engines:
            model.hold = None
            engine.close()


def test_a_claimant_that_dies_is_taken_over_when_its_lease_runs_out():
    backend = MemoryBackend()
    dead = SharedEncoderStore(backend, claim_ttl_s=0.5)
    engine, model = _engine(backend)
    try:
        key = engine.scheduler.cache_key(make_item("x"))
        assert dead.claim(key, torch.float32).mine  # then it "dies": never puts the result
        started = time.monotonic()
        result = engine.submit("a", [make_item("x")]).result(timeout=10)
        assert time.monotonic() - started >= 0.4  # it waited for the lease
        assert torch.equal(result.embeddings[0], expected_output("x"))
        assert model.encoded_names == ["x"]
        s = engine.shared_store.stats
        assert (s.waits, s.takeovers, s.claims) == (1, 1, 1)
    finally:
        dead.close()
        engine.close()


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_an_encoder_knows_its_own_claim_after_a_failed_batch_and_a_lease_is_never_longer_than_ours():
    backend, now = MemoryBackend(), [100.0]
    store = SharedEncoderStore(backend, claim_ttl_s=10.0, wall=lambda: now[0])
    other = SharedEncoderStore(backend, claim_ttl_s=1e9, wall=lambda: now[0])
    try:
        assert store.claim(KEY, torch.float32).mine
        now[0] += 1.0  # its batch failed; the request is scheduled again: the claim is still its own
        assert store.claim(KEY, torch.float32).mine
        key2 = KEY._replace(content_hash="beef")
        assert other.claim(key2, torch.float32).mine  # a holder whose lease reaches far ahead
        assert store.claim(key2, torch.float32).deadline_s <= now[0] + 10.0
    finally:
        store.close()
        other.close()


def test_items_taken_over_together_are_encoded_within_the_batch_budgets():
    from epd.encoder.cluster_cache import ClusterCache
    from epd.encoder.item_scheduler import ScheduledBatch, ScheduledItem

    engine, _ = _engine(MemoryBackend())
    try:
        budgets = engine.scheduler.budgets  # 64 encoder tokens a batch; each item here 4 rows x 4 tokens = 16
        items = tuple(ScheduledItem(f"r{i}", 0, engine.scheduler.cache_key(make_item(f"t{i}", rows=4)),
                                    make_item(f"t{i}", rows=4)) for i in range(10))
        cluster = ClusterCache(engine.shared_store, width=4, dtype=torch.float32, device=torch.device("cpu"),
                               bytes_per_embedding=BYTES_PER_ROW)
        parts = cluster.within_budgets(ScheduledBatch(items), budgets)
        assert [len(p) for p in parts] == [4, 4, 2] and all(p.num_encoder_tokens <= 64 for p in parts)
        assert [i for p in parts for i in p.items] == list(items)
    finally:
        engine.close()
