"""The gRPC TensorStore service: translates proto <-> store calls, nothing more."""
from __future__ import annotations

from concurrent import futures

import grpc

from epd.errors import InvalidRequest
from epd.transport.handles import TransportError
from epd.transport.inline import iter_chunks
from epd.transport.leases import MAX_CONSUMER_KEYS, MIN_CONSUMER_KEY_CHARS, TensorStore
from epd.transport.nccl import nccl_unique_id
from epd.v1 import tensor_pb2, tensor_pb2_grpc
from epd.wire.rpc import SERVER_OPTIONS, abort_with, add_port


class TensorStoreServicer(tensor_pb2_grpc.TensorStoreServicer):
    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def Release(self, request, context):
        if len(request.consumer_keys) > MAX_CONSUMER_KEYS:
            abort_with(context, InvalidRequest(f"Release: at most {MAX_CONSUMER_KEYS} consumer_keys per call, got "
                                               f"{len(request.consumer_keys)}", param="consumer_keys"))
        released = self.store.release(request.lease_ids)
        for key in request.consumer_keys:
            if len(key) >= MIN_CONSUMER_KEY_CHARS:  # a short key could be guessed: someone else's leases
                released += self.store.release_consumer(key)
        return tensor_pb2.ReleaseResponse(num_released=released)

    def Renew(self, request, context):
        try:
            expires_s = self.store.renew(request.lease_ids, request.ttl_ms / 1000)
        except ValueError as err:
            abort_with(context, InvalidRequest(f"Renew: {err}", param="ttl_ms"))
        return tensor_pb2.RenewResponse(expires_unix_ms=[_unix_ms(when_s) for when_s in expires_s])

    def Fetch(self, request, context):
        try:
            payload = self.store.payload(request.lease_id)
        except TransportError as err:
            _abort(context, err)
        yield from iter_chunks(payload, request.chunk_bytes or self.store.fetch_chunk_bytes)

    def NcclUniqueId(self, request, context):
        try:
            return nccl_unique_id(self.store, request.transfer_id, request.consumer_id, request.communicator_id)
        except TransportError as err:
            _abort(context, err)


def _abort(context: grpc.ServicerContext, err: TransportError) -> None:
    abort_with(context, err)  # a lease that is gone is NOT_FOUND: the consumer turns it back into LeaseExpiredError


def _unix_ms(when_s: float | None) -> int:
    return 0 if when_s is None else int(when_s * 1000)  # 0: the lease is not open any more


def add_tensor_store(server: grpc.Server, store: TensorStore) -> TensorStoreServicer:
    servicer = TensorStoreServicer(store)
    tensor_pb2_grpc.add_TensorStoreServicer_to_server(servicer, server)
    return servicer


def serve_tensor_store(store: TensorStore, host: str = "127.0.0.1", port: int = 0,
                       max_workers: int = 8, tls=None) -> grpc.Server:
    """Start a server for ``store`` alone (tests, benchmarks, a bare producer) and set ``store.address``.
    Tiers instead call ``add_tensor_store`` on the server they already run. Stop it with ``server.stop(0)``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS)
    add_tensor_store(server, store)
    bound_port = add_port(server, f"{host}:{port}", tls)
    if bound_port == 0:
        raise TransportError(f"could not bind a TensorStore server to {host}:{port}")
    store.address = f"{host}:{bound_port}"
    server.start()
    return server
