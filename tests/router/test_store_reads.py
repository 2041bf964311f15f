"""Which items prefill reads from the cluster's encoder cache store itself (the router's
``StoreReads``): what encoders said is in the store, by mode and by where the encoder that said it
is; only for a prefill that reads the store; a hint that proved wrong is forgotten."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from epd.router.backends.store_reads import StoreReads
from epd.transport.store import store_handle
from epd.v1 import tensor_pb2

HANDLE = store_handle("epd/enc/v1/m/h1/kw/4/float32", dtype="float32", shape=(4, 8), nbytes=128)


def _prefill(host: str = "host-a", reads: bool = True):
    return SimpleNamespace(host_id=host, last_health=SimpleNamespace(reads_encoder_store=reads))


def _picked(reads: StoreReads, hashes, prefill, encoders) -> list[int]:
    return [push.item_index for push in reads.pick("r1", hashes, prefill, lambda: encoders)]


def test_auto_reads_the_store_only_where_no_encoder_beside_prefill_holds_the_item():
    reads = StoreReads("auto")
    reads.learn(["h1", "h2"], [HANDLE, tensor_pb2.TensorHandle()], "enc-a:1")  # h2: not in the store
    reads.learn(["h3"], [HANDLE], "enc-b:1")
    hashes = ["h1", "h2", "h3", "h1"]
    both = {"enc-a:1": "host-a", "enc-b:1": "host-b"}
    assert _picked(reads, hashes, _prefill("host-a"), both) == [2]  # enc-a is beside prefill: it pushes
    assert _picked(reads, hashes, _prefill("host-b"), both) == [0, 3]  # one image twice: both read
    assert _picked(reads, hashes, _prefill("host-a"), {"enc-b:1": "host-b"}) == [0, 2, 3]  # enc-a out of rotation
    pushes = reads.pick("r1", hashes, _prefill("host-b"), lambda: both)
    assert {p.request_id for p in pushes} == {"r1"} and pushes[0].embedding == HANDLE


@pytest.mark.parametrize("mode, expected", [("always", [0, 2]), ("never", [])])
def test_always_reads_every_item_the_store_has_and_never_none(mode, expected):
    reads = StoreReads(mode)
    reads.learn(["h1", "h2", "h3"], [HANDLE, tensor_pb2.TensorHandle(), HANDLE], "enc-a:1")
    assert _picked(reads, ["h1", "h2", "h3"], _prefill("host-a"), {"enc-a:1": "host-a"}) == expected


def test_a_prefill_that_does_not_read_the_store_gets_no_store_handle():
    reads = StoreReads("always")
    reads.learn(["h1"], [HANDLE], "enc-a:1")
    assert _picked(reads, ["h1"], _prefill(reads=False), {}) == []


def test_a_miss_is_forgotten_an_empty_answer_unlearns_and_the_oldest_go_first():
    reads = StoreReads("always", max_items=2)
    reads.learn(["h1", "h2"], [HANDLE, HANDLE], "enc-a:1")
    reads.forget("h1")
    assert _picked(reads, ["h1", "h2"], _prefill(), {}) == [1] and reads.num_missed == 1
    reads.learn(["h2"], [tensor_pb2.TensorHandle()], "enc-b:1")  # an encoder found it gone
    assert _picked(reads, ["h2"], _prefill(), {}) == []
    reads.learn(["h3", "h4", "h5"], [HANDLE] * 3, "enc-a:1")
    assert _picked(reads, ["h3", "h4", "h5"], _prefill(), {}) == [1, 2]
    with pytest.raises(ValueError, match="prefill_store_reads must be one of"):
        StoreReads("sometimes")
