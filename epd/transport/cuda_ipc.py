"""``cuda_ipc`` transport: same host, GPU. The consumer maps the producer's device memory; no copy.

Producer: ``storage._share_cuda_()`` yields the CUDA IPC memory handle of the allocation that holds
the tensor (plus torch's IPC reference counter, which keeps that allocation out of the caching
allocator's reuse until every consumer has dropped it). We also record an interprocess CUDA event
on the producing stream: the kernels that write the tensor may still be running when the handle
is sent.

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

import torch

from epd.transport.base import TRANSPORTS, Exported, ImportContext
from epd.transport.handles import TransportError
from epd.transport.leases import find_local_export
from epd.v1 import tensor_pb2


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

    def export(self, store, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle) -> Exported:
        if not tensor.is_cuda:
            raise TransportError(f"cuda_ipc exports CUDA tensors; got one on {tensor.device} (use shm or inline)")
        tensor = tensor.contiguous()
        stream = torch.cuda.current_stream(tensor.device)
        ready = torch.cuda.Event(interprocess=True)  # interprocess events can't time; that's fine
        ready.record(stream)
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
        return Exported(payload=tensor, keepalive=(ready,))

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


TRANSPORTS.register("cuda_ipc")(CudaIpcTransport())
