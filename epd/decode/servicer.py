"""gRPC face of the decode tier (grpc.aio). A router opens one ``Stream`` and runs every request it
has here on it (``epd.decode.step_stream``): a start imports the KV handle prefill made and queues
the request; each engine step's tokens for all of the stream's requests go back as one message; a
cancel (or the stream's end) aborts a request on the engine before its KV import is let go. A
request costs a coroutine, not a thread, and one slow request never holds up the others."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future

from epd.decode.step_stream import StepSink, StreamRequest
from epd.decode.stream_listener import StreamListener
from epd.decode.worker import DecodeWorker
from epd.engine.engine_loop import TokenUpdate
from epd.errors import DeadlineExceeded, EPDError, InvalidRequest, UpstreamError, as_epd_error
from epd.loops import wait_for_future
from epd.tcp_link import FrameSender, frame
from epd.transport import import_tensor
from epd.transport.handles import TransportError
from epd.v1 import decode_pb2, decode_pb2_grpc
from epd.wire.protocol import decode_job_from_proto, logprobs_to_proto

log = logging.getLogger("epd.decode")
_LATE_ADD_WAIT_S = 10.0  # a request the loop has not queued yet: how long to wait to take it out again


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, ctx) -> None:
        self.worker, self.ctx, self.config, self.metrics = worker, ctx, ctx.config, ctx.metrics
        self.listener: StreamListener | None = None  # the TCP link's, once started

    async def Stream(self, commands, context):
        # a coroutine that writes, not a generator that yields: when the router goes, gRPC cancels
        # this task wherever it waits, and serve_stream's cleanup aborts what the stream still runs
        await self.serve_stream(commands, context.write)

    async def serve_stream(self, commands: AsyncIterator[decode_pb2.StreamCommand],
                           write: Callable[[decode_pb2.StepBatch], Awaitable[None]],
                           sender: FrameSender | None = None) -> bool:
        """One router's stream, on gRPC or on the TCP link (``epd.decode.stream_listener``): run
        ``commands`` until they end (the router is done: end once its requests have) or break off
        (an ``OSError``: the router is gone, abort everything), ``write`` each step's batch, or
        with a ``sender`` (a plain TCP link) send it there, from the engine thread where it can.
        -> whether the router ended it (False: it broke off)."""
        stream = _RouterStream(self, sender)
        reader = asyncio.create_task(stream.read(commands))
        try:
            while (batch := await stream.outbox.get()) is not None:
                await write(batch)
        finally:  # the router closed its side and nothing is left, or the stream is gone
            reader.cancel()
            await stream.close()
        return not stream.broken

    async def _import(self, request_id: str, handle, timeout_s: float):
        def run():
            with self.metrics.time_import(handle):
                return import_tensor(handle, device=self.worker.engine.config.target_device, timeout_s=timeout_s)
        try:
            return await self.ctx.blocking(run, undo=lambda imported: imported.release_soon())
        except TransportError as err:
            raise UpstreamError(f"request {request_id}: KV import failed: {err}") from None

    async def Health(self, request, context):
        engine = self.worker.engine
        sched = engine.scheduler
        link = {"stream_port": self.listener.port, "stream_token": self.listener.token} if self.listener else {}
        return self.ctx.health(num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.importing),
                               kv_usage=engine.block_manager.usage, num_steps=engine.num_steps,
                               busy_seconds=engine.busy.now(), max_model_len=self.worker.max_model_len, **link)


class _RouterStream:
    """The requests of one router stream and the messages going back on it (a ``DirectSteps`` when
    it has a ``sender``)."""

    def __init__(self, servicer: DecodeServicer, sender: FrameSender | None = None) -> None:
        self.s = servicer
        self.outbox: asyncio.Queue[decode_pb2.StepBatch | None] = asyncio.Queue()
        self.sender = sender
        self.sink = StepSink(asyncio.get_running_loop(), self._deliver)
        self.requests: dict[str, StreamRequest] = {}
        self.unreleased: set[str] = set()  # requests that still hold their KV import (no update yet)
        self.closing = False  # the router sent its last command: end once its requests have
        self.broken = False  # the connection broke off instead
        self._cleanups: set[asyncio.Task] = set()  # requests letting go of what they hold
        if sender is not None:
            self.sink.direct = self

    async def read(self, commands) -> None:
        try:
            async for command in commands:
                if command.HasField("start"):
                    self.sink.columns = command.token_columns
                    self._start(command.start, command.timeout_ms / 1000 or self.s.config.request_timeout_s,
                                max(command.stream_interval, 1))
                elif (state := self.requests.get(command.cancel)) is not None:
                    state.task.cancel()
        except OSError as err:  # the TCP link broke off (reset, TLS, timeout): nobody is left to read what runs
            log.info("a router's stream broke off (%s): aborting its %d request(s)", err, len(self.requests))
            self.broken = True
            self.outbox.put_nowait(None)
        finally:
            self.closing = True
            self._end_if_done()

    async def close(self) -> None:
        """The stream is gone: abort what still runs (the router lost its connection or let go),
        and wait until every request let go of what it held."""
        tasks = [state.task for state in self.requests.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _start(self, request: decode_pb2.GenerateRequest, timeout_s: float, stream_interval: int = 1) -> None:
        request_id = request.request.request_id
        if request_id in self.requests:
            self._fail(request_id, InvalidRequest(f"request {request_id} already runs on this stream"))
            return
        state = self.requests[request_id] = StreamRequest(request_id)
        self.unreleased.add(request_id)
        state.task = asyncio.create_task(self._run(state, request, timeout_s, stream_interval))

    async def _run(self, state: StreamRequest, request: decode_pb2.GenerateRequest, timeout_s: float,
                   stream_interval: int) -> None:
        deadline_s = time.monotonic() + timeout_s
        try:
            job = decode_job_from_proto(request.request, request.prefill)
            with self.s.ctx.admission.hold(request.prefill.kv.nbytes) as state.held:
                await self.s.ctx.warm_grammar(self.s.worker.engine, job.sampling)
                state.imported = await self.s._import(job.request_id, request.prefill.kv, timeout_s)
                updates = self.sink.updates_for(job.request_id, stream_interval)
                state.added, _ = self.s.worker.start(job, state.imported.tensor, updates,
                                                     kv_source=state.imported.handle)
                await _queued(job.request_id, state.added, deadline_s - time.monotonic())
                try:
                    await asyncio.wait_for(state.done.wait(), max(0.0, deadline_s - time.monotonic()))
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(f"request {job.request_id}: not done within {timeout_s:.0f} s") from None
        except EPDError as err:
            self.s.metrics.count_failure(err)
            self._fail(state.request_id, err)
        except Exception as err:  # noqa: BLE001 - a bug or a device error: this request fails, nothing waits on it
            log.exception("request %s failed", state.request_id)
            self.s.metrics.count_failure(failed := as_epd_error(err))
            self._fail(state.request_id, failed)
        finally:
            # its own task: a second cancel (the stream ending after a cancel command) must not cut
            # the abort and the releases short
            cleanup = asyncio.ensure_future(self._finish(state))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            await asyncio.shield(cleanup)

    async def _finish(self, state: StreamRequest) -> None:
        try:
            await self._let_go(state)
        finally:
            self.requests.pop(state.request_id, None)
            self.unreleased.discard(state.request_id)
            self._end_if_done()

    def send_columns(self, keys: list[str], tokens: list[int]) -> bool:
        """(engine thread) A step of plain tokens straight onto the link, unless one of its requests
        is new here (its first update lets go of its KV import, on the loop) or forgotten. The
        dictionaries are the loop's; a membership test reads them whole under the interpreter lock,
        and a request forgotten right after is one the router forgot too (it drops the token)."""
        requests, unreleased = self.requests, self.unreleased
        for key in keys:
            if key in unreleased or key not in requests:
                return False
        batch = decode_pb2.StepBatch()
        batch.token_request_ids.extend(keys)
        batch.tokens.extend(tokens)
        return self.sender.try_send(frame(batch))

    def owe(self) -> None:
        self.sender.owe()

    def _deliver(self, updates: list[tuple[str, TokenUpdate]], keys: list[str], tokens: list[int]) -> None:
        """One engine step's updates (on the event loop): one message back for all of them. The
        plain tokens (``keys[i]`` got ``tokens[i]``) go as the message's two columns, copied in one
        call each; the other updates each as a ``RequestStep``, made in place in the batch
        (``add``): a step made on its own and then put in the batch is copied there, 3x the cost at
        256 requests (0.42 against 0.13 ms a step)."""
        try:
            self._deliver_step(updates, keys, tokens)
        finally:
            if self.sender is not None:
                self.sender.paid()  # it is out (or nothing was): the engine thread may send again

    def _deliver_step(self, updates: list[tuple[str, TokenUpdate]], keys: list[str], tokens: list[int]) -> None:
        batch = decode_pb2.StepBatch()
        if keys:
            self._columns(batch, keys, tokens)
        steps = batch.requests
        for request_id, update in updates:
            state = self.requests.get(request_id)
            if state is None or state.finished:  # cancelled meanwhile: the router forgot it
                continue
            if update.error:
                steps.append(_failure(request_id, UpstreamError(f"request {request_id}: {update.error}")))
            else:
                step = steps.add()
                step.request_id = request_id
                step.token_ids.extend(update.token_ids)
                if update.finish_reason:
                    step.finish_reason = update.finish_reason
                if update.logprobs:
                    step.logprobs.extend(logprobs_to_proto(lp) for lp in update.logprobs)
            self._kv_written(state)
            if update.is_last:
                state.finished = True
                state.done.set()
                if not update.error:
                    self.s.metrics.requests.labels(update.finish_reason or "ok").inc()
        if steps or batch.token_request_ids:
            self._emit(batch)

    def _emit(self, batch: decode_pb2.StepBatch) -> None:
        """``batch`` on its way (on the loop): onto the link's sender at once, or to the writer."""
        if self.sender is None:
            self.outbox.put_nowait(batch)
            return
        try:
            self.sender.send(batch)
        except OSError as err:  # the router is gone: end the stream as a broken read would
            if not self.broken:
                if self.requests:
                    log.info("a router's stream broke off (%s): aborting its %d request(s)", err, len(self.requests))
                self.broken = True
                self.outbox.put_nowait(None)

    def _columns(self, batch: decode_pb2.StepBatch, keys: list[str], tokens: list[int]) -> None:
        """The plain tokens into ``batch``'s columns, but those of requests the router forgot."""
        requests = self.requests
        if not all(key in requests for key in keys):
            kept = [(key, token) for key, token in zip(keys, tokens) if key in requests]
            keys, tokens = [key for key, _ in kept], [token for _, token in kept]
        if self.unreleased:  # a request's first update: its KV import is free now
            for key in self.unreleased.intersection(keys):
                self._kv_written(requests[key])
        batch.token_request_ids.extend(keys)
        batch.tokens.extend(tokens)

    def _kv_written(self, state: StreamRequest) -> None:
        state.kv_written = True  # an update comes after the step that copied the KV in
        self.unreleased.discard(state.request_id)
        _release(state)  # after the tokens are on their way: the producer's Release is off the token path

    def _fail(self, request_id: str, err: EPDError) -> None:
        self._emit(decode_pb2.StepBatch(requests=[_failure(request_id, err)]))

    async def _let_go(self, state: StreamRequest) -> None:
        """However the request ended: still on the engine, it is aborted, and the KV import is let
        go only once the engine no longer reads it (a queued import copies it in at admission)."""
        seq = await _sequence(state.added) if state.added is not None and not state.finished else None
        if seq is not None:
            aborted = self.s.worker.abort_soon(seq)
            if not state.kv_written:
                await wait_for_future(aborted, _LATE_ADD_WAIT_S)
        _release(state)

    def _end_if_done(self) -> None:
        if self.closing and not self.requests:
            self.outbox.put_nowait(None)


def _failure(request_id: str, err: EPDError) -> decode_pb2.RequestStep:
    hint_s = getattr(err, "retry_after_s", None)
    return decode_pb2.RequestStep(request_id=request_id, error_status=err.grpc_status().name,
                                  error_message=err.message,
                                  retry_after_ms=round(hint_s * 1000) if hint_s is not None else 0)


def _release(state: StreamRequest) -> None:
    """The KV import let go and its bytes counted off, once: called at every step's update, so a
    request that did it already has nothing left to look at."""
    if state.imported is not None:
        state.imported.release_soon()  # the producer is told from a background thread
        state.imported = None
    if state.held is not None:
        state.held.give_back()  # a long stream no longer counts KV it does not hold
        state.held = None


async def _queued(request_id: str, added: Future, timeout_s: float) -> None:
    """Wait until the loop queued the request (its cache budget is checked there)."""
    if not await wait_for_future(added, timeout_s):
        raise DeadlineExceeded(f"request {request_id}: not admitted in time")
    error = added.exception()
    if isinstance(error, ValueError):  # the request can never fit this worker's cache, or a KV of another shape
        raise InvalidRequest(f"request {request_id}: {error}")
    if error is not None:
        raise error


async def _sequence(added: Future):
    """The sequence ``added`` resolves to (it may still be on its way: the loop runs calls between
    steps); None when it was never added."""
    if added.cancelled():
        return None
    done = await wait_for_future(added, _LATE_ADD_WAIT_S)
    if not done or added.cancelled() or added.exception() is not None:
        return None
    return added.result()


def build(ctx):
    """The decode tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.locate import resolve_model

    worker = DecodeWorker(resolve_model(ctx.config.model), ctx.config.engine, on_engine_lost=ctx.on_engine_lost)
    ctx.metrics.watch_engine(worker.engine)
    servicer = DecodeServicer(worker, ctx)
    if ctx.server is not None:  # the TCP link beside gRPC (a test's bare context has no loop to run it)
        listener = servicer.listener = StreamListener(servicer, ctx.config.host, ctx.config.stream_port, ctx.tls)
        try:
            ctx.server.run(listener.start(), 30.0)
        except BaseException:
            worker.close()
            raise
        ctx.server.also_stop(listener.stop)
    return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server), worker.close
