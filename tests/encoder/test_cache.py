import threading

import pytest

from epd.encoder.cache import CacheEntryState, EncoderCacheKey, TensorLRUCache
from epd.encoder.errors import EncoderCacheFullError


class Blob:
    """The cache reads only ``nbytes`` of what it stores."""

    def __init__(self, nbytes: int, tag: str = "") -> None:
        self.nbytes, self.tag = nbytes, tag


def key(name: str, rows: int = 1) -> EncoderCacheKey:
    return EncoderCacheKey(name, "kw", "model", rows)


def produce(cache: TensorLRUCache, name: str, nbytes: int, request_id: str = "r") -> Blob:
    entry, is_producer = cache.lookup_or_reserve(key(name), request_id, nbytes)
    assert is_producer
    assert cache.begin_produce(key(name), request_id)
    blob = Blob(nbytes, name)
    cache.commit(key(name), blob)
    return blob


def test_first_request_produces_later_ones_wait_on_the_same_entry():
    cache = TensorLRUCache(1000)
    producer_entry, is_producer = cache.lookup_or_reserve(key("a"), "r1", 40)
    consumer_entry, consumer_is_producer = cache.lookup_or_reserve(key("a"), "r2", 40)
    assert is_producer and not consumer_is_producer
    assert consumer_entry is producer_entry and producer_entry.state is CacheEntryState.PENDING
    got = []
    waiter = threading.Thread(target=lambda: got.append(consumer_entry.wait(timeout_s=5)))
    waiter.start()
    assert cache.begin_produce(key("a"), "r1")
    blob = Blob(40)
    cache.commit(key("a"), blob)
    waiter.join(5)
    assert got == [blob] and producer_entry.produced_by == "r1"
    entry, is_producer = cache.lookup_or_reserve(key("a"), "r3", 40)
    assert entry.wait(0) is blob and not is_producer
    m = cache.metrics
    assert (m.hits, m.misses, m.bytes, m.evictions, m.num_entries) == (2, 1, 40, 0, 1)
    assert entry.pinned_by == {"r1", "r2", "r3"}


def test_wait_times_out_while_pending():
    cache = TensorLRUCache(100)
    entry, _ = cache.lookup_or_reserve(key("a"), "r1", 10)
    with pytest.raises(TimeoutError, match="not ready after 0.01 s"):
        entry.wait(timeout_s=0.01)


def test_lru_eviction_by_bytes_of_unpinned_ready_entries():
    cache = TensorLRUCache(100)
    for name in ("a", "b", "c"):
        produce(cache, name, 30)
        cache.unpin(key(name), "r")
    cache.lookup_or_reserve(key("a"), "r2", 30)  # touch a: b is now least recently used
    cache.unpin(key("a"), "r2")
    produce(cache, "d", 30)  # 120 > 100: evicts b only
    assert key("b") not in cache and all(key(n) in cache for n in "acd")
    produce(cache, "e", 60)  # needs 50 more: evicts c, then a (a was touched after c)
    assert [k.content_hash for k in (key(n) for n in "acde") if k in cache] == ["d", "e"]
    assert cache.metrics.evictions == 3 and cache.bytes == 90


def test_pinned_entries_are_never_evicted():
    cache = TensorLRUCache(100)
    produce(cache, "a", 60, request_id="consumer")  # stays pinned by its request
    cache.lookup_or_reserve(key("b"), "r2", 50)
    assert not cache.begin_produce(key("b"), "r2")  # only a could go, and it is pinned
    assert key("a") in cache and cache.bytes == 60
    with pytest.raises(EncoderCacheFullError, match="all pinned"):
        cache.commit(key("b"), Blob(50))
    cache.unpin(key("a"), "consumer")
    assert cache.begin_produce(key("b"), "r2")
    assert key("a") not in cache and cache.metrics.evictions == 1


def test_batch_level_failure_fails_only_the_producer_and_a_consumer_takes_over():
    cache = TensorLRUCache(100)
    entry, _ = cache.lookup_or_reserve(key("a"), "producer", 10)
    cache.lookup_or_reserve(key("a"), "consumer", 10)
    assert cache.begin_produce(key("a"), "producer") and cache.bytes == 10
    failed = cache.fail(key("a"), RuntimeError("oom"), producer_only=True)
    assert failed == {"producer"}
    assert entry.state is CacheEntryState.PENDING and entry.producer_request_id is None
    assert entry.pinned_by == {"consumer"} and cache.bytes == 0 and not entry.is_in_flight
    with pytest.raises(TimeoutError):
        entry.wait(0)  # the consumer keeps waiting: nothing failed for it
    assert cache.begin_produce(key("a"), "consumer")  # the next pass picks a new producer
    cache.commit(key("a"), Blob(10))
    assert entry.wait(0).nbytes == 10 and entry.produced_by == "consumer"


def test_shape_failure_fails_every_request_using_the_key():
    cache = TensorLRUCache(100)
    entry, _ = cache.lookup_or_reserve(key("a"), "producer", 10)
    cache.lookup_or_reserve(key("a"), "consumer", 10)
    cache.begin_produce(key("a"), "producer")
    error = ValueError("wrong shape")
    assert cache.fail(key("a"), error, producer_only=False) == {"producer", "consumer"}
    assert entry.state is CacheEntryState.FAILED and cache.bytes == 0 and key("a") not in cache
    with pytest.raises(ValueError, match="wrong shape"):
        entry.wait(0)
    fresh, is_producer = cache.lookup_or_reserve(key("a"), "later", 10)  # a later request retries
    assert fresh is not entry and is_producer


def test_unpin_hands_production_over_and_drops_unwanted_pending_entries():
    cache = TensorLRUCache(100)
    entry, _ = cache.lookup_or_reserve(key("a"), "r1", 10)
    cache.lookup_or_reserve(key("a"), "r2", 10)
    cache.unpin(key("a"), "r1")
    assert entry.producer_request_id is None and key("a") in cache
    cache.unpin(key("a"), "r2")
    assert key("a") not in cache
    cache.unpin(key("a"), "r2")  # unknown: no-op


def test_requeue_uncharges_and_keeps_the_producer():
    cache = TensorLRUCache(100)
    entry, _ = cache.lookup_or_reserve(key("a"), "r1", 10)
    cache.begin_produce(key("a"), "r1")
    cache.requeue(key("a"))
    assert cache.bytes == 0 and not entry.is_in_flight and entry.producer_request_id == "r1"


def test_commit_rejects_a_size_other_than_reserved():
    cache = TensorLRUCache(100)
    cache.lookup_or_reserve(key("a"), "r1", 10)
    cache.begin_produce(key("a"), "r1")
    with pytest.raises(ValueError, match="committed 12 bytes, reserved 10"):
        cache.commit(key("a"), Blob(12))


def test_concurrent_lookups_elect_exactly_one_producer():
    cache = TensorLRUCache(100)
    results = []
    barrier = threading.Barrier(16)

    def lookup(i: int) -> None:
        barrier.wait()
        results.append(cache.lookup_or_reserve(key("a"), f"r{i}", 10))

    threads = [threading.Thread(target=lookup, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sum(is_producer for _, is_producer in results) == 1
    assert len({id(entry) for entry, _ in results}) == 1
    assert cache.metrics.misses == 1 and cache.metrics.hits == 15


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="positive int, got 0"):
        TensorLRUCache(0)
