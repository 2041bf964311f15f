"""``store`` handles (``epd.transport.store``): prefill reads an item's rows from the cluster's
encoder cache store itself, checked as an encoder checks them (dtype, shape, checksum); an entry
that is gone, damaged or unreadable is a ``TransportError`` (the caller has the rows pushed the
usual way), never wrong rows; a process that has not joined the store refuses the handles."""
from __future__ import annotations

import pytest
import torch

from epd.transport import TransportError, import_tensor
from epd.transport.store import reads_store, store_handle, use_store
from epd.transport.store_entries import MemoryBackend, encode_entry

KEY = "epd/enc/v1/model/c0ffee/kw/3/float32"


@pytest.fixture
def backend():
    store = MemoryBackend()
    previous = use_store(store)
    yield store
    use_store(previous)


def test_a_store_handle_reads_the_entrys_rows_without_a_lease(backend):
    rows = torch.randn(3, 8)
    backend.entries[KEY] = encode_entry(rows)
    assert reads_store()
    imported = import_tensor(store_handle(KEY, rows))
    assert torch.equal(imported.tensor, rows) and imported.lease_id == ""
    assert imported.release()  # nothing to give back: the store keeps the entry
    assert KEY in backend.entries


@pytest.mark.parametrize("damage", ["gone", "truncated", "flipped", "other shape", "store down"])
def test_an_entry_that_cannot_be_used_is_a_transport_error_naming_it(backend, damage):
    rows = torch.randn(3, 8)
    blob = encode_entry(rows)
    if damage == "truncated":
        blob = blob[:-4]
    elif damage == "flipped":
        blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
    elif damage == "other shape":
        blob = encode_entry(torch.randn(4, 6))
    if damage != "gone":
        backend.entries[KEY] = blob
    backend.fail = damage == "store down"
    with pytest.raises(TransportError, match=f"store entry {KEY}"):
        import_tensor(store_handle(KEY, rows))


def test_a_process_not_joined_to_the_store_refuses_store_handles():
    previous = use_store(None)
    try:
        assert not reads_store()
        with pytest.raises(TransportError, match="does not read the encoder cache store"):
            import_tensor(store_handle(KEY, dtype="float32", shape=(3, 8), nbytes=96))
    finally:
        use_store(previous)
