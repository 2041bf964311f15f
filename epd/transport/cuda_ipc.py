"""``cuda_ipc`` transport: same host, GPU. The consumer maps the producer's device memory; no copy.

Producer: ``storage._share_cuda_()`` yields the CUDA IPC memory handle of the allocation that holds
the tensor (plus torch's IPC reference counter, which keeps that allocation out of the caching
allocator's reuse until every consumer has dropped it). We also record an interprocess CUDA event
on the producing stream: the kernels that write the tensor may still be running when the handle
is sent. The producer records it where it wrote the tensor (``ready_event``: the encoder's engine
thread after a batch, prefill's after copying out the KV); an export without one records on the
exporting thread's stream, right only while every thread uses the default stream.

Lifetime: torch counts one consumer per share and keeps the producer's block out of reuse until
that consumer's storage dies. A consumer that never opens the handle (a request cancelled, a push
refused, a lease expired because the consumer died) never counts down, and the block would stay
allocated for the producer's lifetime; so a lease that ends unused (``unused``, ``expired``)
counts down for it and collects, and the same-process path (which never opens an IPC handle)
counts down at import.

Consumer: ``current_stream.wait_event(ready_event)`` so our kernels start after the
producer's writes, and ``tensor.record_stream(current_stream)`` so the caching allocator won't hand
the memory out again while kernels queued on this stream still read it. For memory opened over IPC
torch skips record_stream (its IPC reference counter guards that memory instead); it does the real
work on the in-process path, where the tensor comes straight from the producer's allocator.

The tensor's own offset inside its storage is folded into ``storage_offset_bytes`` and
``storage_bytes`` covers exactly the tensor, so a contiguous slice of a batch (an encoder output
row range) travels without a device copy. Non-contiguous tensors are made contiguous first.
"""
from __future__ import annotations

import logging

import torch

from epd.transport.base import TRANSPORTS, Exported, ImportContext, wait_for_producer
from epd.transport.handles import TransportError
from epd.transport.leases import find_local_export
from epd.v1 import tensor_pb2

log = logging.getLogger(__name__)


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise TransportError(f"{what} needs CUDA, but torch.cuda.is_available() is False in this process")


def device_uuid(ordinal: int) -> str:
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def local_ordinal(producer_ordinal: int, uuid: str) -> int:
    """This process's ordinal of the producer's GPU: found by UUID (each process numbers the GPUs
    it sees from 0); a handle without one (an older producer) keeps the producer's ordinal."""
    if not uuid:
        return producer_ordinal
    for ordinal in range(torch.cuda.device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    raise TransportError(f"cuda_ipc: the producer's GPU {uuid} is not visible in this process "
                         f"(CUDA_VISIBLE_DEVICES); use shm or inline between these workers")


class CudaIpcTransport:
    name = "cuda_ipc"
    same_host_only = True

    def export(self, store, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, ready_event=None) -> Exported:
        if not tensor.is_cuda:
            raise TransportError(f"cuda_ipc exports CUDA tensors; got one on {tensor.device} (use shm or inline)")
        if not tensor.is_contiguous():
            wait_for_producer(tensor, ready_event)  # the copy below reads it on this thread's stream
            tensor, ready_event = tensor.contiguous(), None
        ready = ready_event if _is_interprocess(ready_event) else _recorded_here(tensor, ready_event)
        if tensor.numel() == 0:
            shared = (tensor.device.index, b"", 0, 0, b"", 0, b"", False)
        else:
            try:
                shared = tensor.untyped_storage()._share_cuda_()
            except RuntimeError as err:  # e.g. re-sending a tensor that was itself received over IPC
                raise TransportError(f"cuda_ipc can't share this tensor ({err}); export a .clone() of it") from err
        device, mem_handle, _storage_bytes, storage_offset_bytes, ref_handle, ref_offset, event, sync = shared
        body = handle.cuda_ipc
        body.device = device
        body.device_uuid = device_uuid(device)
        body.mem_handle = mem_handle or b""
        body.storage_bytes = handle.nbytes
        body.storage_offset_bytes = storage_offset_bytes + tensor.storage_offset() * tensor.element_size()
        body.ref_counter_handle = ref_handle or b""
        body.ref_counter_offset = ref_offset
        body.event_handle = event or b""
        body.event_sync_required = bool(sync)
        handle.ready_event.cuda_ipc_event_handle = ready.ipc_handle()
        handle.ready_event.device = device
        # the lease keeps the tensor (its memory) and the event (the consumer opens it by handle)
        return Exported(payload=tensor, keepalive=(ready,),
                        resource=_IpcShare(ref_handle or b"", ref_offset, tensor.device))

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        _require_cuda("importing a cuda_ipc handle")
        body = handle.cuda_ipc
        device = torch.device("cuda", local_ordinal(body.device, body.device_uuid))
        if body.storage_bytes != handle.nbytes:
            raise TransportError(f"lease {handle.lease_id}: cuda_ipc storage_bytes={body.storage_bytes}, "
                                 f"{handle.dtype}{list(shape)} needs {handle.nbytes}")
        local = find_local_export(handle.lease_id)
        if local is not None and local.payload is not None:
            # same process: CUDA refuses to open our own IPC handle, so use the tensor and event directly
            tensor = local.payload.view(shape)
            if isinstance(local.resource, _IpcShare):
                local.resource.count_down()  # no IPC handle will be opened for this share
            stream = torch.cuda.current_stream(device)
            for event in local.keepalive:
                stream.wait_event(event)
            tensor.record_stream(stream)
        elif handle.nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        else:
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    device.index, body.mem_handle, body.storage_bytes, body.storage_offset_bytes,
                    body.ref_counter_handle, body.ref_counter_offset, body.event_handle, body.event_sync_required)
                tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)
                stream = torch.cuda.current_stream(device)
                if handle.ready_event.cuda_ipc_event_handle:
                    ready = torch.cuda.Event.from_ipc_handle(device, handle.ready_event.cuda_ipc_event_handle)
                    stream.wait_event(ready)
                tensor.record_stream(stream)
        # a copy only when asked for another device (a CPU consumer of a GPU producer, another GPU)
        return tensor if ctx.device in (device, torch.device("cuda")) else tensor.to(ctx.device)


def _is_interprocess(event) -> bool:
    if event is None:
        return False
    try:
        event.ipc_handle()
    except RuntimeError:  # an ordinary event: it can't be opened by the consumer
        return False
    return True


def _recorded_here(tensor: torch.Tensor, after) -> torch.cuda.Event:
    """An interprocess event on this thread's stream, after ``after`` (the producer's own event)."""
    stream = torch.cuda.current_stream(tensor.device)
    if after is not None:
        stream.wait_event(after)
    ready = torch.cuda.Event(interprocess=True)  # interprocess events can't time; that's fine
    ready.record(stream)
    return ready


class _IpcShare:
    """The consumer count torch keeps for one share: counted down here when no consumer will."""

    def __init__(self, ref_handle: bytes, ref_offset: int, device: torch.device) -> None:
        self.ref_handle, self.ref_offset, self.device = ref_handle, ref_offset, device
        self._counted_down = False

    def count_down(self) -> None:
        if self._counted_down or not self.ref_handle:
            return
        self._counted_down = True
        try:
            torch.UntypedStorage._release_ipc_counter(self.ref_handle, self.ref_offset, device=self.device)
        except (AttributeError, RuntimeError) as err:  # a torch without it: the block stays until exit
            log.warning("cuda_ipc: could not release an unused share's counter: %s", err)

    def reclaim(self, reason: str) -> None:
        if reason in ("unused", "expired"):
            self.count_down()
        # the lease dropped the producer's last reference: free blocks whose consumers are all done
        torch.cuda.ipc_collect()


TRANSPORTS.register("cuda_ipc")(CudaIpcTransport())
