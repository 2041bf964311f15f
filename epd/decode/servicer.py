"""gRPC face of the decode tier (grpc.aio): imports the KV handle the router passes on from
prefill, then streams the tokens after the first as the engine produces them. A stream costs a
coroutine, not a thread; the router cancelling the call at any moment (client gone) cancels that
coroutine, and the request is aborted on the engine before its KV import is let go."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass

from epd.decode.worker import DecodeWorker
from epd.engine.async_updates import AsyncUpdates
from epd.errors import DeadlineExceeded, EPDError, InvalidRequest, UpstreamError
from epd.protocol import decode_job_from_proto, logprobs_to_proto
from epd.rpc import abort_with_async, remaining_s
from epd.server.admission import HeldBytes
from epd.transport import import_tensor
from epd.transport.handles import TransportError
from epd.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("epd.decode")
_LATE_ADD_WAIT_S = 10.0  # a request the loop has not queued yet: how long to wait to take it out again


@dataclass
class _Stream:
    """One Generate call's state, for its cleanup."""

    added: Future  # of the sequence, once the engine loop queued it
    imported: object  # the KV import (ImportedTensor)
    held: HeldBytes  # the import's bytes in this worker's admission, given back with the import
    kv_written: bool = False  # the first update came: the KV is in our cache, the import is free
    finished: bool = False


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, ctx) -> None:
        self.worker, self.ctx, self.config, self.metrics = worker, ctx, ctx.config, ctx.metrics

    async def Generate(self, request, context):
        try:
            job = decode_job_from_proto(request.request, request.prefill)
            with self.ctx.admission.hold(request.prefill.kv.nbytes) as held:
                await self._generate(job, request, context, held)
        except EPDError as err:
            self.metrics.count_failure(err)
            await abort_with_async(context, err)

    async def _generate(self, job, request, context, held: HeldBytes) -> None:
        timeout_s = remaining_s(context, self.config.request_timeout_s)
        imported = await self._import(job.request_id, request.prefill.kv, timeout_s)
        stream = _Stream(None, imported, held)
        try:
            stream.added, _ = self.worker.start(job, imported.tensor, updates := AsyncUpdates())
            await self._queued(job.request_id, stream.added, timeout_s)
            await self._stream(job.request_id, updates, context, stream)
        finally:
            await self._let_go(stream)

    async def _import(self, request_id: str, handle, timeout_s: float):
        def run():
            with self.metrics.time_import(handle):
                return import_tensor(handle, device=self.worker.engine.config.target_device, timeout_s=timeout_s)
        try:
            return await self.ctx.blocking(run, undo=lambda imported: imported.release_soon())
        except TransportError as err:
            raise UpstreamError(f"request {request_id}: KV import failed: {err}") from None

    @staticmethod
    async def _queued(request_id: str, added: Future, timeout_s: float) -> None:
        """Wait until the loop queued the request (its cache budget is checked there)."""
        done, _ = await asyncio.wait({asyncio.wrap_future(added)}, timeout=timeout_s)
        if not done:
            raise DeadlineExceeded(f"request {request_id}: not admitted in time")
        error = added.exception()
        if isinstance(error, ValueError):  # the request can never fit this worker's cache, or a KV of another shape
            raise InvalidRequest(f"request {request_id}: {error}")
        if error is not None:
            raise error

    async def _stream(self, request_id: str, updates: AsyncUpdates, context, stream: _Stream) -> None:
        while True:
            timeout_s = remaining_s(context, self.config.request_timeout_s)
            try:
                update = await updates.get(timeout_s)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"request {request_id}: no token for {timeout_s:.0f} s") from None
            stream.kv_written = True  # the first update comes after the step that copied the KV in
            stream.finished = update.is_last
            if update.error:
                raise UpstreamError(f"request {request_id}: {update.error}")
            await context.write(decode_pb2.TokenChunk(
                token_ids=update.token_ids, finish_reason=update.finish_reason or "",
                logprobs=[logprobs_to_proto(lp) for lp in update.logprobs]))
            self._release(stream)  # after the chunk went out: the producer's Release RPC is off the token path
            if update.is_last:
                self.metrics.requests.labels(update.finish_reason or "ok").inc()
                return

    async def _let_go(self, stream: _Stream) -> None:
        """However the call ended: a request still on the engine is aborted, and the KV import is let
        go only once the engine no longer reads it (a queued import copies it in at admission)."""
        seq = await _sequence(stream.added) if stream.added is not None and not stream.finished else None
        if seq is not None:
            aborted = self.worker.abort_soon(seq)
            if not stream.kv_written:
                await asyncio.wait({asyncio.wrap_future(aborted)}, timeout=_LATE_ADD_WAIT_S)
        self._release(stream)

    @staticmethod
    def _release(stream: _Stream) -> None:
        stream.imported.release_soon()  # idempotent; the producer is told from a background thread
        stream.held.give_back()  # a long stream no longer counts KV it does not hold

    async def Health(self, request, context):
        engine = self.worker.engine
        sched = engine.scheduler
        return self.ctx.health(num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.importing),
                               kv_usage=engine.block_manager.usage, num_steps=engine.num_steps)


async def _sequence(added: Future):
    """The sequence ``added`` resolves to (it may still be on its way: the loop runs calls between
    steps); None when it was never added."""
    if added.cancelled():
        return None
    done, _ = await asyncio.wait({asyncio.wrap_future(added)}, timeout=_LATE_ADD_WAIT_S)
    if not done or added.cancelled() or added.exception() is not None:
        return None
    return added.result()


def build(ctx):
    """The decode tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.presets import resolve_model

    worker = DecodeWorker(resolve_model(ctx.config.model), ctx.config.engine)
    ctx.metrics.watch_engine(worker.engine)
    servicer = DecodeServicer(worker, ctx)
    return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server), worker.close
