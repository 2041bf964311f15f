"""gRPC face of the prefill tier (grpc.aio): translates proto <-> worker calls, nothing more.

A request waits for its first token in a coroutine, not a thread, so pushes and health are
answered however many requests wait for their rows."""
from __future__ import annotations

import functools
import logging

from epd.engine.async_updates import AsyncUpdates
from epd.errors import IMPORT_FAILED_MARKER, EPDError, InvalidRequest
from epd.prefill.worker import PrefillResult, PrefillWorker
from epd.transport import choose_transport, import_tensor
from epd.transport.choose import is_same_host
from epd.transport.handles import TransportError
from epd.transport.shm import shared_empty
from epd.transport.store import reads_store, use_store
from epd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from epd.wire.protocol import logprobs_to_proto, prefill_job_from_proto
from epd.wire.rpc import abort_with_async, remaining_s

log = logging.getLogger("epd.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, ctx) -> None:
        self.worker, self.ctx = worker, ctx
        self.store, self.config, self.metrics = ctx.store, ctx.config, ctx.metrics
        self.store_reads = ctx.metrics.store_reads()

    async def PushEmbeddings(self, request, context):
        return await self.ctx.blocking(lambda: self._accept(request))

    def _accept(self, request) -> prefill_pb2.PushEmbeddingsResponse:
        """On an io thread: importing may wait on the network (a producer on another host). A push
        for a request not held here is not imported at all (nothing of a stranger's is fetched or
        mapped): its lease goes back to the producer in the answer."""
        accepted, refused = 0, []
        for push in request.pushes:
            if not self.worker.inbox.holds(push.request_id):
                refused.append(push.embedding.lease_id)
                continue
            try:
                with self.metrics.time_import(push.embedding):
                    imported = import_tensor(push.embedding, device=self.worker.engine.config.target_device)
            except TransportError as err:
                self.worker.inbox.fail(push.request_id, f"{IMPORT_FAILED_MARKER} {push.item_index}: {err}")
                continue
            # released from the engine thread when the request is done: without waiting for the encoder
            accepted += self.worker.push(push.request_id, push.item_index, imported.tensor, imported.release_soon)
        return prefill_pb2.PushEmbeddingsResponse(num_accepted=accepted, refused_lease_ids=refused)

    def _read_stored(self, request_id: str, stored) -> list[int]:
        """On an io thread: each ``store`` handle's rows, read from the store into the request;
        -> the items that could not be (gone from the store, damaged, the store down), which the
        router then has encoded and pushed."""
        misses = []
        for push in stored:
            if push.embedding.WhichOneof("body") != "store" or push.request_id not in ("", request_id):
                raise InvalidRequest(f"request {request_id}: stored item {push.item_index} is not a store handle of "
                                     f"this request (got {push.embedding.WhichOneof('body')} for "
                                     f"{push.request_id!r})")
            try:
                with self.metrics.time_import(push.embedding):
                    imported = import_tensor(push.embedding, device=self.worker.engine.config.target_device)
            except TransportError as err:
                log.info("request %s: item %d not read from the encoder cache store (%s); the router has it pushed",
                         request_id, push.item_index, err)
                self.store_reads.labels("missed").inc()
                misses.append(push.item_index)
                continue
            self.store_reads.labels("read").inc()
            self.worker.push(request_id, push.item_index, imported.tensor, None)
        return misses

    async def Prefill(self, request, context):
        try:
            job = prefill_job_from_proto(request.request)
            with self.ctx.admission.hold(self.worker.embedding_bytes(job)):
                await self._prefill(job, request, context)
        except EPDError as err:
            self.metrics.count_failure(err)
            await abort_with_async(context, err)

    async def _prefill(self, job, request, context) -> None:
        await self.ctx.warm_grammar(self.worker.engine, job.sampling)
        ticket = self.worker.admit(job, AsyncUpdates())
        try:
            await context.write(prefill_pb2.PrefillReply(accepted=prefill_pb2.PrefillAccepted()))
            if request.stored:  # rows read from the cluster's store here, while the encoders push the rest
                misses = await self.ctx.blocking(lambda: self._read_stored(job.request_id, request.stored))
                if misses:
                    await context.write(prefill_pb2.PrefillReply(
                        store_misses=prefill_pb2.StoreMisses(item_indices=misses)))
        except BaseException:  # the router left before it heard: nobody will wait for the result
            self.worker.drop(ticket)
            raise
        # a router cancelling the call (client gone, an encoder failed) cancels this wait: it aborts
        result = await self.worker.wait_async(ticket, remaining_s(context, self.config.request_timeout_s))
        out = common_pb2.PrefillResult(
            first_token_id=result.first_token_id, mrope_delta=result.mrope_delta,
            num_cached_tokens=result.num_cached_tokens, finish_reason=result.finish_reason or "")
        if result.first_logprobs is not None:
            out.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
        if result.kv is not None:
            out.kv.CopyFrom(await self.ctx.blocking(lambda: self._export_kv(result, request),
                                                    undo=lambda handle: self.store.release([handle.lease_id])))
        try:
            await context.write(prefill_pb2.PrefillReply(result=out))
        except BaseException:  # cancelled meanwhile: nobody will take or release the KV
            self.store.release([out.kv.lease_id])
            raise
        self.metrics.requests.labels("ok").inc()

    def _export_kv(self, result: PrefillResult, request):
        """On an io thread: a lease on the KV's memory (copied out of the cache into the store's
        shared memory, or on the GPU for CUDA IPC); a copy only for inline."""
        transport = choose_transport(result.kv.device.type,
                                     is_same_host(self.ctx.host_id, request.kv_consumer_host_id),
                                     override=request.kv_transport or self.config.transport or None)
        with self.metrics.time_transfer(transport, "export", result.kv.nbytes):
            # the router's key: a router that gives the call up with this result in flight frees it
            return self.store.export(result.kv, transport=transport, ttl_s=self.config.lease_ttl_s,
                                     ready_event=result.kv_ready, consumer_hint=request.kv_release_key or None)

    async def Health(self, request, context):
        engine = self.worker.engine
        computable, waiting, on_inputs = self.worker.load()  # a request waiting for its rows is waiting, not running
        return self.ctx.health(num_running=computable, num_waiting=waiting, kv_usage=engine.block_manager.usage,
                               num_steps=engine.num_steps, busy_seconds=engine.busy.now(),
                               max_model_len=self.worker.max_model_len, reads_encoder_store=reads_store(),
                               num_waiting_on_inputs=on_inputs)


def build(ctx):
    """The prefill tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.locate import resolve_model

    config = ctx.config
    worker = PrefillWorker(resolve_model(config.model), config.engine,
                           overlap_with_encode=config.overlap_prefill_with_encode, allocate_kv=functools.partial(shared_empty, ctx.store),
                           on_engine_lost=ctx.on_engine_lost)
    ctx.metrics.watch_engine(worker.engine)
    servicer = PrefillServicer(worker, ctx)
    backend = store_reader_for(ctx.config)
    use_store(backend)

    def close() -> None:
        worker.close()
        if backend is not None:
            use_store(None)
            backend.close()
    return lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server), close


def store_reader_for(config):
    """The cluster's encoder cache store, for reading rows from it (``store`` handles), when the
    encoders of this cluster share one (``encoder_cache_store: mooncake`` with its master known);
    else None (a router then sends this worker no such handle)."""
    encoder = config.encoder
    if encoder.encoder_cache_store == "local" or encoder.mooncake_master is None:
        return None
    from epd.transport.mooncake import MooncakeBackend

    return MooncakeBackend(encoder.mooncake_master, host=config.host, metadata_server=encoder.mooncake_metadata_server,
                           protocol=encoder.mooncake_protocol, device_names=encoder.mooncake_device_names)
