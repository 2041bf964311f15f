"""``nccl`` transport: cross host, GPU. NCCL point-to-point from the producer (rank 0) to the
consumer (rank 1) over a 2-rank communicator kept per peer pair (``epd.transport.nccl_pairs``): the
consumer asks ``TensorStore.NcclUniqueId(transfer_id, its id, the communicator it holds)``; that
call queues the producer's send on the pair's communicator, and makes a new one (answering its
unique id) only at the pair's first transfer or after either end failed.

``cupy`` (the ``cuda12`` / ``cuda13`` extra, after torch's CUDA) provides the NCCL bindings; it is
imported only when this transport is used.
"""
from __future__ import annotations

import logging
from functools import cache

import grpc
import torch

from epd.transport.base import TRANSPORTS, Exported, ImportContext, wait_for_producer
from epd.transport.handles import TransportError
from epd.transport.inline import rpc_error
from epd.transport.leases import find_local_export
from epd.transport.nccl_pairs import PRODUCER_RANK, PendingSend, RecvPairs, SendPairs
from epd.v1 import tensor_pb2, tensor_pb2_grpc

log = logging.getLogger(__name__)


def cuda_extra_hint() -> str:
    """The pip command for the cupy + NCCL that match this torch's CUDA major version."""
    major = (torch.version.cuda or "").split(".")[0]
    if major in ("12", "13"):
        return f"pip install 'epd[cuda{major}]'"
    # A CPU torch (or an unknown CUDA): name both, since the right one depends on the torch to come.
    return "pip install 'epd[cuda12]' or 'epd[cuda13]', the one matching torch's CUDA"


def _nccl():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as err:
        raise TransportError(
            f"the nccl transport needs cupy with NCCL ({err}); run {cuda_extra_hint()}") from None
    if not getattr(nccl, "available", True):
        raise TransportError(f"cupy was built without NCCL; run {cuda_extra_hint()}")
    return cupy, nccl


def unique_id_to_bytes(unique_id: tuple[int, ...]) -> bytes:
    return bytes(b % 256 for b in unique_id)  # cupy gives C chars, i.e. signed


def unique_id_from_bytes(data: bytes) -> tuple[int, ...]:
    return tuple(b - 256 if b >= 128 else b for b in data)


class CupyNccl:
    """The NCCL calls the pairs make, through cupy (each on the thread that makes it: the current
    device is per thread, for cupy and torch alike)."""

    def __init__(self) -> None:
        self.cupy, self.nccl = _nccl()

    def new_unique_id(self):
        return self.nccl.get_unique_id()

    def join(self, unique_id, rank: int, device: torch.device):
        self._use(device)
        return self.nccl.NcclCommunicator(2, unique_id, rank)

    def send(self, comm, tensor: torch.Tensor, ready, peer: int) -> None:
        self._use(tensor.device)
        stream = torch.cuda.Stream(tensor.device)
        if ready is not None:
            stream.wait_event(ready)  # the kernels that wrote the tensor may still be running
        comm.send(tensor.data_ptr(), tensor.numel() * tensor.element_size(), self.nccl.NCCL_UINT8, peer,
                  stream.cuda_stream)
        stream.synchronize()

    def recv(self, comm, out: torch.Tensor, peer: int, after) -> None:
        self._use(out.device)
        stream = torch.cuda.Stream(out.device)
        if after is not None:
            stream.wait_event(after)  # ``out`` is stream-ordered on the caller's stream
        comm.recv(out.data_ptr(), out.numel() * out.element_size(), self.nccl.NCCL_UINT8, peer, stream.cuda_stream)
        stream.synchronize()

    def destroy(self, comm) -> None:
        comm.destroy()

    def abort(self, comm) -> None:
        comm.abort()

    def _use(self, device: torch.device) -> None:
        self.cupy.cuda.Device(device.index).use()
        torch.cuda.set_device(device)


@cache
def _ops() -> CupyNccl:
    return CupyNccl()


@cache
def _receivers() -> RecvPairs:
    return RecvPairs(_ops())


class _NcclSend:
    """Producer side of one transfer: queued on its pair's communicator when the consumer asks."""

    def __init__(self, tensor: torch.Tensor, ready) -> None:
        self.pending = PendingSend(tensor, ready, tensor.numel() * tensor.element_size())
        self.started = False

    def reclaim(self, reason: str) -> None:
        pass  # the lease drops the tensor; a queued send holds its own reference until done


class NcclTransport:
    name = "nccl"
    same_host_only = False

    def export(self, store, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, ready_event=None) -> Exported:
        if not tensor.is_cuda:
            raise TransportError(f"nccl exports CUDA tensors; got one on {tensor.device} (use inline)")
        if not store.address:
            raise TransportError("nccl needs the TensorStore's gRPC address for the unique-id rendezvous; "
                                 "set TensorStore.address")
        _nccl()  # fail at export, not at the consumer, when the extra is missing
        wait_for_producer(tensor, ready_event)
        tensor = tensor.contiguous()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        handle.nccl.transfer_id = handle.lease_id  # unguessable, and one lookup serves both
        handle.nccl.peer_rank = PRODUCER_RANK
        handle.nccl.rendezvous_address = store.address
        return Exported(payload=tensor, resource=_NcclSend(tensor, ready), keepalive=(ready,))

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise TransportError("importing an nccl handle needs CUDA in this process")
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        local = find_local_export(handle.lease_id)
        if local is not None and local.payload is not None:
            # same process: a 2-rank group with ourselves would deadlock; use the tensor directly
            stream = torch.cuda.current_stream(device)
            for event in local.keepalive:
                stream.wait_event(event)
            return _to_requested(local.payload.view(shape), ctx)
        out = torch.empty(shape, dtype=dtype, device=device)
        if handle.nbytes:
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(device))
            address = handle.nccl.rendezvous_address or handle.producer_address
            _receivers().receive(out, address, lambda consumer_id, communicator_id: _ask(
                handle, ctx, address, consumer_id, communicator_id), ctx.timeout_s, after=allocated)
        return _to_requested(out, ctx)


def _ask(handle: tensor_pb2.TensorHandle, ctx: ImportContext, address: str, consumer_id: str,
         communicator_id: str) -> tuple[str, bytes | None]:
    stub = tensor_pb2_grpc.TensorStoreStub(ctx.channel_factory(address))
    try:
        reply = stub.NcclUniqueId(tensor_pb2.NcclUniqueIdRequest(
            transfer_id=handle.nccl.transfer_id, consumer_id=consumer_id, communicator_id=communicator_id),
            timeout=ctx.timeout_s)
    except grpc.RpcError as err:
        raise rpc_error(err, handle.lease_id, address, "NcclUniqueId") from None
    return reply.communicator_id, (unique_id_from_bytes(reply.unique_id) if reply.unique_id else None)


def _to_requested(tensor: torch.Tensor, ctx: ImportContext) -> torch.Tensor:
    return tensor if ctx.device.type == "cuda" else tensor.to(ctx.device)


def nccl_unique_id(store, transfer_id: str, consumer_id: str, communicator_id: str
                   ) -> tensor_pb2.NcclUniqueIdResponse:
    """Serve TensorStore.NcclUniqueId: queue the transfer's send on the consumer's pair
    communicator (a new one, with its unique id in the answer, when the consumer holds none)."""
    if not consumer_id:
        raise TransportError("NcclUniqueId needs the consumer_id of the consumer's end of the pair")
    exported = store.exported(transfer_id)  # LeaseExpiredError when it ended
    send = exported.resource
    if not isinstance(send, _NcclSend):
        raise TransportError(f"lease {transfer_id} is not an nccl transfer")
    if send.started:
        raise TransportError("this NCCL transfer was already started; a transfer is received once")
    send.started = True
    pairs = store.transport_state("nccl", lambda _store: SendPairs(_ops()))
    used, unique_id = pairs.submit(consumer_id, communicator_id, send.pending)
    return tensor_pb2.NcclUniqueIdResponse(communicator_id=used,
                                           unique_id=unique_id_to_bytes(unique_id) if unique_id is not None else b"")


TRANSPORTS.register("nccl")(NcclTransport())
