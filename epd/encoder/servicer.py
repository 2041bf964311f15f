"""gRPC face of the encoder tier: runs items through the EncoderEngine, exports each item's rows
as a tensor handle and pushes the handles straight to the request's prefill worker."""
from __future__ import annotations

import json
import logging
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from epd.config import WorkerConfig
from epd.encoder.engine import EncoderEngine
from epd.encoder.item_scheduler import EncoderItem
from epd.errors import Cancelled, DeadlineExceeded, InvalidRequest, UpstreamError, as_epd_error
from epd.multimodal.hashing import hash_processor_kwargs
from epd.rpc import abort_with, remaining_s
from epd.transport import TensorStore, choose_transport, get_channel
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, engine: EncoderEngine, store: TensorStore, config: WorkerConfig, metrics) -> None:
        self.engine, self.store, self.config, self.metrics = engine, store, config, metrics

    def Encode(self, request, context):
        request_id = request.request_id
        try:
            future = self.engine.submit(request_id, [_item(msg) for msg in request.items])
        except ValueError as err:  # can never be encoded under this worker's budgets, or malformed items
            self.metrics.requests.labels("invalid").inc()
            abort_with(context, InvalidRequest(f"request {request_id}: {err}"))
        # the router cancelling the call frees the request's place in the queue and its pins
        context.add_callback(lambda: self.engine.release(request_id))
        try:
            result = future.result(timeout=remaining_s(context, self.config.request_timeout_s))
        except FutureTimeout:
            abort_with(context, DeadlineExceeded(f"request {request_id}: not encoded in time"))
        except CancelledError:
            abort_with(context, Cancelled(f"request {request_id}: cancelled"))
        except Exception as err:  # noqa: BLE001 - the request's failure, told to the router by its code
            self.metrics.requests.labels("error").inc()
            abort_with(context, as_epd_error(err))
        try:
            pushes = [self._export(request, msg.item_index, rows) for msg, rows in zip(request.items, result.embeddings)]
        finally:
            self.engine.release(request_id)  # rows are copied into the handles' storage
        self._push(request, pushes, context)
        self.metrics.requests.labels("ok").inc()
        self.metrics.encoded_tokens.inc(sum(m.encoder_tokens for m, hit in zip(request.items, result.cache_hits)
                                            if not hit))
        return encoder_pb2.EncodeResponse(item_indices=[m.item_index for m in request.items],
                                          cache_hits=result.cache_hits)

    def _export(self, request, item_index: int, rows) -> common_pb2.EmbeddingPush:
        transport = choose_transport(rows.device.type, same_host=True,
                                     override=request.transport or self.config.transport or None)
        with self.metrics.time_transfer(transport, "export", rows.nbytes):
            handle = self.store.export(rows, transport=transport, ttl_s=self.config.lease_ttl_s)
        return common_pb2.EmbeddingPush(request_id=request.request_id, item_index=item_index, embedding=handle)

    def _push(self, request, pushes, context) -> None:
        stub = prefill_pb2_grpc.PrefillStub(get_channel(request.prefill_address))
        try:
            stub.PushEmbeddings(prefill_pb2.PushEmbeddingsRequest(pushes=pushes),
                                timeout=remaining_s(context, self.config.request_timeout_s))
        except grpc.RpcError as err:
            self.store.release([p.embedding.lease_id for p in pushes])
            abort_with(context, UpstreamError(f"request {request.request_id}: pushing to prefill at "
                                              f"{request.prefill_address} failed: {err.details()}"))

    def Health(self, request, context):
        stats = self.engine.stats()
        return common_pb2.HealthResponse(status="SERVING", tier="encoder", model=self.config.model,
                                         num_running=stats.num_held_requests, num_waiting=stats.num_waiting_requests,
                                         num_encoder_forwards=stats.num_forwards,
                                         num_encoded_items=stats.num_encoded_items)


def _item(msg: common_pb2.MultimodalItem) -> EncoderItem:
    kwargs = json.loads(msg.processor_kwargs_json) if msg.processor_kwargs_json else None
    return EncoderItem(data=msg.data, content_hash=msg.content_hash,
                       processor_kwargs_hash=hash_processor_kwargs(kwargs),
                       expected_rows=msg.expected_rows, encoder_tokens=msg.encoder_tokens)


def build(ctx):
    """The encoder tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.presets import resolve_model

    engine = EncoderEngine.from_model_dir(resolve_model(ctx.config.model), ctx.config.encoder)
    ctx.metrics.watch_encoder(engine)
    servicer = EncoderServicer(engine, ctx.store, ctx.config, ctx.metrics)
    return lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server), engine.close
