"""The decode batch kept from step to step (what vLLM calls its persistent batch).

While every running sequence is decoding and none joins or leaves, a step differs from the one
before in one way: each sequence is one token further. So its inputs are the last step's arrays
moved on by one (positions, the tokens just sampled, the same block-table rows), not read again
from every sequence, and what the step's tokens change is array arithmetic too: which sequences
filled a page (to publish for the prefix cache), which need a new one, which may have stopped.
What stays per sequence is what the sequences themselves hold: the token appended to its list
and its computed count (every other part of the engine, the tiers and a migration read them).

Sequences join and leave it as rows: an imported one (a decode worker's request, its KV written
at admission) is appended, a finished one removed. The batch is rebuilt from the scheduler's
running list when that list changed otherwise (an abort: ``Scheduler.changes``) or a step ran
without it (``invalidate``): a step that prefills or preempts is the scheduler's general case, and
runs as one. Sequences the arrays cannot describe
(a token still on the device, inputs that arrive later, a KV still to import) leave it to the
general case too.
"""
from __future__ import annotations

import numpy as np

from epd.engine.block_manager import BlockManager
from epd.engine.block_tables import BlockTableMirror
from epd.engine.sampler import SampleRows
from epd.engine.scheduler import Scheduler
from epd.engine.sequence import Sequence, SequenceStatus
from epd.types import TokenLogprobs


class DecodeBatch:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: list[Sequence] = []
        self.changes = -1  # the scheduler's count of changes when the arrays were built
        self.stale = True
        self.starts = self.deltas = self.rows = self.pages = self.token_ids = self.tokens_left = np.zeros(0, np.int64)
        self.ending = np.zeros(1, dtype=bool)  # token id -> may end some sequence (the last entry: past every one)
        self.sample_rows: SampleRows | None = None

    def invalidate(self) -> None:
        """A step ran without this batch: the sequences moved on, the arrays did not."""
        self.stale = True

    def usable(self, scheduler: Scheduler, mirror: BlockTableMirror) -> bool:
        """Whether this step can start from the arrays: nothing waits to be prefilled and every
        running sequence decodes (rebuilt here when they changed). Imported sequences may wait:
        the step admits them itself (``join``)."""
        if scheduler.waiting:
            return False
        if self.stale or self.changes != scheduler.changes:
            if not self._build(scheduler.running, mirror):
                return False
            self.changes, self.stale = scheduler.changes, False
        return True

    def fits(self, scheduler: Scheduler) -> bool:
        """Every sequence of the batch in this step's token budget, and at least one."""
        return 0 < len(self.seqs) <= scheduler.config.max_num_batched_tokens

    def _build(self, running: list[Sequence], mirror: BlockTableMirror) -> bool:
        # the newest first: a sequence still prefilling is usually at the end, and ends the pass there
        columns = _columns(reversed(running))
        if columns is None:
            return False
        columns.reverse()
        self.seqs = list(running)
        self._set_columns(np.array(columns, dtype=np.int64).reshape(-1, 5))
        self.rows = mirror.rows_for(self.seqs)
        self._may_end_with(self.seqs)
        self.sample_rows = SampleRows(self.seqs)
        return True

    def _set_columns(self, columns: np.ndarray) -> None:
        self.starts, self.deltas, self.pages, self.token_ids, self.tokens_left = columns.T.copy()

    def _may_end_with(self, seqs: list[Sequence]) -> None:
        ending = frozenset().union(*(seq.ending_tokens for seq in seqs))
        if ending and max(ending) + 2 > len(self.ending):
            self.ending = np.concatenate([self.ending[:-1], np.zeros(max(ending) + 3 - len(self.ending), dtype=bool)])
        self.ending[list(ending)] = True  # may only grow: a token that ends none is checked exactly, once

    def join(self, seqs: list[Sequence], scheduler: Scheduler, mirror: BlockTableMirror) -> bool:
        """Sequences admitted to decode this step (imported, their KV written) become rows at the
        end -> False when one cannot (the general step takes them)."""
        columns = _columns(seqs)
        if columns is None:
            self.stale = True
            return False
        both = np.concatenate([np.stack([self.starts, self.deltas, self.pages, self.token_ids, self.tokens_left], 1),
                               np.array(columns, dtype=np.int64)])
        self._set_columns(both)
        if mirror.num_free_rows >= len(seqs):  # rows of their own, no other's taken
            self.rows = np.concatenate([self.rows, mirror.rows_for(seqs)])
            self.seqs = self.seqs + seqs
        else:  # the mirror must evict: every row this batch uses is marked first
            self.seqs = self.seqs + seqs
            self.rows = mirror.rows_for(self.seqs)
        self._may_end_with(seqs)
        self.sample_rows = self.sample_rows.joined(seqs)
        self.changes = scheduler.changes
        return True

    def leave(self, finished: list[Sequence], scheduler: Scheduler, mirror: BlockTableMirror) -> None:
        """Sequences that finished (the scheduler freed them): their rows go."""
        gone = {seq.seq_id for seq in finished}
        keep = np.array([seq.seq_id not in gone for seq in self.seqs], dtype=bool)
        self.seqs = [seq for seq, kept in zip(self.seqs, keep.tolist()) if kept]
        for name in ("starts", "deltas", "pages", "token_ids", "tokens_left", "rows"):
            setattr(self, name, getattr(self, name)[keep])
        for seq in finished:
            mirror.release(seq)
        self.sample_rows = self.sample_rows.kept(keep)
        self.changes = scheduler.changes

    def take_pages(self, block_manager: BlockManager, mirror: BlockTableMirror) -> bool:
        """A page for each sequence whose token this step starts one -> False (and nothing taken)
        when the cache has too few free: the scheduler's general case preempts."""
        needing = np.flatnonzero(self.starts >= self.pages * self.block_size)
        if not len(needing):
            return True
        if len(needing) > block_manager.num_free_blocks:
            return False
        for i in needing.tolist():
            seq = self.seqs[i]
            block_manager.append_slots(seq)
            mirror.refresh(seq)
        self.pages[needing] += 1
        return True

    def advance(self, tokens: list[int], logprobs: dict[int, TokenLogprobs | None],
                block_manager: BlockManager) -> list[Sequence]:
        """The step's tokens (one per sequence, in order) are known: each sequence takes its own,
        full pages are published, and the sequences those tokens ended are returned (finished)."""
        seqs = self.seqs
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
            seq.num_computed_tokens += 1
        for i, row_logprobs in logprobs.items():
            if row_logprobs is not None:
                seqs[i].output_logprobs.append(row_logprobs)
        self.starts = self.starts + 1
        self.token_ids = np.array(tokens, dtype=np.int64)
        self.tokens_left = self.tokens_left - 1
        if block_manager.enable_prefix_caching:
            for i in np.flatnonzero(self.starts % self.block_size == 0).tolist():  # the input's page is full
                block_manager.mark_computed(seqs[i])
        ending = self.ending
        may_end = (self.tokens_left <= 0) | ending[np.minimum(self.token_ids, len(ending) - 1)]
        return [seqs[i] for i in np.flatnonzero(may_end).tolist() if seqs[i].check_stop()]


def _columns(seqs) -> list[tuple[int, int, int, int, int]] | None:
    """Each decoding sequence's (position of its input token, M-RoPE delta, pages, input token,
    tokens left before its length) -> None at the first that is not a plain decode."""
    columns = []
    for seq in seqs:
        computed, known = seq.num_computed_tokens, len(seq.token_ids)
        if known - computed != 1 or seq.num_pending_tokens or seq.inputs_ready_until is not None \
                or seq.imported_kv is not None or seq.status is not SequenceStatus.RUNNING:
            return None
        columns.append((computed, seq.mm.mrope_delta if seq.mm is not None else 0, len(seq.block_table),
                        seq.token_ids[-1], seq.sampling_params.max_tokens - (known - seq.num_prompt_tokens)))
    return columns
