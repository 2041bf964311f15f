"""Lease renewal: a held import keeps its lease past the TTL, one Renew per producer; a lease
expires only when its consumer is gone (stopped renewing, or dropped the import)."""
from __future__ import annotations

import gc
import logging
import time

import grpc
import pytest
import torch

from epd.transport import LeaseExpiredError, LeaseRenewer, TensorStore, get_channel, import_tensor, serve_tensor_store
from epd.v1 import tensor_pb2, tensor_pb2_grpc
from tests.transport.helpers import FakeClock, make_tensor

CONSUMER_LOG = "epd.transport.consumer"


def wait_until(predicate, timeout_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


@pytest.fixture
def served():
    """A real store (real clock: the sweeper and the renewer run on real time) served on 127.0.0.1."""
    store = TensorStore()
    server = serve_tensor_store(store)
    store.start_sweeper(period_s=0.1)
    yield store
    server.stop(0)
    store.close()


@pytest.fixture
def renewer():
    renewer = LeaseRenewer(period_s=0.1, rpc_timeout_s=1.0)
    yield renewer
    renewer.stop()


def count_renew_calls(store: TensorStore) -> list[list[str]]:
    """Record the lease ids of every Renew that reaches ``store`` (the servicer calls store.renew)."""
    calls: list[list[str]] = []
    renew = store.renew

    def counting(lease_ids, ttl_s):
        calls.append(list(lease_ids))
        return renew(lease_ids, ttl_s)

    store.renew = counting
    return calls


def test_a_held_import_outlives_its_ttl_and_release_ends_it_at_once(served, renewer):
    exported = make_tensor("float32", (64, 32), seed=1)
    handle = served.export(exported, transport="shm", ttl_s=1.0)
    imported = import_tensor(handle, renewer=renewer)
    time.sleep(2.5)  # 2.5 TTLs, the sweeper running every 0.1 s
    assert served.num_open_leases == 1
    served.exported(handle.lease_id)  # raises if the lease ended
    assert torch.equal(imported.tensor, exported)
    assert imported.release()
    assert served.num_open_leases == 0 and renewer.num_held == 0
    with pytest.raises(LeaseExpiredError, match="was released"):
        served.exported(handle.lease_id)


@pytest.mark.parametrize("how", ["renewer stopped", "import dropped without release"])
def test_a_lease_whose_consumer_stopped_renewing_expires_after_its_ttl(served, renewer, how):
    handle = served.export(torch.ones(1024), transport="shm", ttl_s=1.0)
    imported = import_tensor(handle, renewer=renewer)
    time.sleep(1.5)
    assert served.num_open_leases == 1  # renewed so far
    if how == "renewer stopped":
        renewer.stop()
    else:
        del imported
        gc.collect()
    calls = count_renew_calls(served)  # from now on
    # nothing renews it any more (a pass already under way may still land once): it ends by its TTL,
    # which the sweeper (every 0.1 s) enforces; 5 s is several TTLs, room for a loaded machine
    assert wait_until(lambda: served.num_open_leases == 0, timeout_s=5.0), \
        f"the lease was still open 5 s after its consumer stopped renewing (TTL 1 s); renewals since: {calls}"
    assert sum(handle.lease_id in ids for ids in calls) <= 1, calls
    with pytest.raises(LeaseExpiredError, match="expired"):
        served.exported(handle.lease_id)
    if how == "renewer stopped":
        assert imported.release()  # the producer answers "not held any more": not an error


def test_a_handle_with_little_time_left_is_renewed_at_once(served):
    renewer = LeaseRenewer(period_s=1.0, rpc_timeout_s=1.0)  # asks for >= 4 s; the first pass is 1 s away
    try:
        handle = served.export(torch.ones(1024), transport="shm", ttl_s=0.3)
        imported = import_tensor(handle, renewer=renewer)
        time.sleep(0.8)
        assert served.num_open_leases == 1
        imported.release()
    finally:
        renewer.stop()


def test_leases_of_one_producer_renew_in_one_call_through_the_given_channels(served):
    calls = count_renew_calls(served)
    addresses: list[str] = []

    def channel_factory(address: str) -> grpc.Channel:
        addresses.append(address)
        return get_channel(address)

    monotonic = FakeClock()  # the renewer's idea of elapsed time moves only when the test says so
    renewer = LeaseRenewer(period_s=0.05, rpc_timeout_s=1.0, monotonic=monotonic)
    try:
        a, b = (import_tensor(served.export(torch.full((1024,), float(i)), transport="shm", ttl_s=10),
                              channel_factory=channel_factory, renewer=renewer) for i in range(2))
        time.sleep(0.3)
        assert calls == []  # 10 s left of 10: nothing due
        monotonic.advance(6)  # 4 s left: under half the TTL
        assert wait_until(lambda: calls, timeout_s=5.0)
        time.sleep(0.3)  # a few more passes: renewed, so not due again
        assert calls == [[a.lease_id, b.lease_id]]
        assert addresses == [served.address]
        a.release(), b.release()
    finally:
        renewer.stop()


def test_a_lease_gone_at_the_producer_is_dropped_and_logged_once(served, caplog):
    monotonic = FakeClock()
    renewer = LeaseRenewer(period_s=0.05, rpc_timeout_s=1.0, monotonic=monotonic)
    try:
        imported = import_tensor(served.export(torch.ones(1024), transport="shm", ttl_s=10), renewer=renewer)
        served.release([imported.lease_id])  # e.g. the router released it for a cancelled request
        monotonic.advance(6)
        assert wait_until(lambda: renewer.num_held == 0, timeout_s=5.0)
        monotonic.advance(6)
        time.sleep(0.2)
        assert caplog.text.count(f"lease {imported.lease_id} at {served.address} is not open any more") == 1
        assert renewer.running
        imported.release()
    finally:
        renewer.stop()


def test_an_unreachable_producer_is_logged_and_retried_never_raised(caplog):
    caplog.set_level(logging.DEBUG, logger=CONSUMER_LOG)
    store = TensorStore()
    server = serve_tensor_store(store)
    monotonic = FakeClock()
    renewer = LeaseRenewer(period_s=0.05, rpc_timeout_s=1.0, monotonic=monotonic)
    try:
        imported = import_tensor(store.export(torch.ones(1024), transport="shm", ttl_s=10), renewer=renewer)
        server.stop(0).wait(5)  # the producer's server is gone
        monotonic.advance(6)

        def failures() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == CONSUMER_LOG and "failed" in r.getMessage()]

        assert wait_until(lambda: len(failures()) >= 3, timeout_s=10.0)  # retried pass after pass
        assert [r.levelno for r in failures()][:3] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "renewing 1 lease(s) at " + store.address in failures()[0].getMessage()
        assert imported.lease_id not in caplog.text  # no lease ids (they release leases) in the logs
        start = time.monotonic()
        assert renewer.renew_due() == 0  # a pass of its own: bounded by the rpc timeout, raises nothing
        assert time.monotonic() - start < 1.0 + 1.0
        assert renewer.running and renewer.num_held == 1
        imported.release()
    finally:
        renewer.stop()
        store.close()


def test_imports_without_a_lease_or_producer_address_are_never_held(served):
    renewer = LeaseRenewer(period_s=0.05)
    unserved = TensorStore()  # no address: nowhere to renew at
    try:
        inline = import_tensor(served.export(torch.ones(4), transport="inline", ttl_s=10), renewer=renewer)
        assert inline.lease_id == ""
        nowhere = import_tensor(unserved.export(torch.ones(4), transport="shm", ttl_s=10), renewer=renewer)
        assert nowhere.lease_id and not nowhere.handle.producer_address
        assert renewer.num_held == 0 and not renewer.running
        inline.release()
        nowhere.release()  # logs that it can't tell the producer; the store closes below
    finally:
        renewer.stop()
        unserved.close()


def test_renew_rpc_answers_expiries_zero_for_gone_and_rejects_a_zero_ttl(served):
    handle = served.export(torch.ones(1024), transport="shm", ttl_s=10)
    stub = tensor_pb2_grpc.TensorStoreStub(get_channel(served.address))
    before_ms = int(time.time() * 1000)
    reply = stub.Renew(tensor_pb2.RenewRequest(lease_ids=[handle.lease_id, "0" * 32], ttl_ms=30_000), timeout=5)
    assert reply.expires_unix_ms[0] >= before_ms + 30_000 and reply.expires_unix_ms[1] == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Renew(tensor_pb2.RenewRequest(lease_ids=[handle.lease_id], ttl_ms=0), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s must be > 0" in err.value.details()
    served.release([handle.lease_id])


def test_renewer_settings_are_validated():
    with pytest.raises(ValueError, match="period_s > 0, 0 < margin_fraction < 1"):
        LeaseRenewer(period_s=0)
    with pytest.raises(ValueError):
        LeaseRenewer(margin_fraction=1.0)
