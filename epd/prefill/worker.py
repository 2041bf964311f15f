"""The prefill worker: no vision tower. The router registers a request (``admit``); encoders push
its embedding rows in any order; the engine computes the prompt as far as the rows that have
arrived (text before the first image while the encoders still work), samples the first token,
and the prompt's KV is read out for decode. The engine strips the sequence to its M-RoPE delta
once the prompt is done; nothing multimodal stays here."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epd.config import EngineConfig
from epd.engine.engine_loop import EngineLoop, TokenUpdate
from epd.engine.llm_engine import LLMEngine
from epd.engine.memory_profile import with_model_len
from epd.engine.mm_inputs import ItemRows, SequenceMultimodal
from epd.engine.sequence import Sequence, stop_reason
from epd.engine.tensor_parallel import load_engine
from epd.engine.threads import ThreadPolicy
from epd.errors import Cancelled, DeadlineExceeded, EPDError, InvalidRequest, UpstreamError, as_epd_error
from epd.models.registry import family_for
from epd.models.tokenizer_loading import load_tokenizer
from epd.prefill.inbox import EmbeddingInbox
from epd.transport import ready_event_after_writes
from epd.types import TokenLogprobs
from epd.wire.protocol import PrefillJob

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    # [num_layers, 2, tokens, num_kv_heads, head_dim], a fresh copy (tokens: the prompt, and the
    # outputs a migrated request resumed after); None: finished
    kv: torch.Tensor | None
    mrope_delta: int
    num_cached_tokens: int
    finish_reason: str | None  # the request already ends with the first token
    kv_ready: object = None  # CUDA: the event after which ``kv`` is written (consumers wait on it)


@dataclass
class PrefillTicket:
    """One admitted request: what the caller waits on."""

    job: PrefillJob
    updates: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # or an AsyncUpdates
    seq: Sequence | None = None  # set on the loop thread
    kv: torch.Tensor | None = None  # set on the loop thread when the prompt is done
    kv_ready: object = None  # CUDA: the event recorded on the loop's stream after writing ``kv``
    finish_reason: str | None = None  # the request's own, after its first token
    refusal: EPDError | None = None  # why the engine would not take it (then ``updates`` gets an error)


class PrefillWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig, *, overlap_with_encode: bool = True,
                 allocate_kv=None, on_engine_lost: Callable[[str], None] | None = None) -> None:
        """``allocate_kv(shape, dtype)``: where a finished prompt's KV is copied out to (the tier
        passes its TensorStore's shared memory, so the hand-off to decode copies nothing more);
        ``on_engine_lost(reason)``: called once when the engine can never step again (a
        tensor-parallel rank lost; ``EngineLoop``): the worker's process is to stop."""
        model_dir = Path(model_dir)
        self.allocate_kv = allocate_kv
        # True: text before the first image is prefilled while encoders still work (EPD's
        # overlap); False: a request waits for all its rows first
        self.overlap_with_encode = overlap_with_encode
        self.family = family_for(model_dir)
        self.spec = self.family.mm_spec(model_dir)
        self._tickets: dict[str, PrefillTicket] = {}
        self._lock = threading.Lock()
        # built on the loop thread: one thread runs every torch op of this process (engine_loop)
        # (rank 0 of a tensor-parallel engine imports each embedding and sends the rows with the step)
        # in order: a request ends at its first token and its KV is handed over at once (nothing of
        # the next step to overlap with, and its KV must be exactly the prompt's)
        engine_config = with_model_len(engine_config, model_dir).model_copy(update={"async_scheduling": False})
        self.max_model_len = engine_config.max_model_len  # what its health answer tells the routers
        build = functools.partial(LLMEngine, config=engine_config, eos_token_ids=(),
                                  mm_token_ids=self.spec.mm_token_ids, on_finish=self._on_finish,
                                  load_tokenizer=functools.partial(load_tokenizer, model_dir))
        self.loop = EngineLoop(
            lambda: load_engine(model_dir, engine_config, self.spec.mm_token_ids, build),
            name="prefill-loop", threads=ThreadPolicy("prefill", override=engine_config.num_threads),
            on_engine_lost=on_engine_lost).start()
        self.engine = self.loop.engine
        self.inbox = EmbeddingInbox(on_arrival=self.loop.wake, on_failure=self._fail)

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()

    # ---- the router's calls -------------------------------------------------------------------
    def admit(self, job: PrefillJob, updates=None) -> PrefillTicket:
        """Register the request (its rows may be pushed from now on) and queue it on the engine.
        What the engine refuses later (it can never fit) reaches ``wait`` as ``InvalidRequest``.
        ``updates``: where the loop thread puts the request's updates (default: a thread queue,
        for ``wait``; an ``AsyncUpdates`` for ``wait_async``)."""
        ticket = PrefillTicket(job) if updates is None else PrefillTicket(job, updates)
        with self._lock:
            if job.request_id in self._tickets:
                raise InvalidRequest(f"request {job.request_id} is already being prefilled here")
            self._tickets[job.request_id] = ticket
        try:
            rows = self.inbox.expect(job.request_id, [item.length for item in job.items]) if job.items else None
            mm = self._multimodal(job, rows)
        except ValueError as err:
            self._forget(ticket)
            raise InvalidRequest(f"request {job.request_id}: {err}") from None
        except BaseException:
            self._forget(ticket)
            raise
        added = self.loop.watch(lambda engine: self._add(engine, ticket, mm), ticket.updates)
        added.add_done_callback(lambda future: self._refused(ticket, future))
        return ticket

    def _refused(self, ticket: PrefillTicket, added) -> None:
        error = added.exception()
        if error is not None:  # e.g. the prompt can never fit this worker's cache
            ticket.refusal = InvalidRequest(f"request {ticket.job.request_id}: {error}") \
                if isinstance(error, ValueError) else as_epd_error(error)
            ticket.updates.put(TokenUpdate([], error=str(error)))

    def wait(self, ticket: PrefillTicket, timeout_s: float) -> PrefillResult:
        """Blocks until the first token (or the request fails, is aborted, or ``timeout_s`` passes)."""
        try:
            try:
                update: TokenUpdate | None = ticket.updates.get(timeout=max(0.0, timeout_s))
            except queue.Empty:
                update = None
            return self._outcome(ticket, update, timeout_s)
        finally:
            self._forget_on_loop(ticket)

    async def wait_async(self, ticket: PrefillTicket, timeout_s: float) -> PrefillResult:
        """``wait`` for a ticket admitted with ``AsyncUpdates``: costs the caller no thread. A caller
        cancelled while waiting aborts the request."""
        try:
            try:
                update = await ticket.updates.get(timeout_s)
            except asyncio.TimeoutError:
                update = None
            except asyncio.CancelledError:
                self.abort(ticket, "cancelled")  # queued before the forget below: it runs first
                raise
            return self._outcome(ticket, update, timeout_s)
        finally:
            self._forget_on_loop(ticket)

    def _outcome(self, ticket: PrefillTicket, update: TokenUpdate | None, timeout_s: float) -> PrefillResult:
        """What the request's first update means (None: none came within ``timeout_s``)."""
        request_id = ticket.job.request_id
        if update is None:
            self.abort(ticket, "timeout")
            raise DeadlineExceeded(f"request {request_id}: no first token within {timeout_s:.1f} s "
                                   f"({self._rows_arrived(ticket)})")
        if ticket.refusal is not None:
            raise ticket.refusal
        if update.error:
            raise UpstreamError(f"request {request_id}: {update.error}")
        if not update.token_ids:
            raise Cancelled(f"request {request_id}: {update.finish_reason or 'aborted'} before its first token")
        seq = ticket.seq
        return PrefillResult(update.token_ids[0], update.logprobs[0] if update.logprobs else None, ticket.kv,
                             seq.mm.mrope_delta if seq.mm else 0, seq.num_cached_tokens, ticket.finish_reason,
                             ticket.kv_ready)

    def _forget_on_loop(self, ticket: PrefillTicket) -> None:
        # on the loop thread, after any abort queued before: a step that still reads this
        # request's rows (zero-copy views of the encoders' memory) ends before they are released
        self.loop.call(lambda engine: self._forget(ticket))

    def load(self) -> tuple[int, int, int]:
        """(sequences that can compute now, sequences that wait: for KV room, or for rows still being
        encoded, and of those the ones waiting for rows). A snapshot read off the loop thread, for
        health: waiting for encoders is not a stall."""
        sched = self.engine.scheduler
        running = list(sched.running)  # a copy: the loop thread may change the list meanwhile
        computable = sum(1 for seq in running if seq.num_uncomputed_tokens == 0 or seq.schedulable_tokens(1) > 0)
        return computable, len(sched.waiting) + len(running) - computable, len(running) - computable

    def embedding_bytes(self, job: PrefillJob) -> int:
        """Bytes of the rows encoders will push for ``job`` (float32, the encoders' output dtype)."""
        return sum(item.length for item in job.items) * self.spec.embedding_dim * 4

    def abort(self, ticket: PrefillTicket, reason: str = "abort") -> None:
        """Stop this request wherever it is (the router cancelled it); a no-op once it is done.
        By ticket, not by id: a later request reusing the id is not touched."""
        with self._lock:
            is_current = self._tickets.get(ticket.job.request_id) is ticket
        if is_current:
            self.loop.call(lambda engine: self._abort_on_loop(ticket, reason, None))

    def drop(self, ticket: PrefillTicket) -> None:
        """Abort and forget a request nobody will ``wait`` for (its caller left before it heard)."""
        self.abort(ticket, "cancelled")
        self._forget_on_loop(ticket)

    # ---- the encoders' pushes -----------------------------------------------------------------
    def push(self, request_id: str, index: int, tensor: torch.Tensor, release=None) -> bool:
        return self.inbox.push(request_id, index, tensor, release)

    # ---- loop thread --------------------------------------------------------------------------
    def _add(self, engine: LLMEngine, ticket: PrefillTicket, mm: SequenceMultimodal | None) -> Sequence | None:
        job = ticket.job
        with self._lock:
            if self._tickets.get(job.request_id) is not ticket:
                return None  # aborted before the loop got to it
        # prefill samples exactly one token; decode applies the request's real limits after it
        n = len(job.output_token_ids) + 1  # the output this call makes (after a migration's resumed ones)
        one = dataclasses.replace(job.sampling, max_tokens=n, min_tokens=min(job.sampling.min_tokens, n))
        seq = engine.add_request(job.token_ids, one, request_id=job.request_id, mm=mm, mm_items=job.items,
                                 output_token_ids=job.output_token_ids)
        if mm is not None and mm.embeddings is not None:
            rows = mm.embeddings
            seq.inputs_ready_until = mm.inputs_ready_until if self.overlap_with_encode else (
                lambda: None if rows.is_complete() else 0)
        ticket.seq = seq
        return seq

    def _multimodal(self, job: PrefillJob, rows: ItemRows | None) -> SequenceMultimodal | None:
        if not job.items:
            return None  # text only: positions are the token indices, delta 0
        layout = self.family.prompt_layout(self.spec, job.token_ids, job.items)
        return SequenceMultimodal.from_layout(layout, rows)

    def _on_finish(self, seq: Sequence) -> None:
        """Before the blocks are freed: copy out the prompt's KV unless the first token ends the
        request (then decode is never called and nobody would read it)."""
        with self._lock:
            ticket = self._tickets.get(seq.request_id)
        if ticket is None or ticket.seq is not seq or seq.finish_reason == "abort" or seq.num_output_tokens == 0:
            return
        job = ticket.job
        ticket.finish_reason = stop_reason(job.sampling, job.eos_token_ids, seq.num_output_tokens, seq.token_ids[-1])
        if ticket.finish_reason is None:  # decode goes on from every token but the one just sampled
            ticket.kv = self.engine.runner.read_kv(seq.block_table, len(seq) - 1, self.allocate_kv)
            ticket.kv_ready = ready_event_after_writes(ticket.kv)

    def _fail(self, request_id: str, error: str) -> None:
        """A push could not be used: fail the request (its caller gets ``error``)."""
        with self._lock:
            ticket = self._tickets.get(request_id)
        if ticket is not None:
            self.loop.call(lambda engine: self._abort_on_loop(ticket, "abort", f"embeddings unusable: {error}"))

    def _abort_on_loop(self, ticket: PrefillTicket, reason: str, error: str | None) -> None:
        if ticket.seq is not None:
            self.loop.abort(ticket.seq, reason, error=error)
        else:  # not added yet (or refused): tell the caller directly
            ticket.updates.put(TokenUpdate([], finish_reason=reason, error=error))

    def _forget(self, ticket: PrefillTicket) -> None:
        request_id = ticket.job.request_id
        with self._lock:
            if self._tickets.get(request_id) is not ticket:
                return  # already forgotten; the id may belong to a newer request now
            del self._tickets[request_id]
        self.inbox.finish(request_id)

    @staticmethod
    def _rows_arrived(ticket: PrefillTicket) -> str:
        mm = ticket.seq.mm if ticket.seq is not None else None
        if mm is None or mm.embeddings is None:
            return "no embedding rows needed"
        return f"{mm.embeddings.num_ready_rows()} of {mm.embeddings.total_rows} embedding rows arrived"
