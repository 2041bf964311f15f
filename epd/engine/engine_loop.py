"""Runs an ``LLMEngine`` on one thread; other threads (gRPC handlers, an asyncio loop) submit work
and read token streams.

The engine is not thread-safe by design (one owner, like vLLM's EngineCore): every mutation runs on
the loop thread, between steps, through ``call``.

Give the loop a factory rather than a built engine in a serving process: the model is then loaded on
the loop thread too, so every torch op of the tier runs on one thread. That matters on CPU: each
thread that runs a parallel torch op gets its own OpenMP team for life, and once a process holds more
OpenMP threads than cores, libgomp stops spin-waiting between parallel regions (it "throttles"), so
every matmul pays a futex wake-up: a prefill step measured ~1.3x slower with the model loaded on the
main thread and run on the loop thread.

The loop thread also sizes torch's intra-op threads (``epd.engine.threads``) before it builds the engine:
by default from the cores the process may use, as for a tier process whose other threads mostly idle;
a process that keeps other threads busy (the aggregated router's event loop) passes its own policy.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from epd.engine.llm_engine import LLMEngine
from epd.engine.sequence import Sequence, SequenceStatus
from epd.engine.threads import ThreadPolicy
from epd.types import TokenLogprobs

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TokenUpdate:
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class _Watcher:
    """Who gets a sequence's tokens, and how many it has sent. ``updates`` with a ``batch`` (and a
    ``batch_key``) is one request of many that share the batch: its items go there directly. A batch
    with ``columns`` set takes a step's plain tokens (one token, no logprobs, not the last) as
    ``add_token(key, token)``: no update object per request per step."""

    __slots__ = ("seq", "updates", "sent", "batch", "key", "add_token", "group", "first")

    def __init__(self, seq: Sequence, updates, sent: int) -> None:
        self.seq, self.updates, self.sent = seq, updates, sent
        self.batch = getattr(updates, "batch", None) if hasattr(updates, "batch_key") else None
        self.key = updates.batch_key if self.batch is not None else None
        self.add_token = self.batch.add_token if getattr(self.batch, "columns", False) else None
        # plain tokens go out in groups of this many (its router's --stream-interval): held in the
        # sequence itself until the group is complete, counted as the router counts them (the
        # request's first output token alone, then groups), and never the first this loop publishes
        self.group = getattr(updates, "interval", 1)
        self.first = sent  # what was sent before this worker's first publish


class EngineLoop:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], name: str = "engine-loop", *,
                 threads: ThreadPolicy | None = None, on_engine_lost: Callable[[str], None] | None = None) -> None:
        """``engine``: the engine, or a zero-argument factory that ``start`` runs on the loop thread;
        ``threads``: the intra-op thread policy the loop thread applies first (default: no busy
        threads besides it, no override; ``name`` is the role it logs); ``on_engine_lost(reason)``:
        a worker's way out when its engine can never step again (a tensor-parallel rank lost): the
        loop stops without failing its requests, which the process's end moves to other workers
        (without it, they fail and the engine reports itself unhealthy)."""
        self._on_engine_lost = on_engine_lost
        self._make_engine = (lambda: engine) if hasattr(engine, "step") else engine  # an engine, or its factory
        self._threads = threads or ThreadPolicy(role=name)
        self.engine: LLMEngine | None = None  # set on the loop thread by start()
        self._calls: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._watchers: dict[int, _Watcher] = {}  # seq id -> who gets its tokens
        # the batches (``updates.batch``: anything with ``flush()``) that got updates since the last
        # flush: they hand them on once a step, not once per update
        self._touched: set = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float | None = None) -> "EngineLoop":
        """Start the thread; with a factory, return once it built the engine (or raise its error)."""
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name=self._name, daemon=True)
        self._thread.start()
        built.result(timeout_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wake(self) -> None:
        """Inputs arrived (e.g. embeddings): retry scheduling now. Whatever can unblock a waiting
        sequence calls this (arrivals) or ``call`` (aborts, new work): an idle loop sleeps until then."""
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def watch(self, make_seq: Callable[[LLMEngine], Sequence | None], updates) -> Future[Sequence | None]:
        """Add a request on the loop thread (``make_seq`` may decline: return None); its new tokens
        go to ``updates.put(TokenUpdate)``, called on the loop thread (a queue, or a bridge into an
        event loop). An ``updates`` with a ``batch`` (anything with ``flush()``) is one request of
        many that share it: the batch is flushed once after each step that gave any of them
        tokens, so they can leave together. -> Future of the sequence (or of ``make_seq``'s
        exception)."""
        def add(engine: LLMEngine) -> Sequence | None:
            seq = make_seq(engine)
            if seq is not None:
                self._watchers[seq.seq_id] = _Watcher(seq, updates, len(seq.output_token_ids))
            return seq

        return self.call(add)

    def abort(self, seq: Sequence, reason: str = "abort", *, error: str | None = None) -> None:
        """Stop ``seq`` wherever it is; its watcher gets a last update with ``reason``, or with
        ``error`` when the request failed (e.g. its embeddings could not be imported)."""
        def do(engine: LLMEngine) -> None:
            if not seq.is_finished:
                seq.finish_reason = reason
                engine.abort(seq)
            if error is not None and seq.seq_id in self._watchers:
                self._put(self._watchers.pop(seq.seq_id), TokenUpdate([], error=error))
            self._publish(seq)

        self.call(do)

    # ---- loop thread --------------------------------------------------------------------------
    def _run(self, built: Future[None]) -> None:
        try:
            self._threads.apply()  # here: torch sizes the team of the thread that calls it
            self.engine = self._make_engine()
        except BaseException as err:  # noqa: BLE001 - start() re-raises it in the caller
            built.set_exception(err)
            return
        if self._on_engine_lost is not None and self.engine.runner.ranks is not None:
            self.engine.runner.ranks.watch(self._on_engine_lost)  # a lost rank ends the worker even while idle
        built.set_result(None)
        while not self._stop.is_set():
            self._wake.clear()  # before looking: a wake() from now on is seen by the wait below
            self._drain_calls()
            self._flush_batches()  # what the calls published (aborts, failures) goes out now
            if not self.engine.has_unfinished or not self._step():
                self._wake.wait()  # nothing to do, or every sequence waits on inputs: sleep until woken

    def _drain_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:  # noqa: BLE001 - the caller gets the error
                    future.set_exception(err)

    def _step(self) -> bool:
        steps_before = self.engine.num_steps
        try:
            self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the requests, keep the worker alive
            if self._on_engine_lost is not None and not self.engine.healthy:
                log.error("engine step failed and the engine cannot go on (%s): stopping, its requests move", err)
                self._stop.set()
                self._on_engine_lost(f"engine step failed: {err}")
                return False
            log.exception("engine step failed; failing the running requests")
            self._fail_all(f"engine step failed: {err}")
            return False
        self._publish_step()
        self._flush_batches()
        return self.engine.num_steps > steps_before

    def _publish_step(self) -> None:
        """Every watched sequence's new tokens after a step. The common case of a decode step, one
        plain token of a running sequence whose batch takes columns, goes straight to the batch
        (~0.3 against ~0.75 us a request here: at batch 256 that was 0.19 ms a step); the rest goes
        through ``_publish_to``."""
        running, touched = SequenceStatus.RUNNING, self._touched
        for watcher in list(self._watchers.values()):
            seq, add_token = watcher.seq, watcher.add_token
            if seq.status is running and seq.error is None and not seq.output_logprobs:
                tokens = seq.token_ids
                sent = len(tokens) - seq.num_prompt_tokens
                group = watcher.group
                grouped = group > 1 and sent > watcher.sent and watcher.sent != watcher.first
                if grouped and (sent - 1) // group == (watcher.sent - 1) // group:
                    continue  # its group is not complete: the tokens wait in the sequence
                if add_token is not None and (grouped or sent == watcher.sent + 1):
                    if sent == watcher.sent + 1:
                        add_token(watcher.key, tokens[-1])
                    else:  # a group: its tokens as columns, in order
                        for token in tokens[len(tokens) - (sent - watcher.sent):]:
                            add_token(watcher.key, token)
                    watcher.sent = sent
                    touched.add(watcher.batch)
                    continue
            self._publish_to(watcher)

    def _put(self, watcher: "_Watcher", update: TokenUpdate) -> None:
        """``watcher.updates.put(update)``; for one of a batch's, its item added to the batch here
        (what its ``put`` would do, without the call), and the batch flushed after the step."""
        batch = watcher.batch
        if batch is None:
            watcher.updates.put(update)
            return
        batch.add((watcher.key, update))
        self._touched.add(batch)

    def _flush_batches(self) -> None:
        for batch in self._touched:
            batch.flush()
        self._touched.clear()

    def _publish(self, seq: Sequence) -> None:
        watcher = self._watchers.get(seq.seq_id)
        if watcher is not None:
            self._publish_to(watcher)

    def _publish_to(self, watcher: "_Watcher") -> None:
        """The watched sequence's tokens it has not sent yet (every watched sequence, every step:
        kept to plain attribute work)."""
        seq = watcher.seq
        if seq.error is not None:  # failed where it stood (e.g. it could not be rebuilt to recompute)
            self._put(watcher, TokenUpdate([], error=seq.error))
            del self._watchers[seq.seq_id]
            return
        finished = seq.status is SequenceStatus.FINISHED
        sent = watcher.sent
        first = seq.num_prompt_tokens + sent  # not seq.output_token_ids: a copy of every output, each step
        if len(seq.token_ids) > first or finished:
            self._put(watcher, TokenUpdate(seq.token_ids[first:], seq.output_logprobs[sent:] if seq.output_logprobs
                                           else [], seq.finish_reason if finished else None))
            watcher.sent = len(seq.token_ids) - seq.num_prompt_tokens
        if finished:
            del self._watchers[seq.seq_id]

    def _fail_all(self, error: str) -> None:
        for watcher in list(self._watchers.values()):
            if not watcher.seq.is_finished:
                self.engine.abort(watcher.seq)
            self._put(watcher, TokenUpdate([], error=error))
        self._watchers.clear()
        self._flush_batches()  # the loop may sleep next: the failures must not wait for a wake-up
