"""``store`` handles: rows a consumer reads straight from the cluster's encoder cache store.

A router that knows an item's rows are in the store (an encoder said so when it made or found them)
may hand prefill a handle naming the entry's key instead of asking an encoder to push the rows: a
repeated image then costs prefill one fetch and the encoders nothing, wherever they are. Nobody
exports such a handle and it holds no lease: the store keeps the bytes, and an entry gone since
(evicted, replaced, a store outage) or damaged is a ``TransportError`` the consumer answers by
asking for the rows the usual way.

The process that reads these handles joins the store once (``use_store``); a process that has not
refuses them.
"""
from __future__ import annotations

import threading

import torch

from epd.transport.base import TRANSPORTS, ImportContext
from epd.transport.handles import TransportError
from epd.transport.store_entries import CorruptEntry, StoreBackend, decode_entry
from epd.v1 import tensor_pb2

_backend: StoreBackend | None = None
_lock = threading.Lock()


def use_store(backend: StoreBackend | None) -> StoreBackend | None:
    """Read ``store`` handles from ``backend`` from now on (None: refuse them); -> the one before."""
    global _backend
    with _lock:
        previous, _backend = _backend, backend
    return previous


def reads_store() -> bool:
    """Whether this process can read ``store`` handles (a router asks before it sends one)."""
    joined = getattr(_backend, "joined", None)
    return _backend is not None and (joined is None or joined())


def store_handle(key: str, rows: torch.Tensor | None = None, *, dtype: str = "", shape=(),
                 nbytes: int = 0) -> tensor_pb2.TensorHandle:
    """The handle of the entry ``key``: described from ``rows`` (what the entry holds), or given."""
    if rows is not None:
        dtype, shape, nbytes = str(rows.dtype).removeprefix("torch."), tuple(rows.shape), rows.nbytes
    return tensor_pb2.TensorHandle(dtype=dtype, shape=list(shape), nbytes=nbytes,
                                   store=tensor_pb2.StoreBody(key=key))


class StoreTransport:
    name = "store"
    same_host_only = False
    exports = False  # not a --transport choice: see exporting_transports

    def export(self, store, tensor, handle, ready_event=None):
        raise TransportError("store handles name an entry an encoder put in the cluster's store; nothing "
                             "exports one")

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        backend, key = _backend, handle.store.key
        if backend is None:
            raise TransportError(f"store entry {key}: this process does not read the encoder cache store")
        try:
            blob = backend.get(key)
        except Exception as err:  # noqa: BLE001 - any store failure: the rows come the usual way
            raise TransportError(f"store entry {key}: the store failed ({type(err).__name__}: {err})") from None
        if not blob:
            raise TransportError(f"store entry {key}: not in the store (evicted or never put)")
        try:
            rows = decode_entry(blob, shape, dtype)
        except CorruptEntry as err:
            raise TransportError(f"store entry {key}: rejected ({err})") from None
        return rows if ctx.device.type == "cpu" else rows.to(ctx.device)


TRANSPORTS.register("store")(StoreTransport())
