"""Tensor handles: a tensor that lives in another process, described in protobuf and moved by a
transport (inline, shm, cuda_ipc, nccl) under a lease the producer keeps until release, or until
its TTL passes without the consumer renewing it (``LeaseRenewer``); a ``store`` handle names an
entry of the cluster's encoder cache store instead (no lease: the store keeps it)."""
from __future__ import annotations

from epd.shm_owners import cleanup_stale_segments

# importing the transport modules registers them
from epd.transport import cuda_ipc, inline, nccl, shm, store  # noqa: F401
from epd.transport.base import TRANSPORTS, Transport, ready_event_after_writes
from epd.transport.channels import close_all, get_channel
from epd.transport.choose import choose_transport
from epd.transport.consumer import ImportedTensor, LeaseRenewer, import_tensor, lease_renewer, release_leases
from epd.transport.handles import LeaseExpiredError, TransportError, dtype_from_str, dtype_to_str
from epd.transport.leases import TensorStore
from epd.transport.server import TensorStoreServicer, add_tensor_store, serve_tensor_store

__all__ = [
    "TRANSPORTS", "Transport", "TensorStore", "ImportedTensor", "import_tensor", "release_leases",
    "LeaseRenewer", "lease_renewer",
    "TensorStoreServicer", "add_tensor_store", "serve_tensor_store", "choose_transport",
    "cleanup_stale_segments", "get_channel", "close_all", "TransportError", "LeaseExpiredError",
    "dtype_to_str", "dtype_from_str", "ready_event_after_writes",
]
