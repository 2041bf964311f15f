"""gRPC face of the decode tier: asks prefill for the first token and the KV handle, imports the
KV, then streams tokens as the engine produces them."""
from __future__ import annotations

import logging
import queue
import time

import grpc

from epd.config import WorkerConfig
from epd.decode.worker import DecodeError, DecodeWorker
from epd.protocol import logprobs_from_proto, logprobs_to_proto, sampling_from_proto
from epd.tier_metrics import TierMetrics
from epd.serving import RunningTier, bind_server, run_tier_main, start_tier
from epd.transport import get_channel, import_tensor
from epd.transport.handles import TransportError
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.decode")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, config: WorkerConfig, metrics: TierMetrics) -> None:
        self.worker, self.config, self.metrics = worker, config, metrics

    def Generate(self, request, context):
        meta = request.request
        first = self._prefill(request, context)
        head = decode_pb2.TokenChunk(token_ids=[first.first_token_id], num_prompt_tokens=first.num_prompt_tokens,
                                     num_cached_tokens=first.num_cached_tokens, finish_reason=first.finish_reason)
        if first.HasField("first_logprobs"):
            head.logprobs.append(first.first_logprobs)
        yield head
        if first.finish_reason:
            return
        seq, updates = self._admit(meta, first, context)
        context.add_callback(lambda: self.worker.loop.abort(seq, reason="cancelled"))
        while True:
            try:
                update = updates.get(timeout=self.config.request_timeout_s)
            except queue.Empty:
                self.worker.loop.abort(seq, reason="timeout")
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {meta.request_id}: no token for {self.config.request_timeout_s:.0f} s")
            if update.error:
                context.abort(grpc.StatusCode.INTERNAL, f"request {meta.request_id}: {update.error}")
            yield decode_pb2.TokenChunk(token_ids=update.token_ids, finish_reason=update.finish_reason or "",
                                        logprobs=[logprobs_to_proto(lp) for lp in update.logprobs])
            if update.is_last:
                self.metrics.requests.labels(update.finish_reason or "ok").inc()
                return

    def _prefill(self, request, context) -> prefill_pb2.PrefillResponse:
        stub = prefill_pb2_grpc.PrefillStub(get_channel(request.prefill_address))
        try:
            return stub.Prefill(prefill_pb2.PrefillRequest(request=request.request, kv_transport=request.kv_transport),
                                timeout=self.config.request_timeout_s)
        except grpc.RpcError as err:
            context.abort(err.code(), f"prefill at {request.prefill_address}: {err.details()}")

    def _admit(self, meta, first: prefill_pb2.PrefillResponse, context):
        try:
            start = time.perf_counter()
            imported = import_tensor(first.kv, device=self.worker.engine.config.device)
            self.metrics.observe_transfer(first.kv.WhichOneof("body"), "import", first.kv.nbytes,
                                          time.perf_counter() - start)
        except TransportError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {meta.request_id}: KV import failed: {err}")
        try:
            first_lp = logprobs_from_proto(first.first_logprobs) if first.HasField("first_logprobs") else None
            return self.worker.start(meta.request_id, list(meta.token_ids), first.first_token_id, first_lp,
                                     imported.tensor, first.mrope_delta, sampling_from_proto(meta.sampling),
                                     tuple(meta.eos_token_ids), self.config.request_timeout_s)
        except (DecodeError, ValueError) as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        finally:
            imported.release()  # the KV now lives in our paged cache

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def Health(self, request, context):
        sched = self.worker.engine.scheduler
        return common_pb2.HealthResponse(status="SERVING", tier="decode", model=self.config.model,
                                         num_running=len(sched.running), num_waiting=len(sched.waiting),
                                         kv_usage=self.worker.engine.block_manager.usage)


def start(config: WorkerConfig) -> RunningTier:
    from epd.models.presets import resolve_model
    worker = DecodeWorker(resolve_model(config.model), config.engine)
    server, address = bind_server(config)
    metrics = TierMetrics("decode")
    metrics.watch_engine(worker.engine)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker, config, metrics), server)
    return start_tier("decode", config, server, address, worker.close, metrics)


def main(argv: list[str] | None = None) -> None:
    run_tier_main("decode", start, argv)


if __name__ == "__main__":
    main()
