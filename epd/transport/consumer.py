"""Consumer side: turn a handle back into a tensor, and release the lease when done."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import grpc
import torch

from epd.transport.base import TRANSPORTS, ImportContext
from epd.transport.channels import get_channel
from epd.transport.handles import TransportError, check_header, check_not_expired
from epd.v1 import tensor_pb2, tensor_pb2_grpc

log = logging.getLogger(__name__)
ChannelFactory = Callable[[str], grpc.Channel]


class ImportedTensor:
    """A tensor that may still live in the producer's memory (shm, CUDA IPC).

    Use ``.tensor`` until ``release()``; after it the producer may reuse the memory, so the tensor
    (and any view of it you kept) must not be read any more. Copy out what you need to keep.
    """

    def __init__(self, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, channel_factory: ChannelFactory,
                 timeout_s: float) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.handle = handle
        self._channel_factory = channel_factory
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._released = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise TransportError(f"lease {self.handle.lease_id} was released; its tensor is no longer valid")
        return self._tensor

    @property
    def lease_id(self) -> str:
        return self.handle.lease_id

    def release(self) -> bool:
        """Tell the producer we are done. Idempotent. Returns False (and logs) when the producer could
        not be told: its TTL sweep reclaims the lease anyway, so this is never fatal."""
        with self._lock:
            if self._released:
                return True
            self._released = True
            self._tensor = None
        if not self.handle.lease_id:
            return True  # the bytes came inside the handle: no lease
        return release_leases(self.handle.producer_address, [self.handle.lease_id],
                              channel_factory=self._channel_factory, timeout_s=self._timeout_s) >= 0

    def __enter__(self) -> ImportedTensor:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def import_tensor(handle: tensor_pb2.TensorHandle, *, device: str | torch.device = "cpu",
                  channel_factory: ChannelFactory | None = None, timeout_s: float = 30.0,
                  clock: Callable[[], float] = time.time) -> ImportedTensor:
    """Import ``handle`` onto ``device``. ``timeout_s`` bounds every network wait, so a dead producer
    is an error within that time, never a hang. Raises LeaseExpiredError when the lease is gone and
    TransportError for anything else that can't work."""
    check_not_expired(handle, clock)
    dtype, shape = check_header(handle)
    channel_factory = channel_factory or get_channel
    ctx = ImportContext(device=torch.device(device), channel_factory=channel_factory, timeout_s=timeout_s)
    tensor = TRANSPORTS.get(handle.WhichOneof("body")).import_(handle, dtype, shape, ctx)
    return ImportedTensor(tensor, handle, channel_factory, timeout_s)


def release_leases(address: str, lease_ids: Iterable[str], *, channel_factory: ChannelFactory | None = None,
                   timeout_s: float = 5.0) -> int:
    """Release several leases of one producer in one call; returns how many it still held, or -1
    (logged) when it could not be reached."""
    lease_ids = [lease_id for lease_id in lease_ids if lease_id]
    if not lease_ids:
        return 0
    if not address:
        log.warning("can't release leases %s: the handle has no producer_address", lease_ids)
        return -1
    stub = tensor_pb2_grpc.TensorStoreStub((channel_factory or get_channel)(address))
    try:
        reply = stub.Release(tensor_pb2.ReleaseRequest(lease_ids=lease_ids), timeout=timeout_s)
    except grpc.RpcError as err:
        log.warning("release of leases %s at %s failed (%s: %s); the producer's TTL will reclaim them",
                    lease_ids, address, err.code().name, err.details())
        return -1
    return reply.num_released
