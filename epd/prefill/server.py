"""gRPC face of the prefill tier: translates proto <-> worker calls, nothing more."""
from __future__ import annotations

import logging

import grpc

from epd.config import WorkerConfig
from epd.prefill.worker import PrefillError, PrefillWorker
from epd.protocol import logprobs_to_proto
from epd.serving import bind_server, configure_logging, run_until_signalled
from epd.transport import TensorStore, add_tensor_store, choose_transport, cleanup_stale_segments, import_tensor
from epd.transport.handles import TransportError
from epd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("epd.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, store: TensorStore, config: WorkerConfig) -> None:
        self.worker, self.store, self.config = worker, store, config

    def PushEmbeddings(self, request, context):
        accepted = 0
        for push in request.pushes:
            if push.error:
                self.worker.inbox.push(push.request_id, push.item_index, None, push.error)
                continue
            try:
                imported = import_tensor(push.embedding, device=self.worker.engine.config.device)
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
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {meta.request_id}: {err}")
        transport = choose_transport(result.kv.device.type, same_host=True, override=request.kv_transport or
                                     self.config.transport or None)
        handle = self.store.export(result.kv, transport=transport, ttl_s=self.config.lease_ttl_s)
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


def main(argv: list[str] | None = None) -> None:
    from epd.tier_cli import worker_config_from_args
    configure_logging()
    config = worker_config_from_args("prefill", argv)
    cleanup_stale_segments()  # a restarted producer reclaims what its previous life left behind
    from epd.models.presets import resolve_model
    worker = PrefillWorker(resolve_model(config.model), config.engine,
                           overlap_with_encode=config.overlap_prefill_with_encode)

    server, address = bind_server(config)
    store = TensorStore(address=address)
    store.start_sweeper()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, store, config), server)
    add_tensor_store(server, store)
    server.start()
    run_until_signalled("prefill", address, server, lambda: (worker.close(), store.close()))


if __name__ == "__main__":
    main()
