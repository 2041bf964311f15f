"""Continuous batching with chunked prefill and preemption by recompute (plain Python, no torch).

One step is a token budget shared by every running sequence: decodes (one token each) first,
then prefill chunks of partly-prefilled sequences, then newly admitted ones. A prompt longer
than the budget is cut into chunks across steps; a chunk may cut through an image.

Sequences whose prompt KV was computed elsewhere (a decode worker's) wait in ``importing`` until
their whole token budget fits, FIFO; then they run like any other. Waiting here is no poll: each
step that frees blocks is followed by a schedule that retries them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.engine.block_manager import BlockManager
from epd.engine.sequence import Sequence, SequenceStatus
from epd.types import TokenLogprobs


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")


class ScheduledChunk:
    """Compute KV for ``seq.token_ids[start:start + num_tokens]`` this step. ``samples``: the chunk
    reaches the last token, so it produces logits for the next one (fixed when it is scheduled:
    the sequence grows only after the step). A plain class: one is made per sequence per step."""

    __slots__ = ("seq", "start", "num_tokens", "end", "samples")

    def __init__(self, seq: Sequence, start: int, num_tokens: int) -> None:
        self.seq, self.start, self.num_tokens = seq, start, num_tokens
        self.end = start + num_tokens
        self.samples = self.end == len(seq.token_ids) + seq.num_pending_tokens  # len(seq), without its call

    def __repr__(self) -> str:
        return f"ScheduledChunk({self.seq.request_id}, start={self.start}, num_tokens={self.num_tokens})"


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    imported: list[Sequence] = field(default_factory=list)  # admitted this step: write their KV first
    num_waiting_on_inputs: int = 0  # sequences skipped because their next rows have not arrived

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 on_finish: Callable[[Sequence], None] | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        # called for each finished sequence before its blocks are freed (the prefill tier exports
        # the KV here)
        self.on_finish = on_finish
        self.waiting: deque[Sequence] = deque()
        self.importing: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # counts every change to ``running`` (a batch kept from step to step is valid while it stays)
        self.changes = 0

    def add(self, seq: Sequence) -> None:
        limit = self.config.max_model_len
        if seq.num_prompt_tokens + seq.sampling_params.max_tokens > limit:
            raise ValueError(f"request {seq.request_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.sampling_params.max_tokens}) exceeds max_model_len={limit}")
        needed = seq.num_blocks_needed(self.block_manager.block_size, len(seq) + 1)
        if needed > self.block_manager.num_total_blocks:
            raise ValueError(f"request {seq.request_id}: prompt needs {needed} KV blocks, the cache has "
                             f"{self.block_manager.num_total_blocks} in all")
        self.waiting.append(seq)

    def add_imported(self, seq: Sequence, num_reserved_tokens: int) -> None:
        """Queue a sequence whose prompt KV was computed elsewhere (``seq.imported_kv``) and whose
        first token is already appended. At admission it gets blocks for ``num_reserved_tokens``
        (its whole budget: it can never be recomputed here, so it must never be preempted)."""
        needed = seq.num_blocks_needed(self.block_manager.block_size, num_reserved_tokens)
        if needed > self.block_manager.num_total_blocks:
            raise ValueError(f"request {seq.request_id}: {num_reserved_tokens} tokens need {needed} KV blocks, "
                             f"the cache has {self.block_manager.num_total_blocks} in all")
        seq.num_reserved_tokens = num_reserved_tokens
        self.importing.append(seq)

    def abort(self, seq: Sequence) -> None:
        self.changes += 1
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.importing:
            self.importing.remove(seq)
            seq.imported_kv = seq.imported_kv_source = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.importing)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(imported=self.admit_imported())
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def schedule_beside(self, kept: set[int], num_kept: int) -> SchedulerOutput | None:
        """A step's chunks beside ``num_kept`` decodes kept as rows elsewhere (``kept``: their
        sequence ids): the other running sequences' chunks, then admissions, in the budget the rows
        leave -> None when that needed a preemption (which may have taken a row: the general
        ``schedule`` takes the step over)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - num_kept
        if len(self.running) > num_kept:
            running = SequenceStatus.RUNNING
            for seq in [seq for seq in self.running if seq.seq_id not in kept]:
                if budget == 0:
                    break
                if seq.status is running:
                    budget = self._schedule_one(seq, out, budget)
            if out.preempted:
                return None
        self._schedule_waiting(out, budget)
        return out

    def admit_imported(self) -> list[Sequence]:
        """The imported sequences that fit now, running from here: their KV is to be written first."""
        admitted = []
        while self.importing and len(self.running) < self.config.max_num_seqs:
            seq = self.importing[0]
            if not self.block_manager.allocate(seq, num_tokens=seq.num_reserved_tokens):
                break  # FIFO: a later, smaller one does not overtake (it would starve big ones)
            self.importing.popleft()
            self.changes += 1
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = len(seq) - 1  # all but the first token, once the engine writes the KV
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # decodes first: they are latency-bound and cost one token each; each group in its running
        # order. One pass schedules the decodes and sets the prefills aside (a copy of the list:
        # a preemption removes from it). A sequence is classed before any preemption of this step.
        prefills = []
        block_size, running = self.block_manager.block_size, SequenceStatus.RUNNING
        chunks = out.chunks
        for seq in tuple(self.running):
            # len(seq) (a token still on the device is this step's input), without a call per sequence
            length = len(seq.token_ids) + seq.num_pending_tokens
            if length - seq.num_computed_tokens > 1:
                prefills.append(seq)
                continue
            if budget == 0:
                return 0
            if seq.status is not running:  # preempted by an earlier iteration of this loop
                continue
            if seq.inputs_ready_until is None and len(seq.block_table) * block_size >= length:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))  # the common decode step
                budget -= 1
            else:
                budget = self._schedule_one(seq, out, budget)
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is running:
                budget = self._schedule_one(seq, out, budget)
        return budget

    def _schedule_one(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """The general case: what the inputs allow, blocks found (preempting if need be)."""
        n = seq.schedulable_tokens(budget)
        if n == 0:
            out.num_waiting_on_inputs += 1
            return budget
        if not self._make_room(seq, out):
            return budget
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        return budget - n

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Ensure ``seq`` has blocks for all its tokens, preempting the newest others if needed."""
        bm = self.block_manager
        if len(seq.block_table) * bm.block_size >= len(seq):  # the common decode step: its block has room
            return True
        while not bm.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        bm.append_slots(seq)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.changes += 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        out.preempted.append(seq)
        out.chunks[:] = [c for c in out.chunks if c.seq is not seq]
        try:
            seq.reset_for_recompute()  # may rebuild stripped inputs (re-encode): it can fail
        except Exception as err:  # noqa: BLE001 - fail this sequence, not the step and every other one
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            seq.error = f"preempted and could not be recomputed: {err}"
            return
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            self.changes += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = seq.schedulable_tokens(budget)
            if n == 0:  # admitted (its prefix-cache hits are held) but waits for its inputs
                out.num_waiting_on_inputs += 1
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n

    def update(self, out: SchedulerOutput,
               sampled: dict[int, tuple[int, TokenLogprobs | None]]) -> list[Sequence]:
        """The step ran and its tokens are known (seq_id -> (token id, logprobs)): ``advance`` then
        ``complete``; returns the sequences that finished."""
        seqs = self.advance(out)
        return self.complete(seqs, [sampled.get(seq.seq_id) for seq in seqs])

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The step ran: computed counts move on, and each sequence that sampled has a token pending
        (known once ``complete`` gets it; with async scheduling, after the next step is launched).
        Returns the sampling sequences, in the step's order."""
        samplers = []
        mark_computed, block_size = self.block_manager.mark_computed, self.block_manager.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if chunk.num_tokens > 1 or chunk.end % block_size == 0:  # a one-token chunk fills a block only here
                mark_computed(seq)  # the blocks whose tokens are all known here
            if chunk.samples:
                seq.num_pending_tokens += 1
                samplers.append(seq)
        return samplers

    def complete(self, seqs: list[Sequence], tokens: list[tuple[int, TokenLogprobs | None] | None]
                 ) -> list[Sequence]:
        """The pending tokens of ``seqs`` (one each; None: none came) are known: append them and
        return the sequences they finished. A sequence that ended meanwhile (aborted, or finished by
        its previous token while this one was in flight) drops its token."""
        finished = []
        mark_computed, block_size = self.block_manager.mark_computed, self.block_manager.block_size
        done = SequenceStatus.FINISHED
        for seq, token in zip(seqs, tokens):  # per sequence per step: kept to plain attribute work
            seq.num_pending_tokens -= 1
            if token is None or seq.status is done:
                continue
            token_id, logprobs = token
            seq.token_ids.append(token_id)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs)
            if seq.num_pending_tokens:  # async: the next token is in flight, this one was the step's input
                computed = seq.num_computed_tokens
                if computed % block_size == 0 and computed == len(seq.token_ids):
                    mark_computed(seq)  # a block whose last token was in flight when it was computed
            if seq.check_stop():
                finished.append(seq)
        self.finish(finished)
        return finished

    def finish(self, finished: list[Sequence]) -> None:
        """Sequences that their last token ended: the tier hears of each, then their blocks go."""
        if finished:
            self.changes += 1
        for seq in finished:
            if self.on_finish is not None:
                self.on_finish(seq)
            if seq in self.waiting:  # preempted while its token was in flight: it had no blocks left
                self.waiting.remove(seq)
            else:
                self.running.remove(seq)
                self.block_manager.free(seq)
