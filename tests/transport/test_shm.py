"""shm transport in one process: zero-copy views, permissions, names, pool reuse, expiry, bad handles."""
from __future__ import annotations

import _posixshmem
import mmap
import os
import re
import secrets
import stat
import subprocess

import pytest
import torch

from epd.transport import LeaseExpiredError, TensorStore, TransportError, cleanup_stale_segments, import_tensor
from epd.transport.shm import HEADER_BYTES, segment_capacity_bytes, shared_empty
from tests.transport.helpers import make_tensor, shm_names


@pytest.fixture
def store(clock):
    store = TensorStore(clock=clock)
    yield store
    store.close()


def _segment_path(handle) -> str:
    return os.path.join("/dev/shm", handle.shm.segment_name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "float16", "bool"])
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0, 4)])
def test_round_trip(store, dtype, shape):
    original = make_tensor(dtype, shape, seed=1)
    with import_tensor(store.export(original, transport="shm", ttl_s=10)) as imported:
        assert imported.tensor.dtype == original.dtype and imported.tensor.shape == original.shape
        assert torch.equal(imported.tensor, original)


def test_non_contiguous_input_is_copied_once_into_layout(store):
    original = make_tensor("float32", (6, 4), seed=2).t()  # strided
    with import_tensor(store.export(original, transport="shm", ttl_s=10)) as imported:
        assert torch.equal(imported.tensor, original) and imported.tensor.is_contiguous()


def test_consumer_view_is_the_segment_itself(store):
    handle = store.export(torch.zeros(1024), transport="shm", ttl_s=10)
    imported = import_tensor(handle)
    # the view's memory lies inside a mapping of this very segment file ...
    pointer = imported.tensor.data_ptr()
    mappings = [line for line in open("/proc/self/maps") if handle.shm.segment_name in line]
    assert any(int(lo, 16) <= pointer < int(hi, 16)
               for lo, hi in (line.split()[0].split("-") for line in mappings))
    # ... so a write through any other mapping of it shows up without a copy
    with open(_segment_path(handle), "r+b") as file, mmap.mmap(file.fileno(), 0) as other:
        other[HEADER_BYTES:HEADER_BYTES + 4] = torch.tensor([42.0]).numpy().tobytes()
    assert imported.tensor[0].item() == 42.0
    imported.release()


def test_segment_is_private_to_the_user_and_unguessable(store):
    names = set()
    for _ in range(2):
        handle = store.export(torch.zeros(16), transport="shm", ttl_s=10)
        assert os.stat(_segment_path(handle)).st_mode & 0o777 == 0o600
        assert stat.S_ISREG(os.stat(_segment_path(handle)).st_mode)
        match = re.fullmatch(r"epd_(\d+)_([0-9a-f]{16})_([0-9a-f]{32})", handle.shm.segment_name)
        assert match and int(match[1]) == os.getpid()
        names.add(match[3])  # 32 hex digits = 128 random bits per segment, on top of the owner's 64
        assert len(handle.lease_id) == 32  # lease ids are 128-bit tokens too
    assert len(names) == 2


def test_release_unlinks_when_the_pool_is_off(clock):
    with TensorStore(clock=clock, shm_pool_bytes=0) as store:
        handle = store.export(torch.zeros(16), transport="shm", ttl_s=10)
        assert os.path.exists(_segment_path(handle))
        store.release([handle.lease_id])
        assert not os.path.exists(_segment_path(handle))
        with pytest.raises(LeaseExpiredError, match="expired.*is gone"):
            import_tensor(handle)


def test_released_segment_is_reused_and_stale_handles_fail(store):
    first = store.export(torch.ones(1000), transport="shm", ttl_s=10)
    store.release([first.lease_id])
    second = store.export(torch.full((900,), 2.0), transport="shm", ttl_s=10)
    assert second.shm.segment_name == first.shm.segment_name  # pooled: already faulted in
    with pytest.raises(LeaseExpiredError, match=f"lease {first.lease_id} was released .*expired.*no longer serves it"):
        import_tensor(first)
    with import_tensor(second) as imported:
        assert torch.equal(imported.tensor, torch.full((900,), 2.0))


def test_expired_segment_is_unlinked_not_pooled(store, clock):
    handle = store.export(torch.zeros(16), transport="shm", ttl_s=1)
    imported = import_tensor(handle, clock=clock)  # mapped before the TTL passes
    clock.advance(2)
    with pytest.raises(LeaseExpiredError, match=f"lease {handle.lease_id} expired 1.000 s ago"):
        import_tensor(handle, clock=clock)  # the handle's own expiry, checked before any syscall
    assert store.sweep() == 1
    assert not os.path.exists(_segment_path(handle))
    assert imported.tensor.sum().item() == 0  # a consumer still holding the mapping keeps valid memory
    with pytest.raises(LeaseExpiredError, match="expired"):
        import_tensor(handle)  # even with a clock that disagrees, the segment is gone
    imported.release()


def test_bad_handles_fail_clearly(store):
    handle = store.export(torch.zeros(4, 4), transport="shm", ttl_s=10)
    too_big = type(handle).FromString(handle.SerializeToString())
    too_big.shape[:] = [400, 400]
    too_big.nbytes = 400 * 400 * 4
    with pytest.raises(TransportError, match=r"640000 bytes at offset 64 does not fit segment_bytes=65536"):
        import_tensor(too_big)
    traversal = type(handle).FromString(handle.SerializeToString())
    traversal.shm.segment_name = "../etc/passwd"
    with pytest.raises(TransportError, match="not an EPD shm segment name"):
        import_tensor(traversal)
    lying = type(handle).FromString(handle.SerializeToString())
    lying.shm.segment_bytes = 1 << 30  # claims more than the file holds
    lying.shape[:] = [1 << 20]
    lying.nbytes = 4 << 20
    with pytest.raises(TransportError, match=r"holds 65536 bytes, the handle needs 4194368"):
        import_tensor(lying)


def test_close_unlinks_every_segment_and_the_owner_lock(clock):
    store = TensorStore(clock=clock)
    before = shm_names()
    handles = [store.export(torch.zeros(n), transport="shm", ttl_s=10) for n in (1, 100_000)]
    store.release([handles[0].lease_id])  # one pooled, one leased
    assert len(shm_names() - before) == 3  # two segments and the owner lock
    store.close()
    assert shm_names() - before == set()


def test_cleanup_leaves_live_producers_alone(store):
    handle = store.export(torch.zeros(16), transport="shm", ttl_s=10)
    assert handle.shm.segment_name not in cleanup_stale_segments()
    assert os.path.exists(_segment_path(handle))


@pytest.mark.parametrize("nbytes, capacity", [
    (1, 64 << 10), (64 << 10, 64 << 10), ((64 << 10) + 1, 80 << 10), ((64 << 20) + 64, 80 << 20), (100 << 20, 112 << 20),
])
def test_segment_size_classes_waste_at_most_a_quarter(nbytes, capacity):
    assert segment_capacity_bytes(nbytes) == capacity


def test_cleanup_falls_back_to_the_pid_when_there_is_no_owner_lock():
    finished = subprocess.Popen(["true"])
    finished.wait()  # reaped: its pid names no process now
    names = {
        "dead": f"epd_{finished.pid}_{secrets.token_hex(8)}_{secrets.token_hex(16)}",
        "alive": f"epd_{os.getpid()}_{secrets.token_hex(8)}_{secrets.token_hex(16)}",
    }
    for name in names.values():
        os.close(_posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        removed = cleanup_stale_segments()
        assert names["dead"] in removed and names["alive"] not in removed
        assert not os.path.exists(f"/dev/shm/{names['dead']}") and os.path.exists(f"/dev/shm/{names['alive']}")
    finally:
        for name in names.values():
            if os.path.exists(f"/dev/shm/{name}"):
                _posixshmem.shm_unlink("/" + name)


def test_a_live_owner_is_alive_by_its_segments_name_and_by_its_locks_own(clock):
    """The suite's leak check asks this of every new name in /dev/shm, owner locks included: calling
    a running cluster's lock dead got it unlinked under its workers."""
    from epd.shm_owners import owner_alive, owner_lock_name

    store = TensorStore(clock=clock)
    segment = store.export(torch.zeros(16), transport="shm", ttl_s=10).shm.segment_name
    lock = owner_lock_name(segment)
    assert owner_alive(segment) and owner_alive(lock)
    store.close()
    assert not owner_alive(segment) and not owner_alive(lock)


def test_the_suites_leak_check_judges_only_epd_names_and_their_producers(clock):
    """``own_names`` and ``is_stale`` (the session's leak check): another program's file that only
    starts with ``epd_`` is not listed; a live store's segment and lock are not stale, a dead
    pid's lock-less segment is."""
    from epd.shm_owners import is_stale, own_names, owner_lock_name

    foreign = f"epd_cache_{secrets.token_hex(4)}"
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = f"epd_{finished.pid}_{secrets.token_hex(8)}_{secrets.token_hex(16)}"
    for name in (foreign, dead):
        os.close(_posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    store = TensorStore(clock=clock)
    try:
        segment = store.export(torch.zeros(16), transport="shm", ttl_s=10).shm.segment_name
        names = own_names()
        assert foreign not in names and {dead, segment, owner_lock_name(segment)} <= names
        assert not is_stale(segment) and not is_stale(owner_lock_name(segment)) and is_stale(dead)
        with pytest.raises(ValueError, match="not an EPD shared-memory name"):
            is_stale(foreign)
    finally:
        store.close()
        for name in (foreign, dead):
            _posixshmem.shm_unlink("/" + name)


# ---- zero-copy: tensors made in shared memory ------------------------------------------------------
def test_a_tensor_made_in_shared_memory_exports_without_a_copy(store):
    rows = shared_empty(store, (64, 8), torch.float32)
    rows.copy_(torch.arange(512, dtype=torch.float32).view(64, 8))  # the producer writes its output once
    whole = store.export(rows, transport="shm", ttl_s=10)
    part = store.export(rows[16:32], transport="shm", ttl_s=10)  # a contiguous slice: the same segment
    assert whole.shm.segment_name == part.shm.segment_name and whole.shm.generation
    assert part.shm.offset_bytes == whole.shm.offset_bytes + 16 * 8 * 4
    with import_tensor(whole) as a, import_tensor(part) as b:
        assert torch.equal(a.tensor, rows) and torch.equal(b.tensor, rows[16:32])
        rows[20, 0] = -1.0  # one memory: a write by the producer is what the consumer sees (no copy made)
        assert a.tensor[20, 0].item() == -1.0 and b.tensor[4, 0].item() == -1.0


def test_a_made_segment_is_pooled_only_once_the_tensor_and_every_lease_let_go(store):
    import gc

    rows = shared_empty(store, (256,), torch.float32)
    rows.fill_(3.0)
    first = store.export(rows, transport="shm", ttl_s=10)
    second = store.export(rows, transport="shm", ttl_s=10)
    view = rows[10:20]
    del rows
    gc.collect()
    arena = store.transport_state("shm", None)
    assert arena.pooled_bytes == 0  # a view of it lives on
    del view
    gc.collect()
    store.release([first.lease_id])
    assert arena.pooled_bytes == 0  # one lease still open: the consumer may read it
    imported = import_tensor(second)
    assert torch.equal(imported.tensor, torch.full((256,), 3.0))
    store.release([second.lease_id])  # what the consumer's release does over gRPC
    del imported
    gc.collect()
    assert arena.pooled_bytes == segment_capacity_bytes(HEADER_BYTES + 1024)  # back in the pool
    reused = store.export(torch.zeros(200), transport="shm", ttl_s=10)
    assert reused.shm.segment_name == second.shm.segment_name
    with pytest.raises(LeaseExpiredError, match="no longer serves it"):
        import_tensor(second)  # a stale handle to the reused segment fails, it reads nothing


def test_a_made_segment_whose_lease_expired_is_unlinked_not_reused(store, clock):
    import gc

    rows = shared_empty(store, (16,), torch.float32)
    handle = store.export(rows, transport="shm", ttl_s=1)
    clock.advance(2)
    assert store.sweep() == 1
    assert os.path.exists(_segment_path(handle))  # the tensor still holds it
    del rows
    gc.collect()
    assert not os.path.exists(_segment_path(handle))
    assert store.transport_state("shm", None).pooled_bytes == 0


def test_a_lease_released_unused_returns_its_segment_to_the_pool(store):
    handle = store.export(torch.zeros(1000), transport="shm", ttl_s=10)
    store.release([handle.lease_id], unused=True)  # a refused push: nobody imported it
    assert os.path.exists(_segment_path(handle))
    assert store.transport_state("shm", None).pooled_bytes == handle.shm.segment_bytes
