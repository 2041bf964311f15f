"""gRPC face of the prefill tier: translates proto <-> worker calls, nothing more."""
from __future__ import annotations

import logging

from epd.config import WorkerConfig
from epd.errors import EPDError
from epd.prefill.worker import PrefillWorker
from epd.protocol import logprobs_to_proto, prefill_job_from_proto
from epd.rpc import abort_with, remaining_s
from epd.transport import TensorStore, choose_transport, import_tensor
from epd.transport.handles import TransportError
from epd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, store: TensorStore, config: WorkerConfig, metrics) -> None:
        self.worker, self.store, self.config, self.metrics = worker, store, config, metrics

    def PushEmbeddings(self, request, context):
        accepted = 0
        for push in request.pushes:
            try:
                with self.metrics.time_import(push.embedding):
                    imported = import_tensor(push.embedding, device=self.worker.engine.config.device)
            except TransportError as err:
                self.worker.inbox.fail(push.request_id, f"item {push.item_index}: import failed: {err}")
                continue
            accepted += self.worker.push(push.request_id, push.item_index, imported.tensor, imported.release)
        return prefill_pb2.PushEmbeddingsResponse(num_accepted=accepted)

    def Prefill(self, request, context):
        try:
            ticket = self.worker.admit(prefill_job_from_proto(request.request))
        except EPDError as err:
            self.metrics.requests.labels("invalid").inc()
            abort_with(context, err)
        # the router cancelling the call (client gone, an encoder failed) aborts the request here
        cancel = lambda: self.worker.abort(ticket, "cancelled")  # noqa: E731
        if not context.add_callback(cancel):  # the call already ended
            cancel()
        yield prefill_pb2.PrefillReply(accepted=prefill_pb2.PrefillAccepted())
        try:
            result = self.worker.wait(ticket, remaining_s(context, self.config.request_timeout_s))
        except EPDError as err:
            self.metrics.requests.labels("error").inc()
            abort_with(context, err)
        out = common_pb2.PrefillResult(
            first_token_id=result.first_token_id, mrope_delta=result.mrope_delta,
            num_cached_tokens=result.num_cached_tokens, finish_reason=result.finish_reason or "")
        if result.first_logprobs is not None:
            out.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
        if result.kv is not None:
            transport = choose_transport(result.kv.device.type, same_host=True,
                                         override=request.kv_transport or self.config.transport or None)
            with self.metrics.time_transfer(transport, "export", result.kv.nbytes):
                out.kv.CopyFrom(self.store.export(result.kv, transport=transport, ttl_s=self.config.lease_ttl_s))
            if not context.is_active():  # cancelled meanwhile: nobody will take or release it
                self.store.release([out.kv.lease_id])
                return
        self.metrics.requests.labels("ok").inc()
        yield prefill_pb2.PrefillReply(result=out)

    def Health(self, request, context):
        sched = self.worker.engine.scheduler
        return common_pb2.HealthResponse(status="SERVING", tier="prefill", model=self.config.model,
                                         num_running=len(sched.running), num_waiting=len(sched.waiting),
                                         kv_usage=self.worker.engine.block_manager.usage)


def build(ctx):
    """The prefill tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.presets import resolve_model

    config = ctx.config
    worker = PrefillWorker(resolve_model(config.model), config.engine,
                           overlap_with_encode=config.overlap_prefill_with_encode)
    ctx.metrics.watch_engine(worker.engine)
    servicer = PrefillServicer(worker, ctx.store, config, ctx.metrics)
    return lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server), worker.close
