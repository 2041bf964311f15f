"""gRPC face of the decode tier: imports the KV handle the router passes on from prefill, then
streams the tokens after the first as the engine produces them."""
from __future__ import annotations

import contextlib
import logging
import queue
from concurrent.futures import TimeoutError as FutureTimeout

from epd.config import WorkerConfig
from epd.decode.worker import DecodeWorker
from epd.errors import DeadlineExceeded, InvalidRequest, UpstreamError
from epd.protocol import decode_job_from_proto, logprobs_to_proto
from epd.rpc import abort_with, remaining_s
from epd.transport import import_tensor
from epd.transport.handles import TransportError
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("epd.decode")
_LATE_ADD_WAIT_S = 10.0  # a request the loop has not queued yet: how long to wait to take it out again


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, config: WorkerConfig, metrics) -> None:
        self.worker, self.config, self.metrics = worker, config, metrics

    def Generate(self, request, context):
        job = decode_job_from_proto(request.request, request.prefill)
        timeout_s = remaining_s(context, self.config.request_timeout_s)
        try:
            with self.metrics.time_import(request.prefill.kv):
                imported = import_tensor(request.prefill.kv, device=self.worker.engine.config.device,
                                         timeout_s=timeout_s)
        except TransportError as err:
            abort_with(context, UpstreamError(f"request {job.request_id}: KV import failed: {err}"))
        added, updates = self.worker.start(job, imported.tensor)
        state = {"seq": None, "kv_written": False}
        try:
            try:
                state["seq"] = added.result(timeout_s)
            except FutureTimeout:  # the loop did not take it in time; once it does, the finally takes it out
                with contextlib.suppress(Exception):
                    state["seq"] = added.result(_LATE_ADD_WAIT_S)
                abort_with(context, DeadlineExceeded(f"request {job.request_id}: not admitted in time"))
            except ValueError as err:  # the request can never fit this worker's cache, or a KV of another shape
                abort_with(context, InvalidRequest(f"request {job.request_id}: {err}"))
            # the router cancelling the call (client gone) aborts the request here
            cancel = lambda: self.worker.abort(state["seq"])  # noqa: E731
            if not context.add_callback(cancel):  # the call already ended
                cancel()
            yield from self._stream(job.request_id, updates, context, imported, state)
        finally:
            if state["seq"] is not None and not state["kv_written"]:
                # still queued for admission, it would copy the KV in later: take it out first
                self.worker.abort_and_wait(state["seq"])
            imported.release()  # idempotent; the KV lives in our cache once the first update came

    def _stream(self, request_id: str, updates: queue.SimpleQueue, context, imported, state: dict):
        while True:
            timeout_s = remaining_s(context, self.config.request_timeout_s)
            try:
                update = updates.get(timeout=timeout_s)
            except queue.Empty:
                abort_with(context, DeadlineExceeded(f"request {request_id}: no token for {timeout_s:.0f} s"))
            state["kv_written"] = True  # the first update comes after the step that copied the KV in
            if update.error:
                abort_with(context, UpstreamError(f"request {request_id}: {update.error}"))
            yield decode_pb2.TokenChunk(token_ids=update.token_ids, finish_reason=update.finish_reason or "",
                                        logprobs=[logprobs_to_proto(lp) for lp in update.logprobs])
            imported.release()  # after the chunk went out: the producer's Release RPC is off the token path
            if update.is_last:
                self.metrics.requests.labels(update.finish_reason or "ok").inc()
                return

    def Health(self, request, context):
        sched = self.worker.engine.scheduler
        return common_pb2.HealthResponse(status="SERVING", tier="decode", model=self.config.model,
                                         num_running=len(sched.running),
                                         num_waiting=len(sched.waiting) + len(sched.importing),
                                         kv_usage=self.worker.engine.block_manager.usage)


def build(ctx):
    """The decode tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.presets import resolve_model

    worker = DecodeWorker(resolve_model(ctx.config.model), ctx.config.engine)
    ctx.metrics.watch_engine(worker.engine)
    servicer = DecodeServicer(worker, ctx.config, ctx.metrics)
    return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server), worker.close
