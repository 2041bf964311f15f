"""``inline`` transport: the bytes go over gRPC. Works anywhere; the fallback and the cross-host CPU path.

Up to ``TensorStore.inline_max_bytes`` the bytes ride inside the handle. Larger tensors are marked
``streamed``: the handle stays small and the consumer pulls the bytes with ``TensorStore.Fetch`` in
chunks, so no single message approaches gRPC's 4 MiB default limit.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import torch

from epd.transport.base import TRANSPORTS, Exported, ImportContext, wait_for_producer
from epd.transport.handles import LeaseExpiredError, TransportError, tensor_bytes_view
from epd.v1 import tensor_pb2, tensor_pb2_grpc

# keep every chunk well under gRPC's default 4 MiB receive limit, whatever a caller asks for
MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
MIN_CHUNK_BYTES = 4 * 1024


def iter_chunks(payload: torch.Tensor, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """What the TensorStore.Fetch servicer streams for one lease."""
    chunk_bytes = min(max(chunk_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
    data = tensor_bytes_view(payload)
    for offset in range(0, len(data), chunk_bytes):
        yield tensor_pb2.TensorChunk(offset_bytes=offset, data=bytes(data[offset:offset + chunk_bytes]))


class InlineTransport:
    name = "inline"
    same_host_only = False

    def export(self, store, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle, ready_event=None) -> Exported:
        # a CPU contiguous tensor is kept as is (no copy): don't modify an exported tensor in place
        wait_for_producer(tensor, ready_event)
        tensor = tensor.to("cpu").contiguous()
        if handle.nbytes <= store.inline_max_bytes:
            handle.inline.data = bytes(tensor_bytes_view(tensor))
            return Exported(payload=None)
        if not store.address:
            raise TransportError(
                f"tensor of {handle.nbytes} bytes exceeds inline_max_bytes={store.inline_max_bytes} and must be "
                "streamed, but this TensorStore has no address; set TensorStore.address to where it serves gRPC")
        handle.inline.streamed = True
        handle.inline.fetch_address = store.address
        return Exported(payload=tensor)

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        body = handle.inline
        if body.streamed:
            buffer = _fetch(handle, ctx)
        else:
            if len(body.data) != handle.nbytes:
                raise TransportError(f"lease {handle.lease_id}: inline body holds {len(body.data)} bytes, "
                                     f"{handle.dtype}{list(shape)} needs {handle.nbytes}")
            buffer = bytearray(body.data)  # writable, so the tensor may be modified like any other
        if math.prod(shape) == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(buffer, dtype=dtype).view(shape)  # owns `buffer`, no further copy
        return tensor if ctx.device.type == "cpu" else tensor.to(ctx.device)


def _fetch(handle: tensor_pb2.TensorHandle, ctx: ImportContext) -> bytearray:
    address = handle.inline.fetch_address or handle.producer_address
    if not address:
        raise TransportError(f"lease {handle.lease_id}: streamed inline handle has no fetch_address")
    buffer = bytearray(handle.nbytes)
    view = memoryview(buffer)
    stub = tensor_pb2_grpc.TensorStoreStub(ctx.channel_factory(address))
    received_bytes = 0
    try:
        for chunk in stub.Fetch(tensor_pb2.FetchRequest(lease_id=handle.lease_id), timeout=ctx.timeout_s):
            end = chunk.offset_bytes + len(chunk.data)
            if chunk.offset_bytes != received_bytes or end > handle.nbytes:
                raise TransportError(
                    f"lease {handle.lease_id}: Fetch from {address} sent bytes [{chunk.offset_bytes}, {end}), "
                    f"expected the next chunk at offset {received_bytes} of {handle.nbytes}")
            view[chunk.offset_bytes:end] = chunk.data
            received_bytes = end
    except grpc.RpcError as err:
        raise rpc_error(err, handle.lease_id, address, "Fetch") from None
    if received_bytes != handle.nbytes:
        raise TransportError(f"lease {handle.lease_id}: Fetch from {address} ended after {received_bytes} "
                             f"of {handle.nbytes} bytes")
    return buffer


def rpc_error(err: grpc.RpcError, lease_id: str, address: str, rpc: str) -> TransportError:
    """Map a gRPC failure to our errors: NOT_FOUND is the producer saying the lease is gone."""
    code, details = err.code(), err.details()
    if code == grpc.StatusCode.NOT_FOUND:
        return LeaseExpiredError(details or f"lease {lease_id} expired or was released")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return TransportError(f"lease {lease_id}: producer at {address} did not answer {rpc} "
                              f"({code.name}: {details}); it may have died, and its lease can't be served")
    return TransportError(f"lease {lease_id}: {rpc} at {address} failed ({code.name}: {details})")


TRANSPORTS.register("inline")(InlineTransport())
