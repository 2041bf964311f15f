"""Producer and consumer in different processes: handles cross as protobuf bytes on a pipe, data by
shm or by gRPC on 127.0.0.1; either side dying leaves nothing behind and nobody hanging."""
from __future__ import annotations

import os
import time

import pytest
import torch

from epd.transport import LeaseExpiredError, TensorStore, TransportError, cleanup_stale_segments, import_tensor
from tests.transport.helpers import ChildProcess, ProducerProcess, make_tensor, shm_names

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess()
    yield process
    process.stop()


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_round_trip(producer, transport, dtype):
    handle = producer.export(transport, dtype, (5, 7), seed=4)
    assert handle.producer_address == producer.address
    with import_tensor(handle) as imported:
        assert torch.equal(imported.tensor, make_tensor(dtype, (5, 7), seed=4))
    assert producer.stats() == (0, 0)  # the release reached the producer over gRPC


def test_shm_view_maps_the_producers_segment(producer):
    handle = producer.export("shm", "float32", (256, 256), seed=5)
    imported = import_tensor(handle)
    pointer = imported.tensor.data_ptr()
    spans = [line.split()[0].split("-") for line in open("/proc/self/maps") if handle.shm.segment_name in line]
    assert any(int(lo, 16) <= pointer < int(hi, 16) for lo, hi in spans)
    assert torch.equal(imported.tensor, make_tensor("float32", (256, 256), seed=5))
    imported.release()
    assert producer.stats() == (0, 0)


def test_64_mib_crosses_grpc_in_chunks(producer):
    numel = 64 * MiB // 4
    handle = producer.export("inline", "float32", (numel,), seed=6)
    assert handle.inline.streamed and len(handle.SerializeToString()) < 1024  # 4 MiB is gRPC's default limit
    with import_tensor(handle) as imported:
        assert imported.tensor.nbytes == 64 * MiB
        assert torch.equal(imported.tensor, make_tensor("float32", (numel,), seed=6))
    assert producer.stats() == (0, 0)


def test_producer_killed_consumer_fails_fast_and_cleanup_removes_segments():
    process = ProducerProcess()
    try:
        shm_handle = process.export("shm", "float32", (64, 64), seed=7)
        streamed_handle = process.export("inline", "float32", (512 * 1024,), seed=7)  # 2 MiB: streamed
        assert os.path.exists(f"/dev/shm/{shm_handle.shm.segment_name}")
    finally:
        process.kill()
    start = time.monotonic()
    with pytest.raises(TransportError, match="producer of shm segment .* is gone"):
        import_tensor(shm_handle)
    with pytest.raises(TransportError, match="did not answer Fetch"):
        import_tensor(streamed_handle, timeout_s=5)
    assert time.monotonic() - start < 6
    removed = cleanup_stale_segments()
    owner = shm_handle.shm.segment_name.rsplit("_", 1)[0]
    assert {shm_handle.shm.segment_name, owner} <= set(removed)
    assert not any(name.startswith(owner) for name in shm_names())


_CONSUMER = """
import sys, time
from epd.transport import import_tensor
from tests.transport.helpers import handle_from_hex
imported = import_tensor(handle_from_hex(sys.argv[1]))
print("MAPPED", float(imported.tensor.sum()), flush=True)
time.sleep(600)
"""


def test_consumer_killed_producer_sweep_reclaims(clock):
    with TensorStore(clock=clock) as store:
        handle = store.export(torch.ones(1000), transport="shm", ttl_s=30, consumer_hint="doomed")
        consumer = ChildProcess(["-c", _CONSUMER, handle.SerializeToString().hex()])
        try:
            assert float(consumer.expect("MAPPED")) == 1000.0
        finally:
            consumer.kill()  # dies holding the lease, never releasing it
        assert store.num_open_leases == 1
        clock.advance(31)
        assert store.sweep() == 1
        assert store.num_open_leases == 0 and store.open_bytes == 0
        assert not os.path.exists(f"/dev/shm/{handle.shm.segment_name}")
        with pytest.raises(LeaseExpiredError, match="expired"):
            import_tensor(handle)
