"""NCCL communicators kept per peer pair, with NCCL itself replaced by an in-memory fake (the
protocol is what is tested; tests/transport/test_cuda.py runs the real thing on two GPUs): one
communicator serves every transfer of a pair, concurrent transfers arrive intact and in order, and
a producer that restarted or a receive that failed makes a new one on the next transfer."""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from epd.transport.handles import TransportError
from epd.transport.nccl_pairs import PendingSend, RecvPairs, SendPairs


class FakeNccl:
    """Two ranks that join a unique id share one FIFO; sends go in, receives come out in order."""

    def __init__(self) -> None:
        self.links: dict[bytes, queue.Queue] = {}
        self.joins: list[tuple[bytes, int]] = []
        self.fail_next_recv = False
        self._lock = threading.Lock()
        self._count = 0

    def new_unique_id(self) -> bytes:
        with self._lock:
            self._count += 1
            return b"uid-%d" % self._count

    def join(self, unique_id, rank, device):
        with self._lock:
            self.joins.append((unique_id, rank))
            return self.links.setdefault(unique_id, queue.Queue())

    def send(self, comm, tensor, ready, peer) -> None:
        comm.put(tensor.clone())

    def recv(self, comm, out, peer, after) -> None:
        if self.fail_next_recv:
            self.fail_next_recv = False
            raise RuntimeError("unhandled cuda error")
        out.copy_(comm.get(timeout=10))

    def destroy(self, comm) -> None:
        pass

    abort = destroy


@pytest.fixture
def nccl():
    return FakeNccl()


def _transfer(producer: SendPairs, consumer: RecvPairs, value: float, name: str = "p:1") -> torch.Tensor:
    tensor = torch.full((64,), value)
    out = torch.empty(64)
    consumer.receive(out, name, lambda consumer_id, communicator_id: producer.submit(
        consumer_id, communicator_id, PendingSend(tensor, None, tensor.nbytes)), timeout_s=10)
    return out


def test_one_communicator_serves_every_transfer_of_a_pair(nccl):
    producer, consumer = SendPairs(nccl), RecvPairs(nccl)
    for value in range(5):
        assert torch.equal(_transfer(producer, consumer, float(value)), torch.full((64,), float(value)))
    assert producer.num_made == 1 and sorted(rank for _, rank in nccl.joins) == [0, 1]
    _transfer(producer, consumer, 9.0, name="another-producer:1")  # another pair: its own communicator
    assert producer.num_made == 2


def test_concurrent_transfers_on_one_pair_arrive_intact(nccl):
    producer, consumer = SendPairs(nccl), RecvPairs(nccl)
    results: dict[int, torch.Tensor] = {}
    threads = [threading.Thread(target=lambda v=v: results.__setitem__(v, _transfer(producer, consumer, float(v))))
               for v in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(torch.equal(results[v], torch.full((64,), float(v))) for v in range(16))
    assert producer.num_made == 1


def test_a_restarted_producer_or_a_failed_receive_makes_a_new_communicator(nccl):
    producer, consumer = SendPairs(nccl), RecvPairs(nccl)
    _transfer(producer, consumer, 1.0)
    restarted = SendPairs(nccl)  # the consumer still names the old communicator: unknown here
    assert torch.equal(_transfer(restarted, consumer, 2.0), torch.full((64,), 2.0))
    assert restarted.num_made == 1
    nccl.fail_next_recv = True
    with pytest.raises(TransportError, match="NCCL receive of 256 bytes failed: unhandled cuda error"):
        _transfer(restarted, consumer, 3.0)
    assert torch.equal(_transfer(restarted, consumer, 4.0), torch.full((64,), 4.0))  # on a new pair
    assert restarted.num_made == 2
