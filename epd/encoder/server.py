"""gRPC face of the encoder tier: runs items through the EncoderEngine, exports each item's rows
as a tensor handle and pushes the handles straight to the request's prefill worker."""
from __future__ import annotations

import json
import logging
import time

import grpc

from epd.config import WorkerConfig, from_dict
from epd.encoder.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.encoder.item_scheduler import EncoderItem
from epd.multimodal.hashing import hash_processor_kwargs
from epd.tier_metrics import TierMetrics
from epd.serving import RunningTier, bind_server, run_tier_main, start_tier
from epd.transport import TensorStore, add_tensor_store, choose_transport, cleanup_stale_segments, get_channel
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, engine: EncoderEngine, store: TensorStore, config: WorkerConfig, metrics: TierMetrics) -> None:
        self.engine, self.store, self.config, self.metrics = engine, store, config, metrics

    def Encode(self, request, context):
        try:
            items = [_item(msg) for msg in request.items]
            result = self.engine.submit(request.request_id, items).result(timeout=self.config.request_timeout_s)
        except Exception as err:  # noqa: BLE001 - tell prefill first so it does not wait out its timeout
            self._push_errors(request, f"{type(err).__name__}: {err}")
            self.metrics.requests.labels("error").inc()
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(err, ValueError) else grpc.StatusCode.INTERNAL
            context.abort(code, f"request {request.request_id}: {err}")
        try:
            pushes = [self._export(request, msg.item_index, rows) for msg, rows in zip(request.items, result.embeddings)]
        finally:
            self.engine.release(request.request_id)  # rows are copied into the handles' storage
        self._push(request, pushes, context)
        self.metrics.requests.labels("ok").inc()
        self.metrics.encoded_tokens.inc(sum(m.encoder_tokens for m, hit in zip(request.items, result.cache_hits)
                                            if not hit))
        return encoder_pb2.EncodeResponse(item_indices=[m.item_index for m in request.items],
                                          cache_hits=result.cache_hits)

    def _export(self, request, item_index: int, rows) -> common_pb2.EmbeddingPush:
        transport = choose_transport(rows.device.type, same_host=True,
                                     override=request.transport or self.config.transport or None)
        start = time.perf_counter()
        handle = self.store.export(rows, transport=transport, ttl_s=self.config.lease_ttl_s)
        self.metrics.observe_transfer(transport, "export", handle.nbytes, time.perf_counter() - start)
        return common_pb2.EmbeddingPush(request_id=request.request_id, item_index=item_index, embedding=handle)

    def _push(self, request, pushes, context) -> None:
        stub = prefill_pb2_grpc.PrefillStub(get_channel(request.prefill_address))
        try:
            stub.PushEmbeddings(prefill_pb2.PushEmbeddingsRequest(pushes=pushes), timeout=self.config.request_timeout_s)
        except grpc.RpcError as err:
            self.store.release([p.embedding.lease_id for p in pushes])
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"request {request.request_id}: prefill at {request.prefill_address}: {err.details()}")

    def _push_errors(self, request, error: str) -> None:
        pushes = [common_pb2.EmbeddingPush(request_id=request.request_id, item_index=m.item_index, error=error)
                  for m in request.items]
        try:
            prefill_pb2_grpc.PrefillStub(get_channel(request.prefill_address)).PushEmbeddings(
                prefill_pb2.PushEmbeddingsRequest(pushes=pushes), timeout=10)
        except grpc.RpcError:
            log.warning("could not tell prefill %s that request %s failed", request.prefill_address,
                        request.request_id)

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


def start(config: WorkerConfig) -> RunningTier:
    from epd.models.presets import resolve_model
    cleanup_stale_segments()  # a restarted producer reclaims what its previous life left behind
    engine = EncoderEngine.from_model_dir(resolve_model(config.model), from_dict(EncoderConfig, config.encoder))
    server, address = bind_server(config)
    store = TensorStore(address=address)
    store.start_sweeper()
    metrics = TierMetrics("encoder")
    metrics.watch_encoder(engine)
    metrics.watch_store(store)
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(engine, store, config, metrics), server)
    add_tensor_store(server, store)
    return start_tier("encoder", config, server, address, lambda: (engine.close(), store.close()), metrics)


def main(argv: list[str] | None = None) -> None:
    run_tier_main("encoder", start, argv)


if __name__ == "__main__":
    main()
