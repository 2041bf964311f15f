"""inline transport through a real gRPC TensorStore server on 127.0.0.1 (this process)."""
from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from epd.transport import LeaseExpiredError, TensorStore, TransportError, import_tensor, serve_tensor_store
from epd.transport.inline import iter_chunks
from epd.v1 import tensor_pb2, tensor_pb2_grpc
from tests.transport.helpers import make_tensor

MiB = 1024 * 1024


@pytest.fixture
def served(clock):
    store = TensorStore(clock=clock, inline_max_bytes=64 * 1024)
    server = serve_tensor_store(store)
    yield store
    server.stop(0)
    store.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("shape", [(4, 8), (300, 100)])  # embedded, and streamed past 64 KiB
def test_round_trip(served, dtype, shape):
    original = make_tensor(dtype, shape, seed=3)
    handle = served.export(original, transport="inline", ttl_s=10)
    assert handle.inline.streamed == (handle.nbytes > 64 * 1024)
    with import_tensor(handle) as imported:
        assert torch.equal(imported.tensor, original)
    assert served.num_open_leases == 0  # released over gRPC


def test_empty_tensor(served):
    with import_tensor(served.export(torch.zeros(0, 3), transport="inline", ttl_s=10)) as imported:
        assert imported.tensor.shape == (0, 3)


def test_chunks_stay_small_whatever_is_asked():
    payload = torch.zeros(10 * MiB, dtype=torch.uint8)
    sizes = [len(chunk.data) for chunk in iter_chunks(payload, chunk_bytes=1 << 30)]
    assert max(sizes) < 4 * MiB and sum(sizes) == 10 * MiB


def test_fetch_rejects_an_unknown_lease_with_not_found(served):
    stub = tensor_pb2_grpc.TensorStoreStub(grpc.insecure_channel(served.address))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Fetch(tensor_pb2.FetchRequest(lease_id="f" * 32), timeout=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()


def test_expired_streamed_lease_gives_lease_expired(served, clock):
    handle = served.export(torch.zeros(1 * MiB), transport="inline", ttl_s=1)
    clock.advance(5)
    served.sweep()
    # the consumer's clock still thinks it's valid: the producer's answer is what tells it
    with pytest.raises(LeaseExpiredError, match=f"lease {handle.lease_id} expired 4.000 s ago"):
        import_tensor(handle)


def test_body_size_mismatch_is_a_clear_error(served):
    handle = served.export(torch.zeros(4), transport="inline", ttl_s=10)
    handle.inline.data = handle.inline.data[:10]
    with pytest.raises(TransportError, match=r"inline body holds 10 bytes, float32\[4\] needs 16"):
        import_tensor(handle)


def test_unreachable_producer_fails_within_the_deadline(served):
    handle = served.export(torch.zeros(1 * MiB), transport="inline", ttl_s=10)
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        handle.inline.fetch_address = f"127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(TransportError, match="did not answer Fetch"):
        import_tensor(handle, timeout_s=3)
    assert time.monotonic() - start < 4
