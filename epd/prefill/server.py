"""gRPC face of the prefill tier: translates proto <-> worker calls, nothing more."""
from __future__ import annotations

import logging
import time

import grpc

from epd.config import WorkerConfig
from epd.prefill.worker import PrefillError, PrefillWorker
from epd.protocol import logprobs_to_proto
from epd.tier_metrics import TierMetrics
from epd.serving import RunningTier, bind_server, run_tier_main, start_tier
from epd.transport import TensorStore, add_tensor_store, choose_transport, cleanup_stale_segments, import_tensor
from epd.transport.handles import TransportError
from epd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, store: TensorStore, config: WorkerConfig, metrics: TierMetrics) -> None:
        self.worker, self.store, self.config, self.metrics = worker, store, config, metrics

    def PushEmbeddings(self, request, context):
        accepted = 0
        for push in request.pushes:
            if push.error:
                self.worker.inbox.push(push.request_id, push.item_index, None, push.error)
                continue
            try:
                start = time.perf_counter()
                imported = import_tensor(push.embedding, device=self.worker.engine.config.device)
                self.metrics.observe_transfer(push.embedding.WhichOneof("body"), "import", push.embedding.nbytes,
                                              time.perf_counter() - start)
            except TransportError as err:
                self.worker.inbox.push(push.request_id, push.item_index, None, f"embedding import failed: {err}")
                continue
            self.worker.inbox.push(push.request_id, push.item_index, imported.tensor, None, imported.release)
            accepted += 1
        return prefill_pb2.PushEmbeddingsResponse(num_accepted=accepted)

    def Prefill(self, request, context):
        meta = request.request
        try:
            result = self.worker.prefill(meta, timeout_s=self.config.request_timeout_s)
        except PrefillError as err:
            self.metrics.requests.labels("error").inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except ValueError as err:
            self.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {meta.request_id}: {err}")
        transport = choose_transport(result.kv.device.type, same_host=True, override=request.kv_transport or
                                     self.config.transport or None)
        start = time.perf_counter()
        handle = self.store.export(result.kv, transport=transport, ttl_s=self.config.lease_ttl_s)
        self.metrics.observe_transfer(transport, "export", handle.nbytes, time.perf_counter() - start)
        self.metrics.requests.labels("ok").inc()
        response = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id, kv=handle, mrope_delta=result.mrope_delta,
            num_prompt_tokens=result.num_prompt_tokens, num_cached_tokens=result.num_cached_tokens,
            finish_reason=result.finish_reason or "")
        if result.first_logprobs is not None:
            response.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
        return response

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=self.worker.abort(request.request_id, request.reason or "aborted"))

    def Health(self, request, context):
        sched = self.worker.engine.scheduler
        return common_pb2.HealthResponse(status="SERVING", tier="prefill", model=self.config.model,
                                         num_running=len(sched.running), num_waiting=len(sched.waiting),
                                         kv_usage=self.worker.engine.block_manager.usage)


def start(config: WorkerConfig) -> RunningTier:
    from epd.models.presets import resolve_model
    cleanup_stale_segments()  # a restarted producer reclaims what its previous life left behind
    worker = PrefillWorker(resolve_model(config.model), config.engine,
                           overlap_with_encode=config.overlap_prefill_with_encode)
    server, address = bind_server(config)
    store = TensorStore(address=address)
    store.start_sweeper()
    metrics = TierMetrics("prefill")
    metrics.watch_engine(worker.engine)
    metrics.watch_store(store)
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, store, config, metrics), server)
    add_tensor_store(server, store)
    return start_tier("prefill", config, server, address, lambda: (worker.close(), store.close()), metrics)


def main(argv: list[str] | None = None) -> None:
    run_tier_main("prefill", start, argv)


if __name__ == "__main__":
    main()
