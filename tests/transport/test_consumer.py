"""ImportedTensor's lifetime rules and the channel pool."""
from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from epd.transport import TensorStore, TransportError, get_channel, import_tensor, serve_tensor_store
from epd.transport.channels import ChannelPool


@pytest.fixture
def served(clock):
    store = TensorStore(clock=clock)
    server = serve_tensor_store(store)
    yield store
    server.stop(0)
    store.close()


def test_release_is_idempotent_and_ends_tensor_access(served):
    imported = import_tensor(served.export(torch.arange(6.0), transport="shm", ttl_s=10))
    assert served.num_open_leases == 1
    assert imported.release() and imported.release()
    assert served.num_open_leases == 0
    with pytest.raises(TransportError, match=f"lease {imported.lease_id} was released"):
        imported.tensor


def test_context_manager_releases_even_on_error(served):
    with pytest.raises(ZeroDivisionError):
        with import_tensor(served.export(torch.ones(3), transport="shm", ttl_s=10)):
            1 / 0
    assert served.num_open_leases == 0


def test_release_to_a_dead_producer_is_logged_not_raised(served, caplog):
    handle = served.export(torch.ones(3), transport="shm", ttl_s=10)
    imported = import_tensor(handle)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        imported.handle.producer_address = f"127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    assert imported.release() is False
    assert time.monotonic() - start < 5.5
    assert "TTL will reclaim" in caplog.text
    served.release([handle.lease_id])


def test_channels_are_shared_per_address_and_closed_together():
    pool = ChannelPool()
    assert pool.get("127.0.0.1:1") is pool.get("127.0.0.1:1")
    assert pool.get("127.0.0.1:1") is not pool.get("127.0.0.1:2")
    pool.close_all()
    assert get_channel("127.0.0.1:3") is get_channel("127.0.0.1:3")  # the process-wide pool
    with pytest.raises(ValueError, match="empty gRPC address"):
        pool.get("")


def test_a_release_by_consumer_key_frees_that_keys_leases_and_a_short_key_frees_nothing(served):
    from epd.v1 import tensor_pb2, tensor_pb2_grpc

    key, other = "k" * 32, "o" * 32
    served.export(torch.ones(3), transport="shm", ttl_s=10, consumer_hint=key)
    served.export(torch.ones(3), transport="shm", ttl_s=10, consumer_hint=other)
    short = served.export(torch.ones(3), transport="shm", ttl_s=10, consumer_hint="k")
    stub = tensor_pb2_grpc.TensorStoreStub(get_channel(served.address))
    assert stub.Release(tensor_pb2.ReleaseRequest(consumer_keys=["k", ""]), timeout=5).num_released == 0
    assert stub.Release(tensor_pb2.ReleaseRequest(consumer_keys=[key]), timeout=5).num_released == 1
    assert served.num_open_leases == 2
    assert stub.Release(tensor_pb2.ReleaseRequest(lease_ids=[short.lease_id]), timeout=5).num_released == 1
    with pytest.raises(grpc.RpcError) as refused:
        stub.Release(tensor_pb2.ReleaseRequest(consumer_keys=[key] * 17), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16" in refused.value.details()
