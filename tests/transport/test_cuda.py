"""GPU transports, producer and consumer in two real processes. Skipped without CUDA; they run as
they are on any CUDA machine (nccl needs two GPUs, since NCCL refuses two ranks on one device,
and cupy from the `cuda12`/`cuda13` extra)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from epd.transport import TensorStore, import_tensor
from tests.transport.helpers import ProducerProcess, make_tensor

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_nccl = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is None or torch.cuda.device_count() < 2,
    reason="nccl needs cupy (scripts/setup.sh cuda, or pip install 'epd[cuda12]' / 'epd[cuda13]') and two GPUs")


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess()
    yield process
    process.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_cuda_ipc_across_processes(producer, dtype):
    handle = producer.export("cuda_ipc", dtype, (33, 17), seed=8, device="cuda:0")
    assert handle.WhichOneof("body") == "cuda_ipc" and handle.ready_event.cuda_ipc_event_handle
    with import_tensor(handle, device="cuda") as imported:
        assert imported.tensor.is_cuda
        expected = make_tensor(dtype, (33, 17), seed=8).cuda()
        assert torch.equal(imported.tensor, expected)  # after wait_event on the producer's stream
    assert producer.stats() == (0, 0)


def test_cuda_ipc_slice_of_a_batch_travels_without_copy(clock):
    batch = torch.arange(4 * 1024, dtype=torch.float32, device="cuda").view(4, 1024)
    with TensorStore(clock=clock) as store:
        handle = store.export(batch[2:], transport="cuda_ipc", ttl_s=10)
        assert handle.cuda_ipc.storage_bytes == 2 * 1024 * 4
        with import_tensor(handle, device="cuda") as imported:  # same process: the local path
            assert torch.equal(imported.tensor, batch[2:])


def test_cuda_ipc_to_a_cpu_consumer(producer):
    handle = producer.export("cuda_ipc", "float32", (8,), seed=9, device="cuda:0")
    with import_tensor(handle, device="cpu") as imported:
        assert imported.tensor.device.type == "cpu"
        assert torch.equal(imported.tensor, make_tensor("float32", (8,), seed=9))


def test_shm_from_a_gpu_tensor(producer):
    handle = producer.export("shm", "bfloat16", (16, 16), seed=10, device="cuda:0")
    with import_tensor(handle, device="cuda") as imported:
        assert imported.tensor.is_cuda
        assert torch.equal(imported.tensor.cpu(), make_tensor("bfloat16", (16, 16), seed=10))


@needs_nccl
def test_nccl_across_processes(producer):
    handle = producer.export("nccl", "float32", (1024, 64), seed=11, device="cuda:0")
    assert handle.nccl.rendezvous_address == producer.address
    with import_tensor(handle, device="cuda:1", timeout_s=60) as imported:
        assert imported.tensor.device == torch.device("cuda", 1)
        assert torch.equal(imported.tensor.cpu(), make_tensor("float32", (1024, 64), seed=11))
    assert producer.stats() == (0, 0)


def test_cuda_ipc_exports_nobody_imports_are_freed_when_their_leases_end(clock):
    """torch keeps a shared block until its one expected consumer drops it; a consumer that never
    came (a refused push, an expired lease) never does, so the lease counts down for it."""
    import gc

    with TensorStore(clock=clock) as store:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        refused, expired = [], []
        for n in range(8):
            tensor = torch.full((16 * 1024 * 1024,), float(n), device="cuda")  # 64 MiB each
            handle = store.export(tensor, transport="cuda_ipc", ttl_s=1 if n % 2 else 60)
            (expired if n % 2 else refused).append(handle.lease_id)
            del tensor
        assert torch.cuda.memory_allocated() >= baseline + 8 * 64 * 1024 * 1024
        store.release(refused, unused=True)
        clock.advance(2)
        store.sweep()
        gc.collect()
        torch.cuda.ipc_collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= baseline + 1024 * 1024, "never-imported exports stayed allocated"


def test_a_producers_event_orders_the_consumer_after_its_stream(clock):
    """Rows written on a side stream (as an engine thread might): the export carries the event the
    producer recorded there, and the consumer, waiting on it, reads the finished rows."""
    from epd.transport import ready_event_after_writes
    side = torch.cuda.Stream()
    with TensorStore(clock=clock) as store:  # the import, in this process, finds the export in its store
        with torch.cuda.stream(side):
            rows = torch.empty(4096, 1024, device="cuda")
            torch.cuda._sleep(50_000_000)  # keep the side stream busy so the write lands late
            rows.fill_(7.0)
            ready = ready_event_after_writes(rows)
            handle = store.export(rows, transport="cuda_ipc", ttl_s=10, ready_event=ready)
        with import_tensor(handle, device="cuda") as imported:  # on the default stream
            assert torch.all(imported.tensor == 7.0).item()
