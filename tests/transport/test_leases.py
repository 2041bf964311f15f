"""TensorStore bookkeeping: leases end by release, TTL or close, and say how they ended."""
from __future__ import annotations

import time

import pytest
import torch

from epd.transport import LeaseExpiredError, TensorStore, TransportError
from epd.transport.leases import MAX_RENEW_TTL_S


@pytest.fixture
def store(clock):
    store = TensorStore(clock=clock, address="127.0.0.1:1")  # an address so big inline tensors stream
    yield store
    store.close()


def test_export_validates_transport_and_ttl(store):
    with pytest.raises(ValueError, match=r"unknown transport 'tcp'; expected one of \['cuda_ipc', 'inline', 'nccl', 'shm'\]"):
        store.export(torch.zeros(2), transport="tcp", ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        store.export(torch.zeros(2), transport="shm", ttl_s=0)


def test_open_leases_and_bytes_follow_export_and_release(store):
    a = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    b = store.export(torch.zeros(2, 1 << 19), transport="inline", ttl_s=10)  # 4 MiB: streamed, so leased
    assert store.num_open_leases == 2 and store.open_bytes == 1024 + (4 << 20)
    assert store.release([a.lease_id, "not-a-lease"]) == 1
    assert store.num_open_leases == 1 and store.open_bytes == 4 << 20
    assert store.release([a.lease_id]) == 0  # idempotent
    assert store.release([b.lease_id]) == 1 and store.open_bytes == 0


def test_small_inline_handles_hold_no_lease(store):
    handle = store.export(torch.ones(4), transport="inline", ttl_s=10)
    assert handle.lease_id == "" and handle.expires_unix_ms == 0 and store.num_open_leases == 0


def test_sweep_reclaims_only_expired_leases(store, clock):
    short = store.export(torch.zeros(2, 1 << 19), transport="inline", ttl_s=1)
    long = store.export(torch.zeros(2, 1 << 19), transport="inline", ttl_s=100)
    assert short.expires_unix_ms == int((clock() + 1) * 1000)
    clock.advance(1.5)
    assert store.sweep() == 1
    assert store.num_open_leases == 1
    with pytest.raises(LeaseExpiredError, match=rf"lease {short.lease_id} expired 0\.500 s ago"):
        store.payload(short.lease_id)
    assert store.payload(long.lease_id).shape == (2, 1 << 19)


def test_released_and_unknown_leases_say_so(store, clock):
    handle = store.export(torch.zeros(2, 1 << 19), transport="inline", ttl_s=10)
    store.release([handle.lease_id])
    clock.advance(3)
    with pytest.raises(LeaseExpiredError, match=r"was released 3\.000 s ago \(a released lease counts as expired\)"):
        store.payload(handle.lease_id)
    with pytest.raises(LeaseExpiredError, match="unknown to this producer: it expired"):
        store.payload("0" * 32)


def test_release_consumer_drops_only_its_leases(store):
    store.export(torch.zeros(8), transport="shm", ttl_s=10, consumer_hint="prefill-0")
    store.export(torch.zeros(8), transport="shm", ttl_s=10, consumer_hint="prefill-0")
    store.export(torch.zeros(8), transport="shm", ttl_s=10, consumer_hint="prefill-1")
    assert store.release_consumer("prefill-0") == 2
    assert store.num_open_leases == 1


def test_background_sweeper_uses_the_store_clock():
    store = TensorStore()  # real clock: the sweeper thread is what is under test
    try:
        store.export(torch.zeros(64), transport="shm", ttl_s=0.05)
        store.start_sweeper(period_s=0.02)
        deadline = time.monotonic() + 5
        while store.num_open_leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.num_open_leases == 0
    finally:
        store.close()


def test_close_reclaims_everything_and_refuses_exports(clock):
    store = TensorStore(clock=clock)
    store.export(torch.zeros(64), transport="shm", ttl_s=10)
    store.close()
    assert store.num_open_leases == 0 and store.open_bytes == 0
    with pytest.raises(TransportError, match="closed"):
        store.export(torch.zeros(64), transport="shm", ttl_s=10)


def test_streamed_inline_needs_an_address(clock):
    with TensorStore(clock=clock) as store:
        with pytest.raises(TransportError, match="exceeds inline_max_bytes=1048576.*no address"):
            store.export(torch.zeros(1 << 19), transport="inline", ttl_s=10)


def test_renew_extends_but_never_shortens(store, clock):
    handle = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    assert store.renew([handle.lease_id], ttl_s=30) == [clock() + 30]
    assert store.renew([handle.lease_id], ttl_s=5) == [clock() + 30]  # a shorter ask keeps the longer expiry
    clock.advance(29)
    assert store.sweep() == 0 and store.num_open_leases == 1
    clock.advance(2)
    assert store.sweep() == 1


def test_renew_reports_released_and_unknown_ids_as_gone(store, clock):
    kept = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    released = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    store.release([released.lease_id])
    assert store.renew([released.lease_id, kept.lease_id, "0" * 32], ttl_s=20) == [None, clock() + 20, None]


def test_renew_keeps_a_lease_past_expiry_that_is_not_swept_yet(store, clock):
    handle = store.export(torch.zeros(256), transport="shm", ttl_s=1)
    clock.advance(2)  # expired on paper, but its memory is untouched until the sweep
    assert store.renew([handle.lease_id], ttl_s=5) == [clock() + 5]
    assert store.sweep() == 0


@pytest.mark.parametrize("ttl_s", [0, -1.0, float("nan")])
def test_renew_rejects_a_ttl_that_is_not_positive(store, ttl_s):
    handle = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        store.renew([handle.lease_id], ttl_s=ttl_s)


def test_renew_caps_the_ttl(store, clock):
    handle = store.export(torch.zeros(256), transport="shm", ttl_s=10)
    assert store.renew([handle.lease_id], ttl_s=1e9) == [clock() + MAX_RENEW_TTL_S]
    assert store.renew([handle.lease_id], ttl_s=float("inf")) == [clock() + MAX_RENEW_TTL_S]
