"""``nccl`` transport: cross host, GPU. NCCL point-to-point between the producer (rank 0) and the
consumer (rank 1) of a 2-rank communicator made for the transfer.

The unique id that both ranks need is created by the producer when the consumer asks for it with
``TensorStore.NcclUniqueId(transfer_id)``; that same call starts the producer's send. One
communicator per transfer keeps the protocol stateless; a communicator cached per peer pair would
save the init cost (tens of ms) and is the next step when cross-host GPU traffic matters.

``cupy`` (the ``cuda12`` / ``cuda13`` extra, after torch's CUDA) provides the NCCL bindings; it is imported only when this transport
is used.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import torch

from epd.transport.base import TRANSPORTS, Exported, ImportContext, wait_for_producer
from epd.transport.handles import TransportError
from epd.transport.inline import rpc_error
from epd.transport.leases import find_local_export
from epd.v1 import tensor_pb2, tensor_pb2_grpc

_PRODUCER_RANK, _CONSUMER_RANK = 0, 1
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


def _run_with_timeout(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """NCCL init blocks until both ranks join; a dead peer must become an error, not a hang.
    (The stuck daemon thread can't be cancelled; it dies with the process.)"""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(err)

    thread = threading.Thread(target=run, name=f"epd-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TransportError(f"{what} did not finish within {timeout_s} s; the peer may have died")
    if failure:
        raise TransportError(f"{what} failed: {failure[0]}") from failure[0]


class _NcclSend:
    """Producer side of one transfer; started by the consumer's NcclUniqueId call."""

    def __init__(self, tensor: torch.Tensor, ready: torch.cuda.Event) -> None:
        self.tensor, self.ready = tensor, ready
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> bytes:
        with self._lock:
            if self._started:
                raise TransportError("this NCCL transfer was already started; a transfer is received once")
            self._started = True
        cupy, nccl = _nccl()
        unique_id = nccl.get_unique_id()
        threading.Thread(target=self._send, args=(cupy, nccl, unique_id), name="epd-nccl-send", daemon=True).start()
        return unique_id_to_bytes(unique_id)

    def _send(self, cupy, nccl, unique_id) -> None:
        try:
            self._send_or_raise(cupy, nccl, unique_id)
        except Exception:  # a background thread: log it, the consumer sees its own timeout/error
            log.exception("NCCL send of %d bytes failed", self.tensor.numel() * self.tensor.element_size())

    def _send_or_raise(self, cupy, nccl, unique_id) -> None:
        device = self.tensor.device
        cupy.cuda.Device(device.index).use()  # the current device is per thread, for cupy and torch alike
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        stream.wait_event(self.ready)  # the kernels that wrote the tensor may still be running
        comm = nccl.NcclCommunicator(2, unique_id, _PRODUCER_RANK)
        try:
            comm.send(self.tensor.data_ptr(), self.tensor.numel() * self.tensor.element_size(), nccl.NCCL_UINT8,
                      _CONSUMER_RANK, stream.cuda_stream)
            stream.synchronize()
        finally:
            comm.destroy()

    def reclaim(self, reason: str) -> None:
        pass  # the lease drops the tensor; a send in flight holds its own reference until done


class NcclTransport:
    name = "nccl"

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
        handle.nccl.peer_rank = _PRODUCER_RANK
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
            unique_id = _request_unique_id(handle, ctx)
            _receive(out, unique_id, handle.nccl.peer_rank, ctx.timeout_s)
        return _to_requested(out, ctx)


def _request_unique_id(handle: tensor_pb2.TensorHandle, ctx: ImportContext) -> tuple[int, ...]:
    address = handle.nccl.rendezvous_address or handle.producer_address
    stub = tensor_pb2_grpc.TensorStoreStub(ctx.channel_factory(address))
    try:
        reply = stub.NcclUniqueId(tensor_pb2.NcclUniqueIdRequest(transfer_id=handle.nccl.transfer_id),
                                  timeout=ctx.timeout_s)
    except grpc.RpcError as err:
        raise rpc_error(err, handle.lease_id, address, "NcclUniqueId") from None
    return unique_id_from_bytes(reply.unique_id)


def _receive(out: torch.Tensor, unique_id: tuple[int, ...], peer_rank: int, timeout_s: float) -> None:
    cupy, nccl = _nccl()
    allocated = torch.cuda.Event()
    # `out` is stream-ordered on this thread's stream; the receiving stream must start after it
    allocated.record(torch.cuda.current_stream(out.device))

    def receive() -> None:
        cupy.cuda.Device(out.device.index).use()
        torch.cuda.set_device(out.device)
        stream = torch.cuda.Stream(out.device)
        stream.wait_event(allocated)
        comm = nccl.NcclCommunicator(2, unique_id, _CONSUMER_RANK)
        try:
            comm.recv(out.data_ptr(), out.numel() * out.element_size(), nccl.NCCL_UINT8, peer_rank,
                      stream.cuda_stream)
            stream.synchronize()
        finally:
            comm.destroy()

    _run_with_timeout(receive, timeout_s, "NCCL receive")


def _to_requested(tensor: torch.Tensor, ctx: ImportContext) -> torch.Tensor:
    return tensor if ctx.device.type == "cuda" else tensor.to(ctx.device)


def nccl_unique_id(store, transfer_id: str) -> bytes:
    """Serve TensorStore.NcclUniqueId: hand out the id and start the producer's send."""
    exported = store.exported(transfer_id)  # LeaseExpiredError when it ended
    if not isinstance(exported.resource, _NcclSend):
        raise TransportError(f"lease {transfer_id} is not an nccl transfer")
    return exported.resource.start()


TRANSPORTS.register("nccl")(NcclTransport())
